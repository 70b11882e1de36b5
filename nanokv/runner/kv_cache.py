"""KV pool sizing (memory budget -> number of blocks) and the per-layer K/V tensors."""

from __future__ import annotations

import logging
import math
import mmap
import os

import torch

import nanokv.kernels as kernels
from nanokv.attention.base import PARAM_DTYPE

from nanokv.config import EngineConfig

logger = logging.getLogger("nanokv")

_CPU_DEFAULT_BUDGET = 4 << 30  # bytes; capped at half the RAM available at start-up


SCALE_DTYPE = PARAM_DTYPE  # a quantized cache's (scale, zero) per (token, KV head): float16


def cache_dtype(config: EngineConfig) -> torch.dtype:
    """The element type of the K/V pages: the model's dtype, or int8 / float8 e4m3."""
    return {"auto": config.dtype, "int8": torch.int8, "fp8": torch.float8_e4m3fn}[config.kv_cache_dtype]


def bytes_per_token(config: EngineConfig, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """K and V of one token over all layers (this rank's heads), scales included:
    2 * layers * Hkv * (D * element + 4) bytes for a quantized cache (float16 scale and zero)."""
    elem = torch.empty(0, dtype=cache_dtype(config)).element_size()
    scale = 0 if config.kv_cache_dtype == "auto" else 2 * torch.empty(0, dtype=SCALE_DTYPE).element_size()
    return 2 * num_layers * num_kv_heads * (head_dim * elem + scale)


def bytes_per_block(config: EngineConfig, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    return config.block_size * bytes_per_token(config, num_layers, num_kv_heads, head_dim)


def available_cpu_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def num_kv_blocks(config: EngineConfig, block_bytes: int, activation_bytes: int = 0, own_bytes: int = 0,
                  mem_info=None) -> int:
    """Pool size in blocks; ValueError, naming the knob, when one max_model_len sequence
    does not fit.

    CUDA: this LLM may hold gpu_memory_utilization of the device's total memory: its own
    weights (own_bytes, measured around its load), its profiled activation peak
    (activation_bytes) and the pool; and the pool never takes more than is free now, less
    that activation peak, so a second LLM in the process sizes its pool from what the
    first left. CPU: kv_cache_memory_bytes, by default 4 GiB, at most half the free RAM.
    Either way no more than max_num_seqs full-length sequences could use (a small model
    must not get millions of blocks, each a Python object of the block manager), unless
    num_kvcache_blocks or kv_cache_memory_bytes says otherwise. mem_info: (free, total) bytes of the device, for
    tests (default torch.cuda.mem_get_info)."""
    most = config.max_num_seqs * -(-config.max_model_len // config.block_size)
    if config.num_kvcache_blocks is not None:
        num_blocks, knob = config.num_kvcache_blocks, "num_kvcache_blocks"
    elif config.device.type == "cuda":
        free, total = (mem_info or torch.cuda.mem_get_info)(config.device)
        share = int(config.gpu_memory_utilization * total) - own_bytes - activation_bytes
        budget = min(share, free - activation_bytes)
        if config.kv_cache_memory_bytes is not None:  # an explicit budget is not capped (as on the CPU)
            budget, most = min(budget, config.kv_cache_memory_bytes), None
        num_blocks, knob = max(budget, 0) // block_bytes, "gpu_memory_utilization"
        num_blocks = num_blocks if most is None else min(num_blocks, most)
        if share > free - activation_bytes and (most is None or num_blocks < most):
            logger.info("KV pool sized by the free device memory (%.2f GiB free, %.2f GiB of the %.0f%% share "
                        "left): another LLM or process holds the rest", free / 2**30, share / 2**30,
                        100 * config.gpu_memory_utilization)
    else:
        budget = config.kv_cache_memory_bytes
        knob = "kv_cache_memory_bytes"
        if budget is None:  # 4 GiB (vLLM's CPU default), at most half the free RAM
            budget = min(_CPU_DEFAULT_BUDGET, available_cpu_memory() // 2)
            num_blocks = min(budget // block_bytes, most)
        else:
            num_blocks = budget // block_bytes
    capacity = num_blocks * config.block_size
    if capacity < config.max_model_len:
        raise ValueError(
            f"the KV cache pool holds {capacity} tokens ({num_blocks} blocks of "
            f"{config.block_size}) but one max_model_len={config.max_model_len} sequence must "
            f"fit; raise {knob} or lower max_model_len (to at most {capacity})")
    return num_blocks


def allocate_kv_cache(config: EngineConfig, num_blocks: int, num_layers: int, num_kv_heads: int,
                      head_dim: int, log: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(pages, scales): pages [layers, 2 (K, V), num_blocks, block_size, Hkv, D] in
    cache_dtype; a quantized cache's (scale, zero) pairs [layers, 2, num_blocks, block_size,
    Hkv, 2] float16 (None for kv_cache_dtype 'auto'), indexed by the same block and slot, so
    a block id names both and a cached block is self-contained. Layers take views.

    Zeroed: masked-out keys of a gathered page must hold finite values (0 * NaN is NaN). On
    the CPU the pool is reserved, not committed (reserve_zeroed): a block's pages come into
    memory when it is first written, so RSS follows the blocks in use."""
    shape = (num_layers, 2, num_blocks, config.block_size, num_kv_heads)
    cache = _zeroed((*shape, head_dim), cache_dtype(config), config.device)
    scales = None if config.kv_cache_dtype == "auto" else _zeroed((*shape, 2), SCALE_DTYPE, config.device)
    if log:
        nbytes = cache.numel() * cache.element_size() + (0 if scales is None else scales.numel() * scales.element_size())
        per_token = bytes_per_token(config, num_layers, num_kv_heads, head_dim)
        logger.info("KV cache (%s): %d blocks x %d tokens = %d tokens, %.2f GiB%s; %d bytes per token, "
                    "%d tokens per GiB", config.kv_cache_dtype, num_blocks, config.block_size,
                    num_blocks * config.block_size, nbytes / (1 << 30),
                    " reserved (committed as blocks are first used)" if commits_lazily(config.device) else "",
                    per_token, (1 << 30) // per_token)
    return cache, scales


def commits_lazily(device: torch.device) -> bool:
    """Whether a pool on this device takes memory only as its blocks are first written
    (the CPU, where anonymous private mappings exist), rather than all at allocation."""
    return device.type == "cpu" and hasattr(mmap, "MAP_PRIVATE")


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if not commits_lazily(device):  # CUDA (or a CPU without mmap): allocated and zeroed now
        return kernels.huge_pages(torch.empty(shape, dtype=dtype, device=device)).zero_()
    # No transparent huge pages here: the pool is [layers, 2, blocks, ...], so the first block
    # would commit 2 MiB in each layer's K and V (120 MiB for SmolLM2's 30 layers) where 4 KiB
    # pages commit what is written. Paged attention over 4 KiB pages timed the same (SmolLM2's
    # shapes, 8 sequences of 1,024 tokens over 4,000 blocks: 41-43 ms a step either way).
    return reserve_zeroed(shape, dtype)


def reserve_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor over its own anonymous private mapping. Linux reserves the address
    range and hands out a zeroed page at the first write to it: nothing is committed until
    then (reads of an unwritten page share the kernel's zero page). torch.empty may also
    not touch a large allocation, but whether its memory is fresh (and zero) is up to the
    allocator; the mapping makes both certain. The tensor holds the mapping, which is
    unmapped when the last view of it goes."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
