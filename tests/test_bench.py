"""bench.py end to end on a tiny checkpoint: every engine gets the same requests and the
report's ratios, token counts and roofline are filled in (timings are never asserted)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # subprocesses / whole benchmark runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
try:
    from benchmarks import engines, micro, workloads  # noqa: E402
finally:
    sys.path.remove(ROOT)


def test_bench_reports_nanokv_and_hf_side_by_side(model_dir):
    expected = sum(r.max_tokens for r in workloads.make_workload("tiny", 1024))
    out = subprocess.run([sys.executable, "bench.py", "--workload", "tiny", "--model", model_dir, "--engines",
                          "nanokv,hf", "--hf-batch-sizes", "4,8", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    rows = {r["engine"]: r for r in report["results"]}
    assert rows["nanokv"]["output_tokens"] == rows["HF generate"]["output_tokens"] == expected
    assert rows["HF generate"]["ratio_to_hf_generate"] == 1.0
    assert rows["HF generate"]["note"].startswith(("batch 4 ", "batch 8 "))
    assert rows["nanokv"]["note"] == "fastest of 2 runs" and len(rows["nanokv"]["runs"]) == 2
    assert set(rows["HF generate"]["tried"]) == {"4", "8"}  # JSON keys
    assert rows["nanokv"]["ratio_to_hf_generate"] > 0
    assert rows["nanokv"]["steps"] > 0 and rows["nanokv"]["kv"]["num_preemptions"] == 0
    assert report["roofline"]["floor_seconds"] > 0 and report["roofline"]["percent"] > 0
    assert 0 <= report["outside_forward_percent"] < 100


def test_kv_cache_dtype_rows_and_the_long_workload(model_dir):
    """--kv-cache-dtype auto,int8: one nanokv row each, in one byte budget, each reporting
    its pool's token capacity (from the byte formula), bytes per token and peak concurrent
    sequences; the int8 pool holds more tokens."""
    long = workloads.WORKLOADS["long"]
    assert long["prompt"][0] >= 1024 and long["output"][0] >= long["prompt"][1] / 4  # long, and decode-heavy
    args = argparse.Namespace(dtype="float32", quantization="none", kv_cache_dtype="auto,int8",
                                    cpu_width="native")
    assert [v.label for v in engines.nanokv_variants(args)] == ["nanokv", "nanokv kv int8"]
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        engines.nanokv_variants(argparse.Namespace(dtype="float32", quantization="none",
                                                       kv_cache_dtype="int4", cpu_width="native"))
    budget = 4 << 20
    out = subprocess.run([sys.executable, "bench.py", "--workload", "tiny", "--model", model_dir, "--engines",
                          "nanokv", "--kv-cache-dtype", "auto,int8", "--kv-cache-memory-bytes", str(budget),
                          "--repeats", "1", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    rows = {r["engine"]: r for r in report["results"]}
    auto, int8 = rows["nanokv"], rows["nanokv kv int8"]
    assert (auto["kv_cache_dtype"], int8["kv_cache_dtype"], report["kv_cache_memory_bytes"]) == ("auto", "int8", budget)
    for row in (auto, int8):
        assert row["kv_capacity_tokens"] == budget // (16 * row["kv_bytes_per_token"]) * 16
        assert 1 <= row["peak_running_seqs"] <= 8
    from nanokv.config import load_hf_config, model_head_dim

    d = model_head_dim(load_hf_config(model_dir))
    assert int8["kv_bytes_per_token"] * 4 * d == auto["kv_bytes_per_token"] * (d + 4)  # int8 + 4 bytes a head
    assert int8["kv_capacity_tokens"] > 3 * auto["kv_capacity_tokens"]


def test_workload_overrides():
    spec = workloads.workload_spec("cpu", num_requests=5, prompt="300-400", output="7")
    assert spec == dict(num_requests=5, prompt=(300, 400), output=(7, 7))
    reqs = workloads.make_workload(spec, 1000)
    assert len(reqs) == 5 and all(300 <= len(r.prompt) <= 400 and r.max_tokens == 7 for r in reqs)
    assert workloads.workload_spec("cpu") == workloads.WORKLOADS["cpu"]
    for bad in ("0-5", "9-3", "x", "1-y"):
        try:
            workloads.workload_spec("cpu", prompt=bad)
        except ValueError as e:
            assert "--prompt-lens" in str(e)
        else:
            raise AssertionError(bad)


def test_bench_greedy_and_sampled_chat_workloads_side_by_side(model_dir):
    """Two workloads in one run: the greedy random-token one and the sampled chat one
    (shared system prompt, so nanokv hits its prefix cache), every engine on each."""
    from transformers import AutoTokenizer

    chat = workloads.make_workload("chat-tiny", 1024, tokenizer=AutoTokenizer.from_pretrained(model_dir))
    assert len({r.seed for r in chat}) == len(chat) and len({tuple(r.prompt) for r in chat}) > 1
    out = subprocess.run([sys.executable, "bench.py", "--workload", "tiny,chat-tiny", "--model", model_dir,
                          "--engines", "nanokv,hf,hf-cb", "--hf-batch-sizes", "4", "--repeats", "1",
                          "--hf-cb-memory", "0.02", "--json"],  # CB takes most of the free RAM by default
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    greedy, sampled = json.loads(out.stdout)["workloads"]
    assert (greedy["workload"], greedy["sampling"]) == ("tiny", "greedy")
    assert (sampled["workload"], sampled["sampling"]) == ("chat-tiny", workloads.SAMPLING)
    for report, reqs in ((greedy, workloads.make_workload("tiny", 1024)), (sampled, chat)):
        rows = {r["engine"]: r for r in report["results"]}
        assert set(rows) == {"nanokv", "HF generate", "HF continuous batching"}
        expected = sum(r.max_tokens for r in reqs)
        assert rows["nanokv"]["output_tokens"] == rows["HF generate"]["output_tokens"] == expected
        assert rows["HF continuous batching"]["output_tokens"] == expected, rows["HF continuous batching"]["note"]
        assert rows["nanokv"]["ratio_to_hf_generate"] > 0 and report["ms_per_step"] > 0
    assert {r["engine"]: r for r in sampled["results"]}["nanokv"]["kv"]["prefix_hit_tokens"] > 0


def test_chat_workload_refuses_prompt_lengths():
    try:
        workloads.workload_spec("chat", prompt="10-20")
    except ValueError as e:
        assert "rendered conversations" in str(e)
    else:
        raise AssertionError("accepted --prompt-lens for a chat workload")
    assert workloads.workload_spec("chat", num_requests=3, output="5") == dict(num_requests=3, output=(5, 5), chat=True)


def test_micro_host_time_reports_every_phase_per_context(capsys):
    """bench.py --micro's host-time section at a small size: one row per context length,
    every phase measured (timings themselves are never asserted)."""
    import torch

    result = micro.micro_host_time(torch.device("cpu"), num_seqs=6, context_lens=(5, 40), steps=3, warmup=1)
    assert [r["context"] for r in result["rows"]] == [5, 40]
    phases = ("schedule", "prepare", "plan", "sample", "update")
    for row in result["rows"]:
        assert row["num_seqs"] == 6 and all(row[f"{k}_ms"] > 0 for k in phases)
        assert row["total_ms"] == round(sum(row[f"{k}_ms"] for k in phases), 3)
        assert row["mean_step_ms"] > 0
    table = capsys.readouterr().out
    assert "| context | schedule | prepare |" in table and "| mean step (ms) |" in table and "| 40 |" in table
    assert list(micro.MICRO_SECTIONS) == ["host_time", "sampler", "structured"]


def test_micro_reports_the_sampler_per_mode(model_dir):
    """--micro's sampler section: every mode at every vocabulary, on random and on the
    model's logits, with greedy as the unit (timings are never asserted)."""
    import torch

    out = subprocess.run([sys.executable, "bench.py", "--micro", "--micro-sections", "sampler", "--model", model_dir,
                          "--micro-vocabs", "1024,3000", "--micro-repeats", "1", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert list(json.loads(out.stdout)) == ["sampler"]
    reports = json.loads(out.stdout)["sampler"]
    modes = [name for name, _ in micro.MICRO_SAMPLER_MODES]
    assert [(r["vocab"], r["logits"]) for r in reports] == [(v, k) for v in (1024, 3000)
                                                            for k in ("random normal", model_dir)]
    for r in reports:
        assert list(r["ms_per_step"]) == modes and all(ms > 0 for ms in r["ms_per_step"].values())
        assert r["vs_greedy"]["greedy"] == 1.0 and r["rows"] == 256

    small = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    wide = micro.fit_vocab(small, 250)  # the added tokens are rare ones: the top stays the same
    assert wide.shape == (4, 250)
    assert torch.equal(wide.topk(5).values, small.topk(5).values)


def test_micro_structured_reports_the_mask_build_and_the_sampler_with_and_without(model_dir, capsys):
    """--micro's structured section at a small size: the mask rows built from grammar
    matchers, and the sampler greedy and sampled with those masks and without (timings are
    never asserted); the masks are a JSON schema's: some tokens allowed, not all."""
    import torch

    from benchmarks.structured import micro_structured, print_micro_structured

    r = micro_structured(model_dir, torch.device("cpu"), num_rows=6, steps=2, repeats=1)
    assert r["rows"] == 6 and r["schema_fields"] == 10 and 0 < r["mean_allowed_tokens"] < r["vocab"]
    keys = ("build_ms", "greedy_unconstrained_ms", "greedy_masked_ms", "sampled_unconstrained_ms", "sampled_masked_ms")
    assert all(r[k] > 0 for k in keys)
    print_micro_structured(r)
    assert "| build rows | greedy | greedy + mask |" in capsys.readouterr().out


def test_structured_workload_runs_the_same_requests_with_and_without_a_schema(model_dir):
    """bench.py --workload structured-tiny: the requests constrained by a 10-field JSON schema
    and not, the same output tokens each (EOS ignored), every constrained output JSON (or
    its start), the ratio of their rates, and a 20-property schema's compile time with the
    tokenizer's build apart."""
    from benchmarks.structured import json_schema

    assert len(json_schema(10)["properties"]) == 10 and len(json_schema(20)["properties"]) == 20
    out = subprocess.run([sys.executable, "bench.py", "--workload", "structured-tiny", "--model", model_dir,
                          "--repeats", "1", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    spec = workloads.workload_spec("structured-tiny")
    expected = sum(r.max_tokens for r in workloads.make_workload(spec, 0, 0, tokenizer))
    results = report["results"]
    assert results["constrained"]["output_tokens"] == results["unconstrained"]["output_tokens"] == expected
    assert report["ratio"] == round(results["constrained"]["tok_per_s"] / results["unconstrained"]["tok_per_s"], 3)
    assert report["constrained_outputs_parsing"] == report["num_requests"] == 4
    c = report["compile"]
    assert c["properties"] == 20 and all(c[k] > 0 for k in ("tokenizer_ms", "compile_ms", "first_mask_ms"))
    text = subprocess.run([sys.executable, "bench.py", "--workload", "structured-tiny", "--model", model_dir,
                           "--repeats", "1"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert text.returncode == 0, text.stderr[-2000:]
    assert "| unconstrained tok/s | constrained tok/s | ratio |" in text.stdout and "20-property" in text.stdout
