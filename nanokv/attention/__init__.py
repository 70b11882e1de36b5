"""Paged attention backends sharing one KV cache layout: [num_blocks, block_size, kv_heads, head_dim].

Backends are imported lazily by name, so a CPU install never imports GPU-only packages.
"""

from __future__ import annotations

from nanokv.attention.base import AttentionBackend, AttentionMetadata

BACKENDS = ("torch",)


def get_backend(name: str) -> AttentionBackend:
    if name == "torch":
        from nanokv.attention.torch_ref import TorchRefBackend

        return TorchRefBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")


__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend", "BACKENDS"]
