"""Gated activations over a fused [gate | up] projection (the torch path; with the CPU
kernels SiLU runs inside the gate/up GEMM, see GateUpLinear).

The activation comes from the config's hidden_act: SiLU (every Llama / Qwen checkpoint
released) on every path; any other parameter-free activation transformers knows runs as
transformers' own module, on the torch path for the activation alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SILU_NAMES = ("silu", "swish")
# transformers' activations with learned weights: no Llama / Qwen checkpoint carries them
_WITH_PARAMETERS = ("prelu", "xielu")


def supported_activations() -> list[str]:
    from transformers.activations import ACT2CLS

    return sorted(name for name in ACT2CLS if name not in _WITH_PARAMETERS)


def check_activation(hf_config) -> str:
    """The config's hidden_act; ValueError naming the supported ones otherwise."""
    name = getattr(hf_config, "hidden_act", "silu")
    if name in SILU_NAMES:
        return name
    supported = supported_activations()
    if not isinstance(name, str) or name not in supported:
        raise ValueError(f"hidden_act={name!r} in config.json is not supported; nanokv supports "
                         f"{', '.join(supported)}")
    return name


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class ActAndMul(nn.Module):
    """act(gate) * up with transformers' module for `name`, so the numbers are its own."""

    def __init__(self, name: str):
        super().__init__()
        from transformers.activations import ACT2FN

        self.act = ACT2FN[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up


def gated_activation(name: str) -> nn.Module:
    return SiluAndMul() if name in SILU_NAMES else ActAndMul(name)
