"""Paged attention backends sharing one KV cache layout: [num_blocks, block_size, kv_heads, head_dim]
(a quantized cache adds its (scale, zero) pairs [num_blocks, block_size, kv_heads, 2]: base.py).

Backends are imported lazily by name, so a CPU install never imports triton or flash_attn
unless asked.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from nanokv.attention.base import AttentionBackend, AttentionMetadata

BACKENDS = ("torch", "cpu", "triton", "flash_attn")
_FLASH_DTYPES = (torch.float16, torch.bfloat16)  # flash-attn has no float32 kernels


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _cpu_kernels_fit(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the C attention kernel suits the model and could build: a compiler is
    looked up, nothing compiled (the model's build does that, and falls back to torch
    should it fail: layers/custom_op.py)."""
    import nanokv.kernels as kernels

    return (device.type == "cpu" and dtype == torch.float32 and head_dim % 8 == 0 and head_dim <= 512
            and kernels.can_build())


def resolve_backend(name: str, device: torch.device, block_size: int,
                    dtype: torch.dtype = torch.float32, head_dim: int = 64) -> str:
    """The backend to use. "auto": flash_attn if importable on CUDA (and the block size and
    a half-precision dtype suit it), else triton on CUDA; on the CPU the C kernels (float32,
    head_dim a multiple of 8 up to 512, a C compiler at hand), else torch. ValueError for a
    choice that cannot work."""
    if name == "auto":
        if device.type == "cuda":
            if _importable("flash_attn") and block_size % 256 == 0 and dtype in _FLASH_DTYPES:
                return "flash_attn"
            if _importable("triton"):
                return "triton"
        if _cpu_kernels_fit(device, dtype, head_dim):
            return "cpu"
        return "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; choose 'auto' or one of {', '.join(BACKENDS)}")
    if name == "cpu" and not _cpu_kernels_fit(device, dtype, head_dim):
        raise ValueError("attention_backend='cpu' needs device='cpu', dtype float32, a head_dim that is a "
                         "multiple of 8 (at most 512) and a C compiler (cc/gcc on PATH; NANOKV_CPU_KERNELS unset); "
                         "use attention_backend='torch' otherwise")
    if name == "triton":
        if not _importable("triton"):
            raise ValueError("attention_backend='triton' needs triton: pip install 'nanokv[triton]'")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend='triton' runs on CUDA; on the CPU only in Triton's "
                             "interpreter (set TRITON_INTERPRET=1 before starting; slow, for tests)")
    if name == "flash_attn":
        if device.type != "cuda" or not _importable("flash_attn"):
            raise ValueError("attention_backend='flash_attn' needs a CUDA device and the flash-attn "
                             "package (pip install 'nanokv[flash]')")
        if block_size % 256:
            raise ValueError(f"attention_backend='flash_attn' needs kvcache_block_size to be a multiple "
                             f"of 256 (got {block_size}); set kvcache_block_size=256")
        if dtype not in _FLASH_DTYPES:
            raise ValueError(f"attention_backend='flash_attn' runs float16 and bfloat16 only (got "
                             f"{str(dtype).replace('torch.', '')}); set dtype='bfloat16' or attention_backend='triton'")
    return name


def get_backend(name: str) -> AttentionBackend:
    if name == "torch":
        from nanokv.attention.torch_ref import TorchRefBackend

        return TorchRefBackend()
    if name == "cpu":
        from nanokv.attention.cpu_backend import CpuBackend

        return CpuBackend()
    if name == "triton":
        from nanokv.attention.triton_backend import TritonBackend

        return TritonBackend()
    if name == "flash_attn":
        from nanokv.attention.flash_attn import FlashAttnBackend

        return FlashAttnBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")


__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend", "resolve_backend", "BACKENDS"]
