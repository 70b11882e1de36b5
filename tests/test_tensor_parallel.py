"""Tensor parallelism on the CPU with gloo: TP=2 equals TP=1 and HF token for token;
bad sizes raise ValueError; a dead worker makes generate raise instead of hanging."""

from __future__ import annotations

import os
import signal
import time

import pytest

from nanokv import LLM, SamplingParams
from nanokv.testing.tiny import GENERATION_EOS_TOKEN_IDS

from .conftest import hf_greedy, random_prompts

pytestmark = pytest.mark.slow  # subprocesses / whole benchmark runs

PROMPTS = random_prompts([1, 6, 19, 40, 75], 1024, seed=13)
MAX_TOKENS = [10, 14, 6, 12, 9]


def generate(llm, prompts=PROMPTS, max_tokens=MAX_TOKENS):
    params = [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens]
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason)
            for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("shape, overrides", [
    ("qwen3-tiny", {}),  # 4 heads / 2 KV heads: both split
    ("llama3-tiny", dict(num_key_value_heads=1)),  # MQA: the KV head is replicated
    ("qwen2-tiny", {}),  # q/k/v bias split with the heads, untied head
])
def test_tp2_equals_tp1_and_hf(checkpoint, shape, overrides):
    model_dir = checkpoint(shape, **overrides)
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS, GENERATION_EOS_TOKEN_IDS)
    assert generate(LLM(model_dir)) == expected
    llm = LLM(model_dir, tensor_parallel_size=2, num_kvcache_blocks=12, kvcache_block_size=8,
              max_model_len=96, max_num_batched_tokens=64)  # a full pool and chunked prefill too
    try:
        assert generate(llm) == expected
        assert llm.kv_stats().peak_used_blocks == 12
    finally:
        llm.close()
    assert not any(p.is_alive() for p in llm.llm_engine.executor.workers)


def test_tp2_on_int8_kv_pages_equals_tp1(checkpoint):
    """Each rank quantizes and reads its own heads' int8 pages and (scale, zero) pairs: the
    same tokens as one rank, in a full pool with chunked prefill."""
    model_dir = checkpoint("qwen3-tiny")
    expected = generate(LLM(model_dir, kv_cache_dtype="int8"))
    llm = LLM(model_dir, kv_cache_dtype="int8", tensor_parallel_size=2, num_kvcache_blocks=12,
              kvcache_block_size=8, max_model_len=96, max_num_batched_tokens=64)
    try:
        assert generate(llm) == expected
        assert llm.kv_stats().peak_used_blocks == 12
    finally:
        llm.close()


def test_bad_tensor_parallel_sizes(checkpoint):
    model_dir = checkpoint("qwen3-tiny")  # 4 heads, 2 KV heads, vocab 1024, intermediate 128
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLM(model_dir, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(model_dir, tensor_parallel_size=0)
    odd_vocab = checkpoint("qwen3-tiny", vocab_size=1025)
    with pytest.raises(ValueError, match="vocab_size"):
        LLM(odd_vocab, tensor_parallel_size=2)


def test_a_second_tp_llm_is_refused_and_the_first_keeps_working(checkpoint):
    model_dir = checkpoint("qwen3-tiny")
    first = LLM(model_dir, tensor_parallel_size=2)
    try:
        expected = generate(first)
        with pytest.raises(ValueError, match="close"):
            LLM(model_dir, tensor_parallel_size=2)
        assert generate(first) == expected
    finally:
        first.close()
    assert first.llm_engine.runner.kv_cache is None  # rank 0's pool freed
    with pytest.raises(RuntimeError, match="this LLM is closed"):
        generate(first)
    with pytest.raises(RuntimeError, match="this LLM is closed"):
        first.llm_engine.step()
    again = LLM(model_dir, tensor_parallel_size=2)  # closing freed the group for a new one
    try:
        assert generate(again) == expected
    finally:
        again.close()


def test_killed_worker_makes_generate_raise_promptly(checkpoint):
    model_dir = checkpoint("qwen3-tiny")
    llm = LLM(model_dir, tensor_parallel_size=2)
    (worker,) = llm.llm_engine.executor.workers
    generate(llm)
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(timeout=10)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker"):
        generate(llm)
    assert time.monotonic() - start < 30
    llm.close()


def test_worker_killed_during_a_step_does_not_hang(checkpoint):
    """Killed while rank 0 waits in a collective: gloo reports the lost peer."""
    model_dir = checkpoint("qwen3-tiny")
    llm = LLM(model_dir, tensor_parallel_size=2)
    (worker,) = llm.llm_engine.executor.workers
    engine = llm.llm_engine
    engine.add_request(list(range(4, 200)), SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    engine.step()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker.*rank 1 .killed by SIGKILL.*create a new LLM") as info:
        for i in range(1000):
            if i == 3:
                os.kill(worker.pid, signal.SIGKILL)
            engine.step()
    assert "Connection" not in str(info.value).split(";")[0]  # not gloo's words: ours
    assert time.monotonic() - start < 60
    with pytest.raises(RuntimeError, match="create a new LLM"):  # and it stays refused
        engine.step()
    llm.close()


@pytest.mark.parametrize("kwargs", [dict(dtype="bfloat16"), dict(quantization="int8", quantize_lm_head=True)],
                         ids=["bfloat16", "int8"])
def test_tp2_with_bfloat16_and_int8_weights(checkpoint, kwargs):
    """Each rank packs its own slice in the format: bfloat16 matches one rank token for
    token (as float32 does); int8 quantizes a row-parallel slice with its own scales, so it
    is held to agreement: at least 60% of the tokens before the first difference (78% here;
    random weights have near-ties)."""
    from nanokv import kernels

    if not kernels.available():
        pytest.skip("no C compiler: CPU kernels not built")
    model_dir = checkpoint("qwen3-tiny")
    expected = generate(LLM(model_dir, **kwargs))
    llm = LLM(model_dir, tensor_parallel_size=2, **kwargs)
    try:
        got = generate(llm)
    finally:
        llm.close()
    if "dtype" in kwargs:
        assert got == expected
        return
    same = sum(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for (x, _), (y, _) in zip(got, expected))
    assert same >= 0.6 * sum(MAX_TOKENS), (got, expected)


def test_a_failed_step_keeps_its_exception_text_out_of_the_engines_reason(checkpoint, monkeypatch, caplog):
    """The reason a dead engine gives reaches the server's clients (503 bodies, /health):
    the exception's text (paths, addresses, shapes) goes to the log only."""
    from nanokv.executor import multiproc

    llm = LLM(checkpoint("qwen3-tiny"), tensor_parallel_size=2)
    try:
        generate(llm)
        secret = "[/home/alice/models/x.gguf]:1234 peer 10.0.0.7 closed"

        def broken(packed):
            raise RuntimeError(f"gloo: {secret}\nmore detail")

        monkeypatch.setattr(multiproc, "send_step", broken)
        with caplog.at_level("ERROR", logger="nanokv"):
            with pytest.raises(RuntimeError, match="tensor-parallel step failed.*RuntimeError.*create a new LLM") \
                    as info:
                generate(llm)
        assert secret not in str(info.value) and "gloo" not in str(info.value)
        assert secret in caplog.text  # the log keeps it
        with pytest.raises(RuntimeError, match="create a new LLM") as again:  # and the engine stays dead
            generate(llm)
        assert secret not in str(again.value)
    finally:
        llm.close()


def test_tp2_prompt_logprobs_equal_tp1(model_dir):
    """The scoring rows' logits are gathered from both ranks like the sampled ones."""
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    one = LLM(model_dir, max_model_len=96).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(model_dir, tensor_parallel_size=2, max_model_len=96, max_num_batched_tokens=32)
    try:
        two = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.close()
    for a, b in zip(one, two):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert list(x) == list(y) and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
