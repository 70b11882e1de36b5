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
                device: torch.device, block_size: int, max_model_len: int,
                kv_dtype: torch.dtype | None = None) -> None:
        """Compile, before the first step, whatever the backend would otherwise compile in
        the middle of a run (Triton: every kernel variant); this rank's head counts; kv_dtype:
        the pages' element type when it is not dtype (a quantized cache)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, k_scales: torch.Tensor | None = None,
                v_scales: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D], caches [num_blocks, block_size, Hkv, D] -> [T, Hq, D].
        A quantized cache (int8, or float8 e4m3) comes with its scales [num_blocks,
        block_size, Hkv, 2] float16, (scale, zero): the stored value is q * scale + zero
        (quantize_kv)."""
        raise NotImplementedError


# The largest magnitude of each quantized format: a token-head's values are stored as
# q * scale + zero with |q| <= QMAX.
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
PARAM_DTYPE = torch.float16  # (scale, zero) of each token-head: 4 bytes next to its D values


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric, per (token, head): x [T, H, D] -> (q [T, H, D] in dtype, params [T, H, 2]
    float16 = (scale, zero)) with x ~ q * scale + zero. zero is the midpoint of the head's
    values, (max + min) / 2, rounded to float16; scale = max |x - zero| / QMAX, rounded to
    float16; int8 rounds (x - zero) / scale to nearest even (|q| <= 127), fp8 casts it to
    e4m3. Rounding zero first and measuring the range from it keeps |q| <= QMAX (the scale's
    own rounding moves the largest |q| by < 0.07, which rounds away). A constant head gets
    scale 0, q 0 and is exact. The C store (kernels/csrc/kv_store.c's quantize_kv_row) and
    the Triton one compute the same bits."""
    xf = x.float()
    zero = ((xf.amax(-1) + xf.amin(-1)) / 2).to(PARAM_DTYPE).float()  # [T, H]
    centred = xf - zero[..., None]
    scale = (centred.abs().amax(-1) / QMAX[dtype]).to(PARAM_DTYPE).float()
    y = centred / torch.where(scale > 0, scale, 1.0)[..., None]
    if dtype == torch.int8:
        y = torch.round(y).clamp_(-127, 127)
    return y.to(dtype), torch.stack([scale, zero], -1).to(PARAM_DTYPE)


def dequantize_kv(q: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """q [..., D] int8 / fp8, params [..., 2] float16 (scale, zero) -> float32 [..., D]."""
    p = params.float()
    return q.float() * p[..., :1] + p[..., 1:]


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scales: torch.Tensor | None = None,
             v_scales: torch.Tensor | None = None) -> None:
    """Write the new tokens' k, v [T, Hkv, D] into their slots of the paged caches
    [num_blocks, block_size, Hkv, D] (slot = block * block_size + offset); a quantized cache
    (scales [num_blocks, block_size, Hkv, 2] given) stores quantize_kv's values and params."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    if k_scales is not None:
        (k, ks), (v, vs) = quantize_kv(k, k_cache.dtype), quantize_kv(v, v_cache.dtype)
        k_scales.view(-1, num_kv_heads, 2).index_copy_(0, slot_mapping, ks)
        v_scales.view(-1, num_kv_heads, 2).index_copy_(0, slot_mapping, vs)
    for x, cache in ((k, k_cache), (v, v_cache)):
        if cache.dtype == torch.float8_e4m3fn:  # index_copy_ has no float8 kernel: move the bytes
            x, cache = x.view(torch.uint8), cache.view(torch.uint8)
        cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, x)
