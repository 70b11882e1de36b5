"""`bench.py serve` (benchmarks/serve.py): its request lists have the token counts they
claim and are the same every time; its statistics are vLLM's; end to end on the tiny model
every request completes with the tokens it asked for, nanokv's prefix cache hits where
prompts share prefixes, and transformers serve produces the same token counts (timings are
never asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
try:
    from benchmarks import serve  # noqa: E402
finally:
    sys.path.remove(ROOT)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def test_workloads_have_their_token_counts_and_are_deterministic(tokenizer):
    spec = serve.workload_spec("random", num_requests=12, scale=0.25)
    assert (spec["input"], spec["output"]) == ((16, 128), (8, 64))
    sessions = serve.build_sessions(spec, tokenizer, seed=3)
    assert sessions == serve.build_sessions(spec, tokenizer, seed=3)
    assert sessions != serve.build_sessions(spec, tokenizer, seed=4)
    assert len(sessions) == 12 and all(len(s.turns) == 1 and s.system is None for s in sessions)
    assert all(16 <= tokens(tokenizer, s.turns[0].user) <= 128 and 8 <= s.turns[0].max_tokens <= 64
               for s in sessions)

    shared = serve.build_sessions(serve.workload_spec("shared-prefix", num_requests=16, scale=0.125), tokenizer)
    systems = {s.system for s in shared}
    assert len(shared) == 16 and len(systems) == 8
    assert all(tokens(tokenizer, t) == 128 for t in systems)
    assert all(tokens(tokenizer, s.turns[0].user) == 16 and s.turns[0].max_tokens == 16 for s in shared)

    talks = serve.build_sessions(serve.workload_spec("multi-turn", num_requests=8, scale=0.125), tokenizer)
    assert len(talks) == 2 and all(len(s.turns) == 4 for s in talks)
    with pytest.raises(ValueError, match="--num-requests"):
        serve.workload_spec("random", num_requests=0)


def test_loads_arrivals_and_statistics():
    assert [load.label for load in serve.loads_for("random", [0.5, 2], 16)] == \
        ["0.5 req/s", "2 req/s", "concurrency 16"]
    assert [load.label for load in serve.loads_for("multi-turn", [1], 4)] == ["concurrency 4"]
    times = serve.arrival_times(2000, 4.0, seed=1)
    assert times[0] == 0 and times == sorted(times) and times == serve.arrival_times(2000, 4.0, seed=1)
    assert 3.6 < len(times) / times[-1] < 4.4  # Poisson at 4/s
    assert serve.arrival_times(3, None, 0) == [0.0, 0.0, 0.0]
    assert serve.percentile([4, 1, 3, 2], 50) == 2.5 and serve.percentile([1, 2, 3, 4, 5], 99) == pytest.approx(4.96)
    assert serve.percentile([], 50) is None

    R = serve.RequestResult
    results = [R(True, ttft=0.1, e2e=1.1, itl=[0.5, 0.5], output_tokens=3, expected_tokens=3),
               R(True, ttft=0.3, e2e=0.3, output_tokens=1, expected_tokens=1), R(False, "HTTP 503", expected_tokens=9)]
    s = serve.summarize(results, 2.0)
    assert (s["completed"], s["failed"], s["output_tokens"], s["expected_output_tokens"]) == (2, 1, 4, 13)
    assert (s["output_tok_per_s"], s["request_per_s"]) == (2.0, 1.0)
    assert (s["ttft_ms_p50"], s["tpot_ms_p50"], s["itl_ms_p99"], s["e2e_s_p50"]) == (200.0, 500.0, 500.0, 0.7)
    assert s["errors"] == ["HTTP 503"] and "cached_prompt_tokens" not in s

    cached = serve.summarize([R(True, ttft=0.1, e2e=0.2, output_tokens=2, prompt_tokens=40, cached_tokens=30),
                              R(True, ttft=0.1, e2e=0.2, output_tokens=2, prompt_tokens=60, cached_tokens=0)], 1.0)
    assert cached["cached_prompt_tokens"] == 30
    row = dict(workload="w", engine="llama.cpp", load="concurrency 2", requests=2, **cached)
    assert "| 30% (usage) | - |" in serve.table_rows([row])[2]


def test_metrics_parsing_and_the_request_bodies():
    text = ('# HELP x\nnanokv:kv_cache_used_blocks{engine="0",model_name="m"} 7.0\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 5.0\n'
            'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 3.0\n'
            'vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.1",model_name="m"} 1.0\nplain 2\n')
    assert serve.parse_metrics(text) == {"nanokv:kv_cache_used_blocks": 7.0, "vllm:prefix_cache_hits_total": 5.0,
                                         "plain": 2.0}
    setup = serve.Setup("/m", "/m.gguf", 4096, 512, 2, "/bin/llama-server", 10, "/tmp")
    messages = [{"role": "user", "content": "Hi"}]
    nano = serve.Engine("nanokv", setup).body(messages, 8)
    assert nano["ignore_eos"] is True and nano["stream_options"] == {"include_usage": True}
    assert nano["temperature"] == 0 and nano["max_tokens"] == 8
    hf = serve.Engine("transformers", setup)
    hf.model = None
    body = hf.body(messages, 8)
    assert "ignore_eos" not in body and "model" not in body  # transformers serve refuses unknown fields
    assert json.loads(body["generation_config"]) == {"eos_token_id": -1, "do_sample": False}
    cmd, env = hf.command(1234)
    assert cmd[1:4] == ["serve", "/m", "--continuous-batching"] and env["HF_HUB_OFFLINE"] == "1"
    assert cmd[cmd.index("--cb-num-blocks") + 1] == "16"  # 4096 tokens in 256-token pages
    cmd, _ = serve.Engine("nanokv-no-prefix-cache", setup).command(1234)
    assert "--no-enable-prefix-caching" in cmd and cmd[cmd.index("--num-kvcache-blocks") + 1] == "256"
    cmd, _ = serve.Engine("llama.cpp", setup).command(1234)
    assert cmd[:3] == ["/bin/llama-server", "-m", "/m.gguf"] and cmd[cmd.index("-c") + 1] == "4096"


def run_bench(*args: str) -> dict:
    out = subprocess.run([sys.executable, "bench.py", "serve", *args, "--json"], cwd=ROOT, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.mark.slow
def test_bench_serve_shares_prefixes_on_nanokv(model_dir):
    report = run_bench("--model", model_dir, "--engines", "nanokv,nanokv-no-prefix-cache,llama.cpp",
                       "--workload", "shared-prefix,multi-turn", "--num-requests", "16", "--scale", "0.125",
                       "--max-concurrency", "4",
                       "--kv-tokens", "4096")
    runs = {(r["workload"], r["engine"], r["load"]): r for r in report["runs"]}
    assert sorted(runs) == [("multi-turn", "nanokv", "concurrency 4"),
                            ("multi-turn", "nanokv-no-prefix-cache", "concurrency 4"),
                            ("shared-prefix", "nanokv", "concurrency 4"),
                            ("shared-prefix", "nanokv-no-prefix-cache", "concurrency 4")]
    for r in runs.values():
        assert (r["completed"], r["failed"]) == (r["requests"], 0), r
        assert r["output_tokens"] == r["expected_output_tokens"] > 0  # EOS ignored: every token asked for
        assert r["ttft_ms_p50"] > 0 and r["output_tok_per_s"] > 0
        assert 0 < r["nanokv"]["peak_kv_used_blocks"] <= r["nanokv"]["kv_total_blocks"] == 256
    assert runs["shared-prefix", "nanokv", "concurrency 4"]["requests"] == 16
    assert runs["multi-turn", "nanokv", "concurrency 4"]["requests"] == 16  # 4 conversations x 4 turns
    cached = runs["shared-prefix", "nanokv", "concurrency 4"]["nanokv"]
    assert cached["prefix_cache_hit_rate"] > 0.3  # 8 groups of 2 share 128-token system prompts
    assert runs["shared-prefix", "nanokv-no-prefix-cache", "concurrency 4"]["nanokv"]["prefix_cache_hit_tokens"] == 0
    assert runs["multi-turn", "nanokv", "concurrency 4"]["nanokv"]["prefix_cache_hit_rate"] > 0.3  # the history
    assert any("TTFT p50 without / with the prefix cache" in line for line in report["comparisons"])
    assert len(report["notes"]) == 1 and report["notes"][0].startswith("llama.cpp skipped: ")


@pytest.mark.slow
def test_bench_serve_random_on_nanokv_and_transformers_serve_offline(model_dir):
    pytest.importorskip("openai")  # transformers serve answers with openai's types
    report = run_bench("--model", model_dir, "--engines", "nanokv,transformers", "--workload", "random",
                       "--num-requests", "4", "--scale", "0.1", "--request-rates", "", "--max-concurrency", "2",
                       "--kv-tokens", "2048")
    nano, hf = report["runs"]
    assert (nano["engine"], hf["engine"], nano["load"], hf["load"]) == ("nanokv", "transformers", "concurrency 2",
                                                                        "concurrency 2")
    for r in (nano, hf):
        assert (r["completed"], r["output_tokens"]) == (4, r["expected_output_tokens"]), r
    assert nano["prompt_tokens"] == hf["prompt_tokens"]  # one chat template, one tokenizer
    assert report["comparisons"][0].startswith("random, concurrency 2: nanokv / transformers serve (CB) output")
