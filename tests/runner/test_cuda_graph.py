"""Decode graphs: bucketing and padding rows (CPU, without capture), and on a GPU, graph
replay equal to eager and bf16 agreement with transformers."""

from __future__ import annotations

import pytest
import torch

from nanokv import LLM, SamplingParams
from nanokv.runner.cuda_graph import DecodeGraphs, batch_buckets

from ..conftest import random_prompts

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_buckets_cover_every_batch_size():
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(256)[-3:] == [224, 240, 256]
    graphs_like = batch_buckets(100)
    assert graphs_like[-1] == 100 and all(a < b for a, b in zip(graphs_like, graphs_like[1:]))


def test_padded_decode_steps_equal_eager(checkpoint):
    """The static-buffer path with padding rows writing a scratch block gives the same
    tokens and leaves every real page intact."""
    model_dir = checkpoint("qwen3-tiny")
    prompts = random_prompts([3, 17, 30, 5, 41], 1024, seed=9)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    eager = LLM(model_dir, max_model_len=128, max_num_seqs=8)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]

    llm = LLM(model_dir, max_model_len=128, max_num_seqs=8)
    runner = llm.llm_engine.runner
    runner.graphs = DecodeGraphs(runner.model, runner.backend, runner.block_size, 8, 128,
                                 runner.num_blocks, runner.device, capture=False)
    assert runner.graphs.bucket_for(5) == 8 and runner.graphs.bucket_for(9) is None
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected


@gpu
@needs_cuda
def test_cuda_graph_replay_equals_eager(checkpoint):
    model_dir = checkpoint("qwen3-tiny")
    prompts = random_prompts([1, 9, 33, 70, 120, 250], 1024, seed=10)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(dtype="float32", attention_backend="triton", max_model_len=512)
    eager = LLM(model_dir, enforce_eager=True, **kw)
    graphed = LLM(model_dir, **kw)
    assert graphed.llm_engine.runner.graphs is not None and graphed.llm_engine.runner.graphs.graphs
    a = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
    assert a == b


@gpu
@needs_cuda
def test_bf16_agrees_with_hf(checkpoint):
    from transformers import AutoModelForCausalLM

    model_dir = checkpoint("qwen3-tiny")
    prompt = random_prompts([40], 1024, seed=11)[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    with torch.inference_mode():
        ref_logits = hf(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
    llm = LLM(model_dir, dtype="bfloat16")
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5),
                       use_tqdm=False)[0].outputs[0]
    first = out.logprobs[0]
    ref = torch.log_softmax(ref_logits, -1)
    for tid, lp in first.items():
        assert abs(lp.logprob - ref[tid].item()) < 0.1
    # teacher-forced: HF's argmax at each position of nanokv's own continuation
    with torch.inference_mode():
        full = torch.tensor([prompt + out.token_ids], device="cuda")
        hf_next = hf(full).logits[0, len(prompt) - 1:-1].argmax(-1).tolist()
    agree = sum(a == b for a, b in zip(out.token_ids, hf_next)) / len(hf_next)
    assert agree >= 0.95


def test_gpu_memory_profiling_control_flow_on_cpu(checkpoint, monkeypatch):
    """The CUDA sizing path (profile a max-size step, then size the pool) run on the CPU
    with torch.cuda's memory counters stubbed: catches shape and bookkeeping errors that
    would otherwise surface only on a GPU."""
    model_dir = checkpoint("qwen3-tiny")
    llm = LLM(model_dir, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=300)
    runner = llm.llm_engine.runner
    counters = iter(range(1000, 10**9, 1000))
    for name, fn in dict(synchronize=lambda *a: None, memory_allocated=lambda *a: 0,
                         reset_peak_memory_stats=lambda *a: None, empty_cache=lambda: None,
                         max_memory_allocated=lambda *a: next(counters)).items():
        monkeypatch.setattr(torch.cuda, name, fn)
    assert runner._profile_activation_bytes(with_graphs=True) > 0
    assert runner.kv_cache is None and all(layer.k_cache.numel() == 0 for layer in runner.attn_layers)
