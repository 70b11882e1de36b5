"""Qwen2 / Qwen2.5: the Llama decoder with a q/k/v bias (no o_proj bias)."""

from __future__ import annotations

from nanokv.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def variant(cfg) -> dict:
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError("Qwen2 checkpoints with use_sliding_window=true are not supported")
        return dict(qkv_bias=True, o_bias=False, qk_norm=False, mlp_bias=False)
