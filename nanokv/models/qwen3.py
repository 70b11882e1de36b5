"""Qwen3: the Llama decoder with per-head RMSNorm on q and k (head_dim from the config)."""

from __future__ import annotations

from nanokv.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def variant(cfg) -> dict:
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError("Qwen3 checkpoints with use_sliding_window=true are not supported")
        bias = bool(getattr(cfg, "attention_bias", False))
        return dict(qkv_bias=bias, o_bias=bias, qk_norm=True, mlp_bias=False)
