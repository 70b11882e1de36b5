"""Llama-family decoder (Llama 2/3/3.1); Qwen2 and Qwen3 are configurations of it.

Differences the family needs: Qwen2 adds a q/k/v bias, Qwen3 normalises q and k per
head (RMSNorm over head_dim) before rotary, Llama may carry attention/MLP biases.
"""

from __future__ import annotations

import torch
from torch import nn

import nanokv.kernels as kernels
from nanokv.attention.base import AttentionMetadata
from nanokv.config import model_head_dim
from nanokv.distributed import TP
from nanokv.kernels.fused_layers import FusedCpuLayers
from nanokv.layers.activation import SILU_NAMES, check_activation, gated_activation
from nanokv.layers.attention import Attention
from nanokv.layers.custom_op import CustomOp
from nanokv.layers.embedding import LMHead, VocabParallelEmbedding
from nanokv.layers.linear import GateUpLinear, PackedLinear, RowParallelLinear, share_output_buffers
from nanokv.layers.norm import RMSNorm
from nanokv.layers.rotary import RotaryEmbedding


class DecoderAttention(CustomOp):
    """Heads split across tensor-parallel ranks; KV heads too, or replicated when there
    are fewer KV heads than ranks."""

    def __init__(self, cfg, tp: TP, qkv_bias: bool, o_bias: bool, qk_norm: bool):
        super().__init__()
        d = self.head_dim = model_head_dim(cfg)
        total_heads, total_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.num_heads = total_heads // tp.size
        first_kv, self.num_kv_heads = kv_heads_of_rank(total_kv, tp)
        self.qkv_proj = PackedLinear(cfg.hidden_size, {
            "q_proj": (total_heads * d, tp.rank * self.num_heads * d, self.num_heads * d),
            "k_proj": (total_kv * d, first_kv * d, self.num_kv_heads * d),
            "v_proj": (total_kv * d, first_kv * d, self.num_kv_heads * d),
        }, bias=qkv_bias)
        self.o_proj = RowParallelLinear(total_heads * d, cfg.hidden_size, tp, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)

    def forward_native(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, meta: AttentionMetadata,
                       keep: torch.Tensor | None = None) -> torch.Tensor:
        """[T, hidden] -> [T, hidden], or [len(keep), hidden]: o_proj of the kept rows only."""
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) D]
        q, k, v = qkv.split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryEmbedding.apply(q, k, *rope)
        o = self.attn(q, k, v, meta).reshape(T, -1)  # [T, Hq * D]
        return self.o_proj(o if keep is None else o[keep])

    def prepare_cpu(self, choice):
        self._qk_norms = ((self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.q_norm is not None
                          else (None, None, 0.0))
        return self.forward_cpu

    def forward_cpu(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, meta: AttentionMetadata,
                    keep: torch.Tensor | None = None) -> torch.Tensor:
        """forward_native with q/k norm and rotary in one pass over the rows."""
        T = x.shape[0]
        qkv = self.qkv_proj(x).contiguous()  # [T, (Hq + 2 Hkv) D]
        v = qkv.split(self.qkv_proj.output_sizes, dim=-1)[2].view(T, self.num_kv_heads, self.head_dim)
        q, k = kernels.qk_norm_rope(qkv, self.num_heads, self.num_kv_heads, self.head_dim, *self._qk_norms,
                                    *(r.view(T, -1) for r in rope))  # [T, Hq, D], [T, Hkv, D]
        o = self.attn(q, k, v, meta).reshape(T, -1)  # [T, Hq * D]
        return self.o_proj(o if keep is None else o[keep])


class MLP(CustomOp):
    def __init__(self, hidden: int, intermediate: int, tp: TP, bias: bool, act: str = "silu"):
        super().__init__()
        start, per_rank = tp.split(intermediate)
        self.gate_up_proj = GateUpLinear(hidden, (intermediate, start, per_rank), bias=bias,
                                         fuse_silu=act in SILU_NAMES)
        self.down_proj = RowParallelLinear(intermediate, hidden, tp, bias=bias)
        self.act = gated_activation(act)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))

    def prepare_cpu(self, choice):
        # other activations: the GEMMs on the kernels, the activation in torch
        return self.forward_cpu if self.gate_up_proj.fuse_silu else self.forward_native

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:  # SiLU runs in the gate/up GEMM
        return self.down_proj(self.gate_up_proj.silu_and_mul(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, tp, qkv_bias, o_bias, qk_norm, mlp_bias):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DecoderAttention(cfg, tp, qkv_bias, o_bias, qk_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, tp, mlp_bias, check_activation(cfg))

    def forward(self, rope, x, residual, meta, keep=None):
        """(x, residual) -> (mlp output, residual): each residual add is fused into the
        norm that follows it (HF's order of additions, so the same sums). With keep (row
        indices), only those rows go on past attention: every row's K/V is cached, and the
        last layer's other rows have no use for the rest."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, meta, keep)
        if keep is not None:
            residual = residual[keep]
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(CustomOp):
    def __init__(self, cfg, max_positions, tp, qkv_bias, o_bias, qk_norm, mlp_bias):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary = RotaryEmbedding(cfg, model_head_dim(cfg), max_positions)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, tp, qkv_bias, o_bias, qk_norm, mlp_bias)
            for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fused_layers: FusedCpuLayers | None = None  # all layers in one C call, when the switch fuses them

    def forward_native(self, input_ids, positions, meta, keep=None):
        """[T] token ids -> final hidden states [T, hidden], or of the rows keep lists (in its
        order) when given: the runner keeps the rows it computes logits for."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        rope = self.rotary.lookup(positions, x.dtype)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(rope, x, residual, meta, keep if i == len(self.layers) - 1 else None)
        return self.norm(x, residual)[0]

    def prepare_cpu(self, choice):
        share_output_buffers(self.layers)
        if not choice.fused_layers:
            return self.forward_native  # layer by layer, each on its kernels
        self.fused_layers = FusedCpuLayers(self)  # the layers below have packed their weights
        return self.forward_cpu

    def forward_cpu(self, input_ids, positions, meta, keep=None):
        """forward_native, the decoder layers as one C call each."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        rope = self.rotary.lookup(positions, x.dtype)
        return self.norm(*self.fused_layers.forward(x, rope, meta, keep))[0]


class LlamaForCausalLM(nn.Module):
    """HF checkpoint names map onto ours: q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj."""

    packed_modules = {
        "q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
        "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
    }

    def __init__(self, cfg, max_positions: int, tp: TP = TP()):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, max_positions, tp, **self.variant(cfg))
        tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tp, self.model.embed_tokens if tied else None)

    @staticmethod
    def variant(cfg) -> dict:
        bias = bool(getattr(cfg, "attention_bias", False))
        return dict(qkv_bias=bias, o_bias=bias, qk_norm=False, mlp_bias=bool(getattr(cfg, "mlp_bias", False)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, meta, keep)  # [T or len(keep), hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [N, vocab / tp] float32


def kv_heads_of_rank(total_kv: int, tp: TP) -> tuple[int, int]:
    """(first KV head, count) held by this rank: a split, or one replicated head when
    there are fewer KV heads than ranks."""
    if total_kv >= tp.size:
        return tp.split(total_kv)
    return tp.rank * total_kv // tp.size, 1
