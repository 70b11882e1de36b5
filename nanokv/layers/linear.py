"""Linear layers whose weights the loader fills, including fused (packed) projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _check_shape(param_name: str, expected: torch.Size, got: torch.Size) -> None:
    if expected != got:
        raise ValueError(f"checkpoint tensor for {param_name} has shape {tuple(got)}, "
                         f"the model config implies {tuple(expected)}")


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    _check_shape(getattr(param, "nanokv_name", "a parameter"), param.shape, loaded.shape)
    param.data.copy_(loaded)


class Linear(nn.Module):
    """y = x W^T (+ b). Plain: one checkpoint tensor per parameter."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PackedLinear(Linear):
    """Several projections of the same input fused into one GEMM (q|k|v, gate|up).

    Each checkpoint shard (named by shard_names) fills its row range of the weight.
    """

    def __init__(self, in_features: int, output_sizes: list[int], shard_names: list[str],
                 bias: bool = False):
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        self.shards = {name: (off, size) for name, off, size in zip(shard_names, offsets, output_sizes)}
        for p in (self.weight, self.bias):
            if p is not None:
                p.weight_loader = self._load_shard
                p.shard_ids = tuple(shard_names)

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        offset, size = self.shards[shard_id]
        target = param.data.narrow(0, offset, size)
        _check_shape(f"{getattr(param, 'nanokv_name', 'a parameter')}[{shard_id}]", target.shape, loaded.shape)
        target.copy_(loaded)
