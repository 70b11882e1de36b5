"""Rotary position embedding with a precomputed cos/sin table indexed by position."""

from __future__ import annotations

import torch
from torch import nn

# Rope types whose frequencies do not depend on the sequence length.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(hf_config) -> dict:
    """The checkpoint's rope settings as one dict with rope_type and rope_theta, across
    transformers versions (5.x: config.rope_parameters; 4.x: rope_theta + rope_scaling)."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        params = dict(params)
    else:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def inverse_frequencies(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2], attention scaling), computed as transformers does."""
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; nanokv supports "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    if rope_type == "default":
        base = float(params["rope_theta"])
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        return 1.0 / (base ** exponent), 1.0
    # Scaled variants: use transformers' own formulas, so results match it exactly.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config, head_dim: int, max_positions: int):
        super().__init__()
        if head_dim % 2:  # the torch path failed at the first step, the C kernel would misread cos/sin
            raise ValueError(f"head_dim={head_dim} in config.json is odd: rotary embeddings rotate pairs of "
                             "dimensions, so nanokv needs an even head_dim")
        inv_freq, scaling = inverse_frequencies(hf_config, head_dim)
        freqs = torch.arange(max_positions, device="cpu").float()[:, None] * inv_freq[None, :]  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        # built on the CPU; the runner moves the model (buffers included) to its device
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] for the step's positions: once per step, shared by all layers."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # q [T, Hq, D]; k [T, Hkv, D]; cos, sin [T, 1, D]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
