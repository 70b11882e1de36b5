"""Pure-torch paged attention: the CPU default and the oracle for the other backends.

No Python loop over sequences: each group (decodes, prefill chunks) gathers its pages
through the block tables with one index op and runs one masked SDPA call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanokv.attention.base import AttentionBackend, AttentionMetadata


@dataclass
class _Group:
    block_tables: torch.Tensor  # [b, nb] pages to gather (nb * block_size >= every context)
    mask: torch.Tensor  # [b, 1, q, nb * block_size] bool: which keys each query sees
    dest: torch.Tensor | None = None  # [tokens] flat token -> row of the padded [b * q] queries
    max_query_len: int = 1


@dataclass
class TorchRefState:
    decode: _Group | None
    prefill: _Group | None


class TorchRefBackend(AttentionBackend):
    name = "torch"

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        nd, dev = meta.num_decodes, meta.seq_lens.device
        decode = prefill = None
        if nd:
            nb = -(-max(meta.seq_lens_cpu[:nd]) // block_size)
            keys = torch.arange(nb * block_size, device=dev)
            mask = keys[None, :] < meta.seq_lens[:nd, None]  # [nd, L]
            decode = _Group(meta.block_tables[:nd, :nb], mask[:, None, None, :])
        if meta.num_prefills:
            q_lens = meta.query_start_loc[nd + 1:] - meta.query_start_loc[nd:-1]  # [bp]
            seq_lens = meta.seq_lens[nd:]
            max_q = max(meta.query_lens_cpu[nd:])
            nb = -(-max(meta.seq_lens_cpu[nd:]) // block_size)
            # flat prefill token t of sequence b, i-th in its chunk -> padded row b * max_q + i
            num_tokens = int(meta.query_start_loc[-1]) - int(meta.query_start_loc[nd])
            owner = torch.repeat_interleave(torch.arange(len(q_lens), device=dev), q_lens,
                                            output_size=num_tokens)
            offset = torch.arange(num_tokens, device=dev) - (meta.query_start_loc[nd:-1] - meta.query_start_loc[nd])[owner]
            dest = owner * max_q + offset
            # query i of sequence b sits at position (seq_len - q_len) + i and sees keys <= it
            q_pos = (seq_lens - q_lens)[:, None] + torch.arange(max_q, device=dev)[None, :]  # [bp, max_q]
            keys = torch.arange(nb * block_size, device=dev)
            mask = (keys[None, None, :] <= q_pos[:, :, None]) & (keys[None, None, :] < seq_lens[:, None, None])
            prefill = _Group(meta.block_tables[nd:, :nb], mask[:, None], dest, max_q)
        meta.backend_state = TorchRefState(decode, prefill)

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
        state: TorchRefState = meta.backend_state
        gqa = q.shape[1] != num_kv_heads
        out = torch.empty_like(q)  # [T, Hq, D]
        nd = meta.num_decodes
        if state.decode is not None:
            g = state.decode
            keys, values = _gather(k_cache, g.block_tables), _gather(v_cache, g.block_tables)
            o = F.scaled_dot_product_attention(q[:nd].unsqueeze(2), keys, values, attn_mask=g.mask,
                                               scale=scale, enable_gqa=gqa)  # [nd, Hq, 1, D]
            out[:nd] = o.squeeze(2)
        if state.prefill is not None:
            g = state.prefill
            b = g.block_tables.shape[0]
            padded = q.new_zeros(b * g.max_query_len, q.shape[1], head_dim)
            padded[g.dest] = q[nd:]
            padded = padded.view(b, g.max_query_len, q.shape[1], head_dim).transpose(1, 2)
            keys, values = _gather(k_cache, g.block_tables), _gather(v_cache, g.block_tables)
            o = F.scaled_dot_product_attention(padded, keys, values, attn_mask=g.mask,
                                               scale=scale, enable_gqa=gqa)  # [b, Hq, max_q, D]
            out[nd:] = o.transpose(1, 2).reshape(-1, q.shape[1], head_dim)[g.dest]
        return out


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, H, D] pages of each row of block_tables -> [b, H, nb * bs, D]."""
    b, nb = block_tables.shape
    return cache[block_tables].view(b, nb * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)
