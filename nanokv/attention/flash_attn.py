"""flash-attn backend (used only when the flash_attn package imports, on CUDA).

Prefill chunks go through flash_attn_varlen_func and decodes through
flash_attn_with_kvcache, both reading the paged cache through block_table. flash-attn's
paged KV needs a block size that is a multiple of 256 (checked at start-up).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from nanokv.attention.base import AttentionBackend, AttentionMetadata, store_kv


@dataclass
class _PrefillPlan:
    cu_seqlens_q: torch.Tensor  # [bp + 1] int32, from 0
    cu_seqlens_k: torch.Tensor  # [bp + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"
    supports_cuda_graphs = True  # the decode path reads lengths from device tensors only

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        nd = meta.num_decodes
        if meta.num_prefills == 0:
            meta.backend_state = None
            return
        cu_q = meta.query_start_loc[nd:] - meta.query_start_loc[nd]
        cu_k = torch.zeros(meta.num_prefills + 1, dtype=torch.int32, device=meta.seq_lens.device)
        torch.cumsum(meta.seq_lens[nd:], dim=0, out=cu_k[1:])
        meta.backend_state = _PrefillPlan(cu_q.to(torch.int32), cu_k, max(meta.query_lens_cpu[nd:]),
                                          max(meta.seq_lens_cpu[nd:]))

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, k_scales=None, v_scales=None):
        assert k_scales is None  # quantized caches are refused for flash_attn (config.py)
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)  # [T, Hq, D]
        nd = meta.num_decodes
        if nd:
            o = flash_attn_with_kvcache(q[:nd].unsqueeze(1), k_cache, v_cache,
                                        cache_seqlens=meta.seq_lens[:nd], block_table=meta.block_tables[:nd],
                                        softmax_scale=scale, causal=True)  # [nd, 1, Hq, D]
            out[:nd] = o.squeeze(1)
        plan: _PrefillPlan | None = meta.backend_state
        if plan is not None:
            out[nd:] = flash_attn_varlen_func(
                q[nd:], k_cache, v_cache, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_seqlen_q,
                plan.max_seqlen_k, softmax_scale=scale, causal=True, block_table=meta.block_tables[nd:])
        return out
