"""Linear layers whose weights the loader fills: fused (packed) projections and their
tensor-parallel splits (Megatron style).

Weight loaders receive a lazy checkpoint tensor (a safetensors slice: `.get_shape()` and
indexing) and read only this rank's part of it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import nanokv.kernels as kernels
from nanokv.distributed import TP
from nanokv.layers.custom_op import CustomOp


def _check_shape(param_name: str, expected, got) -> None:
    if tuple(expected) != tuple(got):
        raise ValueError(f"checkpoint tensor for {param_name} has shape {tuple(got)}, "
                         f"the model config implies {tuple(expected)}")


def default_weight_loader(param: nn.Parameter, loaded, shard_id=None) -> None:
    """A replicated parameter: the whole tensor."""
    _check_shape(getattr(param, "nanokv_name", "a parameter"), param.shape, loaded.get_shape())
    param.data.copy_(loaded[:])


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class _Matmul(CustomOp):
    """x W^T: torch's GEMM (forward_native), or the CPU GEMM kernel on W packed once, in the
    format the kernel choice gives (float32, bfloat16 or int8: forward_cpu)."""

    packed: kernels.PackedWeight | None = None  # kernels.pack_weight(W): W's only copy once packed
    output_buffer: kernels.OutputBuffer | None = None  # where the kernel writes, when it may be reused

    def prepare_cpu(self, choice):
        if self.packed is None:  # a weight cache hit brings it packed (nanokv/weight_cache.py)
            self.packed = kernels.pack_weight(self.weight.data, choice.weights)
        self.out_features = self.packed.n
        self.weight = None  # one copy of the weights, not two
        return self.forward_cpu

    def _gemm(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> [..., out_features] through the kernel."""
        flat, out = self._kernel_io(x)
        return kernels.linear(flat, self.packed, bias, out).view(*x.shape[:-1], self.out_features)

    def _kernel_io(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x as contiguous [M, K], and where the kernel writes its [M, out_features]."""
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        out = self.output_buffer.get(flat.shape[0], self.out_features) if self.output_buffer else None
        return flat, out


class Linear(_Matmul):
    """y = x W^T (+ b), replicated on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return self._gemm(x, self.bias)


class PackedLinear(Linear):
    """Several projections of the same input fused into one GEMM (q|k|v, gate|up), each
    column-parallel: this rank keeps rows [start, start + size) of every projection.

    shards: name -> (full rows in the checkpoint, start, size) for this rank.
    """

    def __init__(self, in_features: int, shards: dict[str, tuple[int, int, int]], bias: bool = False):
        self.output_sizes = [size for _, _, size in shards.values()]
        super().__init__(in_features, sum(self.output_sizes), bias)
        offsets = [sum(self.output_sizes[:i]) for i in range(len(shards))]
        self.shards = {name: (full, start, size, off)
                       for (name, (full, start, size)), off in zip(shards.items(), offsets)}
        for p in (self.weight, self.bias):
            if p is not None:
                p.weight_loader = self._load_shard
                p.shard_ids = tuple(shards)

    def _load_shard(self, param: nn.Parameter, loaded, shard_id: str) -> None:
        full, start, size, offset = self.shards[shard_id]
        name = f"{getattr(param, 'nanokv_name', 'a parameter')}[{shard_id}]"
        _check_shape(name, (full, *param.shape[1:]), loaded.get_shape())
        param.data.narrow(0, offset, size).copy_(loaded[start:start + size])


class GateUpLinear(PackedLinear):
    """The fused [gate | up] projection of a gated MLP. With the CPU kernels and a SiLU
    model (fuse_silu), silu_and_mul() applies SiLU(gate) * up inside the GEMM (gate and up
    rows packed side by side), so the [T, 2I] intermediate is never materialised; that
    packing serves silu_and_mul only (the MLP calls it instead of forward). Other
    activations get the plain [T, 2I] product."""

    def __init__(self, in_features: int, intermediate_per_rank: tuple[int, int, int], bias: bool = False,
                 fuse_silu: bool = True):
        super().__init__(in_features, {"gate_proj": intermediate_per_rank, "up_proj": intermediate_per_rank}, bias)
        self.fuse_silu = fuse_silu

    def prepare_cpu(self, choice):
        if not self.fuse_silu:
            return super().prepare_cpu(choice)
        i = self.output_sizes[0]
        if self.packed is None:  # else packed, bias too, by a weight cache hit (nanokv/weight_cache.py)
            w = self.weight.data
            self.packed = kernels.pack_gate_up(w[:i], w[i:], choice.weights)
            if self.bias is not None:
                b = self.bias.data
                self.packed_bias = kernels.interleave_gate_up(b[:i, None], b[i:, None]).flatten()
        self.out_features = i
        self.weight = None
        return self._no_plain_product

    def _no_plain_product(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("gate_up_proj is packed for silu_and_mul(): the [T, 2I] product is not kept")

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, I]
        flat, out = self._kernel_io(x)
        bias = self.packed_bias if self.bias is not None else None
        return kernels.linear_silu_mul(flat, self.packed, bias, out)


class RowParallelLinear(_Matmul):
    """y = all_reduce(x_shard W_shard^T) (+ b): this rank holds a slice of the input
    columns; the partial products are summed across ranks."""

    def __init__(self, in_features: int, out_features: int, tp: TP, bias: bool = False):
        super().__init__()
        self.tp = tp
        self.in_start, in_per_rank = tp.split(in_features)
        self.in_features = in_features
        self.weight = _param(out_features, in_per_rank)
        self.weight.weight_loader = self._load_weight
        self.bias = _param(out_features) if bias else None

    def _load_weight(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        _check_shape(getattr(param, "nanokv_name", "a parameter"), (param.shape[0], self.in_features),
                     loaded.get_shape())
        param.data.copy_(loaded[:, self.in_start:self.in_start + param.shape[1]])

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self._gemm(x))
        return y + self.bias if self.bias is not None else y


def share_output_buffers(layers: nn.ModuleList) -> None:
    """A decoder layer's projection outputs are consumed within the layer (or, the last
    one's, by the next layer's first norm), so each projection, by its name in the layer,
    writes into one buffer shared across the layers (CPU kernels)."""
    shared: dict[str, kernels.OutputBuffer] = {}
    for layer in layers:
        for role, m in layer.named_modules():
            if isinstance(m, _Matmul):
                m.output_buffer = shared.setdefault(role, kernels.OutputBuffer())
