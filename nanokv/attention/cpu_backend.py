"""CPU paged attention in C (nanokv/kernels/csrc/attention.c): every query token reads its
keys and values in place through the block table, once; no page gather, no padding.

A prefill token at position p is simply a query that sees the first p + 1 cached tokens
of its sequence (its own K/V are written to the cache first), so decodes, prefill chunks
and chunks after a cached prefix all go through one kernel call per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import nanokv.kernels as kernels
from nanokv.attention.base import AttentionBackend, AttentionMetadata, store_kv


@dataclass
class CpuAttentionState:
    """Per query token: its sequence's row in the block tables and how many cached tokens
    it sees (int32 [T] each); the block tables as int32 [B, width], contiguous."""

    rows: torch.Tensor
    ctx: torch.Tensor
    tables: torch.Tensor


class CpuBackend(AttentionBackend):
    name = "cpu"

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        q_lens = meta.query_lens_cpu
        num_seqs = len(q_lens)
        if meta.num_decodes == num_seqs:  # decodes only: query b is sequence b, sees all of it
            rows = torch.arange(num_seqs, dtype=torch.int32)
            ctx = meta.seq_lens.to(torch.int32)
        else:
            q_lens_t = torch.tensor(q_lens)
            num_tokens = sum(q_lens)
            rows = torch.repeat_interleave(torch.arange(num_seqs, dtype=torch.int32), q_lens_t,
                                           output_size=num_tokens)
            first = (meta.seq_lens.long() - q_lens_t)[rows]  # position of each sequence's first new token
            offset = torch.arange(num_tokens) - meta.query_start_loc[:-1].long()[rows]
            ctx = (first + offset + 1).to(torch.int32)
        meta.backend_state = CpuAttentionState(rows, ctx.contiguous(), meta.block_tables.contiguous())

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, k_scales=None, v_scales=None):
        if k_scales is None:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        else:  # int8 pages: quantized in C on the way in
            kernels.store_kv(_heads_contiguous(k), _heads_contiguous(v), k_cache, v_cache, meta.slot_mapping,
                             k_scales, v_scales)
        st = meta.backend_state
        out = torch.empty_like(q)  # [T, Hq, D]
        kernels.paged_attention(q.contiguous(), k_cache, v_cache, st.tables, st.rows, st.ctx, meta.max_seq_len,
                                scale, out, k_scales, v_scales)
        return out


def _heads_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] as nk_store_kv reads it: rows at any stride, each row's H * D values dense."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()
