"""RMSNorm, computed in float32 like the reference implementations."""

from __future__ import annotations

import torch
from torch import nn

import nanokv.kernels as kernels
from nanokv.layers.custom_op import CustomOp


class RMSNorm(CustomOp):
    """RMSNorm(x); with residual: (RMSNorm(x + residual), x + residual), the sum becoming
    the next residual (fused in one pass on the CPU kernels)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return kernels.rmsnorm(x.contiguous(), self.weight, self.eps)
        residual = residual.contiguous()
        return kernels.rmsnorm(x.contiguous(), self.weight, self.eps, residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
