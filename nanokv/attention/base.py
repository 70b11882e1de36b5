"""What every attention backend receives, and the interface it implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """One step's flat (varlen) batch, shared by all layers.

    Sequences are ordered decodes first: the first num_decodes sequences have exactly one
    query token each (tokens [0, num_decodes) of the flat batch), the rest are prefill
    chunks, possibly continuing after a cached prefix.
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) per new token
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32: context length per sequence after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, rows padded with 0
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]  # host copies, for backends that plan on the host
    seq_lens_cpu: list[int]
    backend_state: Any = None  # filled once per step by AttentionBackend.prepare

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_prefills(self) -> int:
        return self.num_seqs - self.num_decodes


class AttentionBackend:
    """Writes new K/V into the paged cache and attends over it (causal within the new
    tokens, full over the cached prefix)."""

    name = "base"
    # True when prepare() derives nothing from host-side lengths beyond upper bounds, so a
    # decode step captured in a CUDA graph stays correct when replayed with new lengths.
    supports_cuda_graphs = False

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Derive per-step helper tensors once, before the layers run."""

    def warm_up(self, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device, block_size: int, max_model_len: int) -> None:
        """Compile, before the first step, whatever the backend would otherwise compile in
        the middle of a run (Triton: every kernel variant); this rank's head counts."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D], caches [num_blocks, block_size, Hkv, D] -> [T, Hq, D]."""
        raise NotImplementedError


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write the new tokens' k, v [T, Hkv, D] into their slots of the paged caches
    [num_blocks, block_size, Hkv, D] (slot = block * block_size + offset)."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
