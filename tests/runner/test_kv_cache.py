"""KV pool sizing on CUDA, with the device's memory faked: the share of
gpu_memory_utilization, the free-memory bound a second LLM meets, the cap at max_num_seqs
full sequences (a small model must not get millions of blocks), and the errors."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from nanokv.config import EngineArgs
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
