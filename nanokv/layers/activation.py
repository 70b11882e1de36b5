"""Gated activations over a fused [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanokv import kernels


class SiluAndMul(nn.Module):
    cpu_kernels = False

    def use_cpu_kernels(self) -> None:
        self.cpu_kernels = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        if self.cpu_kernels:
            return kernels.silu_mul(x.contiguous())
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
