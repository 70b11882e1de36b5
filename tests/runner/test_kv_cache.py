"""KV pool sizing on CUDA, with the device's memory faked: the share of
gpu_memory_utilization, the free-memory bound a second LLM meets, the cap at max_num_seqs
full sequences (a small model must not get millions of blocks), and the errors."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from nanokv.engine.arg_utils import EngineArgs
from nanokv.runner.kv_cache import num_kv_blocks

GiB = 1 << 30
BLOCK = 1 << 20  # bytes per block in these tests


@pytest.fixture(scope="module")
def cpu_config(model_dir):
    return EngineArgs(model=model_dir, max_model_len=512, max_num_seqs=4).create_engine_config()


def on_cuda(config, **changes):
    return dataclasses.replace(config, device=torch.device("cuda"), **changes)


def memory(free_gib: float, total_gib: float = 140):
    return lambda device: (int(free_gib * GiB), int(total_gib * GiB))


def test_cuda_pool_is_capped_at_max_num_seqs_full_sequences(cpu_config):
    # 0.9 * 140 GiB would be ~125,000 blocks; 4 sequences of 512 tokens need 4 * 32
    assert num_kv_blocks(on_cuda(cpu_config), BLOCK, GiB, GiB, memory(130)) == 4 * 512 // 16
    roomy = on_cuda(cpu_config, max_num_seqs=100_000)
    assert num_kv_blocks(roomy, BLOCK, 5 * GiB, 10 * GiB, memory(130)) == (int(0.9 * 140 * GiB) - 15 * GiB) // BLOCK


def test_a_second_llm_sizes_its_pool_from_free_memory(cpu_config, caplog):
    """The first LLM holds most of the device: the second's share of
    gpu_memory_utilization is far more than is free, so the free memory (less its own
    activation peak) bounds its pool, and the log says so."""
    config = on_cuda(cpu_config, max_num_seqs=100_000)
    with caplog.at_level(logging.INFO, logger="nanokv"):
        n = num_kv_blocks(config, BLOCK, activation_bytes=GiB, own_bytes=2 * GiB, mem_info=memory(20))
    assert n == 19 * GiB // BLOCK
    assert "free device memory" in caplog.text


def test_explicit_budgets_are_honoured(cpu_config):
    config = on_cuda(cpu_config, kv_cache_memory_bytes=3 * GiB)  # not capped, as on the CPU
    assert num_kv_blocks(config, BLOCK, GiB, GiB, memory(130)) == 3 * GiB // BLOCK
    config = on_cuda(cpu_config, num_kvcache_blocks=77)
    assert num_kv_blocks(config, BLOCK, GiB, GiB, memory(0.1)) == 77


def test_a_pool_that_cannot_hold_one_sequence_names_the_knob(cpu_config):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        num_kv_blocks(on_cuda(cpu_config), BLOCK, GiB, GiB, memory(1.001))  # 1 MiB left: 16 tokens


def test_cpu_default_pool_is_capped_too(cpu_config):
    assert num_kv_blocks(cpu_config, 1024) == 4 * 512 // 16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_second_llm_sizes_its_pool_from_what_the_first_left(checkpoint):
    """Two LLMs in one process: the first takes 60% of the device, the second (90% asked)
    gets a pool that fits in what was free, and most of it, and both give the same tokens."""
    from nanokv import LLM, SamplingParams

    # 2 MiB blocks (8 KV heads of 128, 256 tokens, 2 layers, bf16): few block objects per GiB
    model_dir = checkpoint("qwen3-tiny", num_attention_heads=8, num_key_value_heads=8, head_dim=128)
    kw = dict(dtype="bfloat16", kvcache_block_size=256, max_model_len=1024, max_num_seqs=20_000,
              enforce_eager=True)
    first = LLM(model_dir, gpu_memory_utilization=0.6, **kw)
    free_before, total = torch.cuda.mem_get_info()
    second = LLM(model_dir, gpu_memory_utilization=0.9, **kw)

    def pool_bytes(llm):
        cache = llm.llm_engine.runner.kv_cache
        return cache.numel() * cache.element_size()

    assert pool_bytes(first) <= 0.6 * total
    assert 0.5 * free_before < pool_bytes(second) <= free_before
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9]
    assert first.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == \
        second.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pool_of_a_tiny_model_is_capped(model_dir):
    from nanokv import LLM

    llm = LLM(model_dir, max_model_len=512, max_num_seqs=8, enforce_eager=True)
    assert llm.llm_engine.runner.num_blocks == 8 * 512 // 16  # not 90% of the device in 16-token blocks


# ---- the CPU pool commits memory as blocks are first used ----------------------------------

POOL = 2 * GiB
_MEASURE = r"""
import json, random, sys
from nanokv import LLM, SamplingParams

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

def stats(llm):
    kv = llm.kv_stats()
    return {k: getattr(kv, k) for k in ("num_blocks", "block_size", "bytes_per_token", "touched_blocks",
                                        "reserved_bytes", "committed_bytes")}

model, kv_dtype, backend, pool = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
base = rss()
llm = LLM(model, kv_cache_memory_bytes=pool, max_model_len=1024, kv_cache_dtype=kv_dtype,
          attention_backend=backend, max_num_batched_tokens=512)
loaded, before = rss(), stats(llm)
rng = random.Random(0)  # 8 prompts of 31 full blocks each, all different
prompts = [{"prompt_token_ids": [rng.randrange(4, 1000) for _ in range(31 * 16)]} for _ in range(8)]
llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
print(json.dumps({"base": base, "loaded": loaded, "ran": rss(), "before": before, "after": stats(llm)}))
"""


@pytest.fixture(scope="module")
def wide_kv_model(checkpoint):
    # 32 KiB of float32 K/V per token (4 layers of 8 KV heads of 128), so a few requests
    # commit a measurable amount; the rest of the model stays tiny
    return checkpoint("qwen3-tiny", num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                      head_dim=128)


@pytest.mark.parametrize("kv_dtype, backend", [("auto", "cpu"), ("int8", "cpu"), ("auto", "torch")])
def test_cpu_pool_commits_memory_as_blocks_are_first_used(wide_kv_model, kv_dtype, backend):
    """A 2 GiB pool (measured in a fresh process): reserved whole, committed nothing and
    RSS barely moves at start; 8 requests of 31 blocks commit exactly those blocks' bytes
    and RSS grows by about that much, far from the pool's size."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _MEASURE, wide_kv_model, kv_dtype, backend, str(POOL)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads(proc.stdout.splitlines()[-1])
    before, after = m["before"], m["after"]
    block_bytes = before["block_size"] * before["bytes_per_token"]
    assert before["reserved_bytes"] == (before["num_blocks"] + 1) * block_bytes  # and the scratch block
    assert before["num_blocks"] == POOL // block_bytes
    assert before["touched_blocks"] == 0 and before["committed_bytes"] == 0
    assert m["loaded"] - m["base"] < POOL // 8  # the model is tiny: the pool is not in memory
    assert after["touched_blocks"] == 8 * 31  # every prompt block cached, so none reused
    assert after["committed_bytes"] == 8 * 31 * block_bytes
    grown = m["ran"] - m["loaded"]
    assert after["committed_bytes"] // 2 < grown < POOL // 4, (grown, after["committed_bytes"])
