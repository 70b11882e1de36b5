"""The attention layer: owns its slice of the paged KV cache, delegates math to a backend."""

from __future__ import annotations

import torch
from torch import nn

from nanokv.attention.base import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # Set by the model runner once the pool is sized: [num_blocks, block_size, Hkv, D] each.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # a quantized cache's (scale, zero) pairs, [num_blocks, block_size, Hkv, 2] float16 each; None otherwise
        self.k_scales: torch.Tensor | None = None
        self.v_scales: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # q [T, Hq, D]; k, v [T, Hkv, D] -> [T, Hq, D]
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale,
                                    self.k_scales, self.v_scales)
