"""SamplingParams.prompt_logprobs (vLLM's shape) against transformers' log_softmax, on both
CPU paths, under chunked prefill, with a cached prefix, n > 1 and preemption."""

from __future__ import annotations

import math

import pytest
import torch

from nanokv import LLM, SamplingParams

from .conftest import random_prompts
from .models.test_hf_equality import assert_path, select_cpu_path

PROMPTS = random_prompts([40, 7, 1, 23], 1024, seed=77)


@pytest.fixture(scope="module")
def hf_logprobs(model_dir):
    """Each prompt's log_softmax of transformers' float32 logits [len, vocab]."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [hf(torch.tensor([p])).logits[0].float().log_softmax(-1) for p in PROMPTS]


def check(prompt, got, ref, k):
    """got: a RequestOutput.prompt_logprobs; each position's prompt token and top-k as ref's."""
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        entry, row = got[i], ref[i - 1]
        token = prompt[i]
        top = row.topk(k).indices.tolist() if k else []
        assert list(entry)[:k] == top
        assert set(entry) == set(top) | {token}
        for tid, lp in entry.items():
            assert math.isclose(lp.logprob, row[tid].item(), abs_tol=1e-4)
            assert lp.rank == int((row > row[tid]).sum()) + 1 and lp.decoded_token is not None


@pytest.mark.parametrize("path", ["cpu-kernels", "torch"])
def test_prompt_logprobs_equal_hf_chunked_cached_n(path, monkeypatch, model_dir, hf_logprobs):
    select_cpu_path(path, monkeypatch)
    # 16 tokens a step: the 40- and 23-token prompts are scored over several chunks
    llm = LLM(model_dir, max_model_len=256, max_num_batched_tokens=16, kv_cache_memory_bytes=64 << 20)
    assert_path(llm, path)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out, ref in zip(PROMPTS, outs, hf_logprobs):
        check(prompt, out.prompt_logprobs, ref, 3)
    # the same prompts again hit the prefix cache for the requests that do not score them,
    # and bypass it for those that do: the same values, all positions present
    again = llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                                   SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0, ignore_eos=True),
                                   SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0, ignore_eos=True),
                                   SamplingParams(temperature=0.8, seed=5, max_tokens=3, prompt_logprobs=1, n=3)],
                         use_tqdm=False)
    assert again[0].num_cached_tokens > 0 and again[0].prompt_logprobs is None
    assert again[1].num_cached_tokens == 0
    for i in (1, 2, 3):
        check(PROMPTS[i], again[i].prompt_logprobs, hf_logprobs[i], 1 if i == 3 else 0)
        for j in range(1, len(PROMPTS[i])):
            token = PROMPTS[i][j]
            assert again[i].prompt_logprobs[j][token].logprob == outs[i].prompt_logprobs[j][token].logprob
    assert len(again[3].outputs) == 3  # n = 3: the request's prompt scored once


def test_prompt_logprobs_under_preemption(model_dir, hf_logprobs):
    """Preempted and recomputed, a request's prompt logprobs are each position's once."""
    llm = LLM(model_dir, max_model_len=128, num_kvcache_blocks=10, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0, max_tokens=60, prompt_logprobs=2, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for prompt, out, ref in zip(PROMPTS, outs, hf_logprobs):
        check(prompt, out.prompt_logprobs, ref, 2)


def test_prompt_logprobs_whole_vocabulary_and_bounds(model_dir):
    llm = LLM(model_dir, max_model_len=256, max_logprobs=-1, kv_cache_memory_bytes=64 << 20)
    vocab = llm.llm_engine.vocab_size
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=1, prompt_logprobs=-1), use_tqdm=False)[0]
    assert all(len(entry) == vocab for entry in out.prompt_logprobs[1:])
    bounded = LLM(model_dir, max_model_len=256, max_logprobs=5, kv_cache_memory_bytes=64 << 20)
    for k in (6, -1):
        with pytest.raises(ValueError, match=f"prompt_logprobs={k}"):
            bounded.generate(PROMPTS[1], SamplingParams(prompt_logprobs=k), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs must be an int"):
        SamplingParams(prompt_logprobs=-2)
    assert SamplingParams.from_optional(prompt_logprobs=None).prompt_logprobs is None


def test_prompt_logprobs_in_streamed_outputs(model_dir):
    """DELTA: in the first output only (as vLLM); CUMULATIVE: in every output; FINAL_ONLY: once."""
    from nanokv.sampling_params import RequestOutputKind

    llm = LLM(model_dir, max_model_len=256, kv_cache_memory_bytes=64 << 20)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    (ref,) = llm.generate(PROMPTS[0], params, use_tqdm=False)
    for kind in RequestOutputKind:
        engine.add_request(kind.name, PROMPTS[0], SamplingParams(**{**vars(params), "output_kind": kind}))
    outputs: dict[str, list] = {}
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out.prompt_logprobs)
    assert [len(outputs[k.name]) for k in RequestOutputKind] == [4, 4, 1]
    assert outputs["DELTA"][1:] == [None] * 3
    for got in (outputs["DELTA"][0], *outputs["CUMULATIVE"], outputs["FINAL_ONLY"][0]):
        assert got[0] is None and len(got) == len(ref.prompt_logprobs)
        for entry, want in zip(got[1:], ref.prompt_logprobs[1:]):  # the same batch-independent values
            assert list(entry) == list(want)
            assert all(math.isclose(entry[t].logprob, want[t].logprob, abs_tol=1e-5) for t in entry)
