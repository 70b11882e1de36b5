"""Pure-torch paged attention: the CPU default and the oracle for the other backends.

No Python loop over sequences: sequences of similar length form a group; each group
gathers its pages through the block tables with one index op and runs one masked SDPA
call. Groups keep padding (and so memory traffic) low when lengths differ widely.

On quantized pages (int8, fp8) attention runs in float64 and rounds its output to the
query's dtype. SDPA's sums run in an order that depends on the shapes of the step (how
many queries, how padded), so a token's output moves by an ulp with the batch it is in;
on a quantized cache that ulp, quantized into the next layer's K/V, can move a value by a
whole int8 step and change the request's tokens with its prefix cached or its chunks cut
elsewhere. In float64 the shapes' effect stays far below float32's rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanokv.attention.base import AttentionBackend, AttentionMetadata, dequantize_kv, store_kv

_GROWTH = 1.5  # a group's longest context may be this many times its shortest ...
_MIN_GROUP = 8  # ... once it holds this many sequences


@dataclass
class _Group:
    seqs: slice  # sequences (in batch order) of the group
    tokens: slice  # their tokens in the flat batch
    block_tables: torch.Tensor  # [b, nb] pages to gather (nb * block_size >= every context)
    mask: torch.Tensor  # [b, 1, q, nb * block_size] bool: which keys each query sees
    dest: torch.Tensor | None = None  # prefill: flat token -> row of the padded [b * q] queries
    max_query_len: int = 1


class TorchRefBackend(AttentionBackend):
    name = "torch"

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        cu = [0]
        for n in meta.query_lens_cpu:
            cu.append(cu[-1] + n)
        groups = [self._decode_group(meta, g, cu, block_size) for g in _split(meta.seq_lens_cpu, 0, meta.num_decodes)]
        groups += [self._prefill_group(meta, g, cu, block_size)
                   for g in _split(meta.query_lens_cpu, meta.num_decodes, meta.num_seqs)]
        meta.backend_state = groups

    @staticmethod
    def _decode_group(meta, seqs: slice, cu, block_size) -> _Group:
        nb = -(-max(meta.seq_lens_cpu[seqs]) // block_size)
        keys = torch.arange(nb * block_size, device=meta.seq_lens.device)
        mask = keys[None, :] < meta.seq_lens[seqs, None]  # [b, L]
        return _Group(seqs, slice(cu[seqs.start], cu[seqs.stop]), meta.block_tables[seqs, :nb],
                      mask[:, None, None, :])

    @staticmethod
    def _prefill_group(meta, seqs: slice, cu, block_size) -> _Group:
        dev = meta.seq_lens.device
        q_lens_cpu = meta.query_lens_cpu[seqs]
        q_lens = torch.tensor(q_lens_cpu, device=dev)
        seq_lens = meta.seq_lens[seqs]
        max_q, num_tokens = max(q_lens_cpu), cu[seqs.stop] - cu[seqs.start]
        nb = -(-max(meta.seq_lens_cpu[seqs]) // block_size)
        # flat token t of sequence b, i-th in its chunk -> padded row b * max_q + i
        owner = torch.repeat_interleave(torch.arange(len(q_lens_cpu), device=dev), q_lens, output_size=num_tokens)
        starts = torch.tensor([cu[i] - cu[seqs.start] for i in range(seqs.start, seqs.stop)], device=dev)
        dest = owner * max_q + torch.arange(num_tokens, device=dev) - starts[owner]
        # query i of sequence b sits at position (seq_len - q_len) + i and sees keys <= it
        q_pos = (seq_lens - q_lens)[:, None] + torch.arange(max_q, device=dev)[None, :]  # [b, max_q]
        keys = torch.arange(nb * block_size, device=dev)
        mask = (keys[None, None, :] <= q_pos[:, :, None]) & (keys[None, None, :] < seq_lens[:, None, None])
        return _Group(seqs, slice(cu[seqs.start], cu[seqs.stop]), meta.block_tables[seqs, :nb],
                      mask[:, None], dest, max_q)

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, k_scales=None, v_scales=None):
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scales, v_scales)
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        gqa = q.shape[1] != num_kv_heads
        out = torch.empty_like(q)  # [T, Hq, D]
        if k_scales is not None:  # float64 (module docstring), out in q's dtype
            q = q.double()
        for g in meta.backend_state:
            keys, values = _gather(k_cache, g.block_tables), _gather(v_cache, g.block_tables)
            if k_scales is not None:  # the group's gathered pages only, never the whole pool
                keys = dequantize_kv(keys, _gather(k_scales, g.block_tables)).double()
                values = dequantize_kv(values, _gather(v_scales, g.block_tables)).double()
            if g.dest is None:  # decodes: one query per sequence
                o = F.scaled_dot_product_attention(q[g.tokens].unsqueeze(2), keys, values, attn_mask=g.mask,
                                                   scale=scale, enable_gqa=gqa)  # [b, Hq, 1, D]
                out[g.tokens] = o.squeeze(2).to(out.dtype)
                continue
            b = g.block_tables.shape[0]
            padded = q.new_zeros(b * g.max_query_len, q.shape[1], head_dim)
            padded[g.dest] = q[g.tokens]
            padded = padded.view(b, g.max_query_len, q.shape[1], head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(padded, keys, values, attn_mask=g.mask,
                                               scale=scale, enable_gqa=gqa)  # [b, Hq, max_q, D]
            out[g.tokens] = o.transpose(1, 2).reshape(-1, q.shape[1], head_dim)[g.dest].to(out.dtype)
        return out


def _split(lengths: list[int], start: int, stop: int) -> list[slice]:
    """Cut sequences [start, stop) (sorted by length) into groups of similar length."""
    groups, first = [], start
    for i in range(start + 1, stop):
        if i - first >= _MIN_GROUP and lengths[i] > _GROWTH * max(lengths[first], 1):
            groups.append(slice(first, i))
            first = i
    if stop > start:
        groups.append(slice(first, stop))
    return groups


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, H, *rest] pages of each row of block_tables -> [b, H, nb * bs, *rest]
    (K/V pages [.., D], or their scales)."""
    b, nb = block_tables.shape
    # index_select copies whole pages (memcpy per row): far faster than advanced indexing
    pages = torch.index_select(cache.view(cache.shape[0], -1), 0, block_tables.reshape(-1))
    return pages.view(b, nb * cache.shape[1], *cache.shape[2:]).transpose(1, 2)
