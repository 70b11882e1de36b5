"""The decoder layers of a single-rank Llama-family model on the CPU kernels, all of them
in one C call (nk_decoder_layers, nk_decoder_layer for each): the same kernels the modules
call one by one, without returning to Python between them. On a small model a decode step
is otherwise mostly Python and dispatch overhead.

Built by the model when the kernel switch fuses its layers (layers/custom_op.py: one
rank, SiLU, the cpu attention backend), after every layer has packed its weights."""

from __future__ import annotations

import weakref

import torch

from nanokv.attention.base import AttentionMetadata
from nanokv.kernels.ffi import NkLayer, NkStep, ptr
from nanokv.kernels.ops import OutputBuffer, decoder_layers


class FusedCpuLayers:
    def __init__(self, model):
        self.model = model  # DecoderModel
        descs = [self._describe(layer) for layer in model.layers]
        self.layers = (NkLayer * len(descs))(*descs)  # one C array: all layers run in one call
        self.cache_seen = None  # weakref to the first layer's K cache self.layers points at (_point_at_caches)
        self.buffers: dict[str, OutputBuffer] = {}

    @staticmethod
    def _describe(layer) -> NkLayer:
        attn, mlp = layer.self_attn, layer.mlp
        qkv, o, gu, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
        assert len({p.packed.format for p in (qkv, o, gu, down)}) == 1  # one format per layer (nk_decoder_layer)
        return NkLayer(
            H=layer.input_layernorm.weight.shape[0], Hq=attn.num_heads, Hkv=attn.num_kv_heads, D=attn.head_dim,
            I=gu.out_features, bs=0, fmt=qkv.packed.code, eps=layer.input_layernorm.eps, scale=attn.attn.scale,
            input_norm=ptr(layer.input_layernorm.weight), post_norm=ptr(layer.post_attention_layernorm.weight),
            q_norm=ptr(attn.q_norm.weight if attn.q_norm is not None else None),
            k_norm=ptr(attn.k_norm.weight if attn.k_norm is not None else None),
            qkv=ptr(qkv.packed.data), qkv_bias=ptr(qkv.bias), o=ptr(o.packed.data), o_bias=ptr(o.bias),
            gate_up=ptr(gu.packed.data), gate_up_bias=ptr(gu.packed_bias if gu.bias is not None else None),
            down=ptr(down.packed.data), down_bias=ptr(down.bias))

    def _point_at_caches(self) -> None:
        """Each layer's KV cache pages into its description, when the runner has set new
        ones (it sets every layer's at once: the first layer's tensor tells)."""
        first = self.model.layers[0].self_attn.attn.k_cache
        if self.cache_seen is not None and self.cache_seen() is first:
            return
        for desc, layer in zip(self.layers, self.model.layers):
            cache = layer.self_attn.attn
            desc.k_cache, desc.v_cache = cache.k_cache.data_ptr(), cache.v_cache.data_ptr()
            desc.k_scales, desc.v_scales = ptr(cache.k_scales), ptr(cache.v_scales)  # None: float32 pages
            desc.bs = cache.k_cache.shape[1]
        self.cache_seen = weakref.ref(first)  # not a reference: release_kv_cache frees the pool at once

    def _buffer(self, name: str, rows: int, cols: int) -> torch.Tensor:
        return self.buffers.setdefault(name, OutputBuffer()).get(rows, cols)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings x [T, H] -> (last layer's output, residual), both [T, H], or [len(keep), H]
        for the rows keep lists, in its order. The last layer runs o_proj and the MLP for
        the kept rows only: of a prefill chunk, only the token that samples needs more
        than its K/V there (DecoderLayer does the same)."""
        T, H = x.shape
        first = self.model.layers[0].self_attn
        q_dim, kv_dim = first.num_heads * first.head_dim, first.num_kv_heads * first.head_dim
        inter = self.layers[0].I
        st = meta.backend_state  # the cpu backend's CpuAttentionState
        cos, sin = (r.reshape(T, -1) for r in rope)
        step = NkStep(
            T=T, width=st.tables.shape[1], max_len=meta.max_seq_len, cos=ptr(cos), sin=ptr(sin),
            slots=ptr(meta.slot_mapping), rows=ptr(st.rows), ctx=ptr(st.ctx), tables=ptr(st.tables),
            normed=ptr(self._buffer("normed", T, H)), qkv=ptr(self._buffer("qkv", T, q_dim + 2 * kv_dim)),
            q=ptr(self._buffer("q", T, q_dim)), k=ptr(self._buffer("k", T, kv_dim)),
            attn=ptr(self._buffer("attn", T, q_dim)), o=ptr(self._buffer("o", T, H)),
            act=ptr(self._buffer("act", T, inter)))
        fewer = keep is not None and keep.numel() < T
        if fewer:
            kept, order = keep.sort()
            step.keep_n, step.keep = kept.numel(), ptr(kept)
        hidden, residual = self._buffer("hidden", T, H), self._buffer("residual", T, H)
        self._point_at_caches()
        decoder_layers(self.layers, step, x, residual, hidden)
        if not fewer:
            return (hidden, residual) if keep is None else (hidden[keep], residual[keep])
        n = kept.numel()
        out_h, out_r = torch.empty(n, H), torch.empty(n, H)
        out_h[order], out_r[order] = hidden[:n], residual[:n]
        return out_h, out_r
