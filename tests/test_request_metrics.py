"""RequestOutput.metrics and num_cached_tokens (vLLM's per-request times and prefix-cache
hits) and LLM.get_metrics() (vLLM's reader records of the vllm: metrics), on the tiny
checkpoint: exact token counts, exact prefix hits, times in their order."""

from __future__ import annotations

import pytest

from nanokv import LLM, SamplingParams
from nanokv.metrics import FINISH_REASONS, ITL_BUCKETS, TTFT_BUCKETS
from nanokv.metrics.reader import Counter, Gauge, Histogram

BLOCK = 16


@pytest.fixture
def fresh(model_dir):
    """An engine of its own: counters start at zero."""
    llm = LLM(model_dir, max_model_len=256, block_size=BLOCK, kv_cache_memory_bytes=8 << 20)
    yield llm
    llm.close()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def by_name(llm) -> dict:
    """{name: record} for unlabelled-beyond-model metrics, {name: {reason: record}} for request_success."""
    out = {}
    for m in llm.get_metrics():
        if m.name == "vllm:request_success":
            out.setdefault(m.name, {})[m.labels["finished_reason"]] = m
        else:
            out[m.name] = m
    return out


def test_num_cached_tokens_counts_whole_cached_blocks_and_never_the_last_prompt_token(fresh):
    prefix = list(range(100, 100 + 2 * BLOCK))  # two full blocks
    first = prefix + [7, 8, 9, 10, 11, 12, 13, 14]  # 40 tokens: 2 full blocks and 8
    runs = [first, prefix + [20, 21, 22], first, prefix, list(range(300, 340))]
    got = [fresh.generate([p], greedy(2), use_tqdm=False)[0].num_cached_tokens for p in runs]
    # new; the 2 shared blocks; the same 40 (the 8-token tail is no full block); a prompt that
    # is all cached still computes its last token; nothing shared
    assert got == [0, 32, 32, 31, 0]


def test_request_metrics_are_in_order_and_count_the_tokens(fresh):
    outs = fresh.generate([list(range(10, 30)), list(range(40, 75))], [greedy(5), greedy(3, n=2)],
                          use_tqdm=False)
    for out, generated in zip(outs, (5, 6)):
        m = out.metrics
        times = [m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finished_time]
        assert None not in times and times == sorted(times), m
        assert m.time_in_queue is not None and m.time_in_queue >= 0
        assert m.num_generation_tokens == generated == sum(len(c.token_ids) for c in out.outputs)
        assert m.first_token_latency == pytest.approx(m.first_token_time - m.arrival_time, abs=1e-6)
        assert m.inference_time == pytest.approx(m.prefill_time + m.decode_time, abs=1e-9)


def test_streamed_deltas_carry_the_times_so_far(fresh):
    engine = fresh.llm_engine
    engine.add_request(list(range(10, 30)), greedy(4), request_id="s", stream=True)
    deltas = []
    for _ in range(50):
        for out in engine.step():
            deltas.append((out.finished, out.metrics.first_token_time, out.metrics.finished_time))
        if deltas and deltas[-1][0]:
            break
    assert [d[0] for d in deltas] == [False, False, False, True]
    assert all(first is not None for _, first, _ in deltas)
    assert deltas[-1][2] is not None


def test_get_metrics_has_vllms_names_and_exact_counts(fresh):
    prompts = [list(range(10, 30)), list(range(40, 75))]  # 20 and 35 tokens, nothing shared
    fresh.generate(prompts, [greedy(5), greedy(3)], use_tqdm=False)
    m = by_name(fresh)
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions", "vllm:prompt_tokens",
            "vllm:generation_tokens", "vllm:request_success", "vllm:time_to_first_token_seconds",
            "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
            "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
            "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
            "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:iteration_tokens_total",
            "vllm:request_params_n", "vllm:request_params_max_tokens", "vllm:cache_config_info"} <= set(m)
    assert all(name.startswith("vllm:") for name in m)
    for name in ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prefix_cache_queries"):
        assert isinstance(m[name], Counter), name
    assert isinstance(m["vllm:num_requests_running"], Gauge)
    assert m["vllm:prompt_tokens"].value == 55 and m["vllm:prefix_cache_queries"].value == 55
    assert m["vllm:generation_tokens"].value == 8 and m["vllm:prefix_cache_hits"].value == 0
    assert {r: c.value for r, c in m["vllm:request_success"].items()} == dict.fromkeys(FINISH_REASONS, 0) | {
        "length": 2}
    assert (m["vllm:num_requests_running"].value, m["vllm:kv_cache_usage_perc"].value) == (0, 0)
    # every step's tokens: each prompt once, then a decode per token after the first
    steps = m["vllm:iteration_tokens_total"]
    assert isinstance(steps, Histogram) and steps.sum == 55 + (5 - 1) + (3 - 1)
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_prefill_time_seconds"):
        assert m[name].count == 2 and m[name].buckets["+Inf"] == 2, name
    ttft = m["vllm:time_to_first_token_seconds"]
    assert [float(b) for b in ttft.buckets if b != "+Inf"] == list(TTFT_BUCKETS)
    assert [float(b) for b in m["vllm:inter_token_latency_seconds"].buckets if b != "+Inf"] == list(ITL_BUCKETS)
    assert m["vllm:inter_token_latency_seconds"].count == 0  # no streamed request
    assert (m["vllm:request_prompt_tokens"].sum, m["vllm:request_generation_tokens"].sum) == (55, 8)
    assert (m["vllm:request_params_max_tokens"].sum, m["vllm:request_params_n"].sum) == (8, 2)
    assert m["vllm:request_prompt_tokens"].buckets["20.0"] == 1  # 1-2-5 buckets up to max_model_len
    assert list(m["vllm:request_prompt_tokens"].buckets)[-2:] == ["200.0", "+Inf"]
    info = m["vllm:cache_config_info"]
    assert info.value == 1 and info.labels["block_size"] == str(BLOCK)
    assert info.labels["num_gpu_blocks"] == str(fresh.kv_stats().num_blocks)
    assert m["vllm:e2e_request_latency_seconds"].labels == {"model_name": fresh.llm_engine.config.model,
                                                            "engine": "0"}


def test_an_aborted_request_counts_as_abort(fresh):
    engine = fresh.llm_engine
    engine.add_request(list(range(10, 30)), greedy(50, n=2), request_id="a")
    engine.step()
    engine.abort("a")
    success = by_name(fresh)["vllm:request_success"]
    assert {r: c.value for r, c in success.items()} == dict.fromkeys(FINISH_REASONS, 0) | {"abort": 2}
