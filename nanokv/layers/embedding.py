"""Token embedding and LM head, vocab-parallel: each rank holds a slice of the vocabulary
rows (the LM head may share the embedding's)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from nanokv.distributed import TP
import nanokv.kernels as kernels
from nanokv.layers.custom_op import CustomOp
from nanokv.layers.linear import _Matmul, _check_shape


def vocab_parallel_param(vocab_size: int, dim: int, tp: TP) -> tuple[nn.Parameter, int]:
    """This rank's [vocab / tp, dim] rows and their first id; the loader reads only those."""
    start, per_rank = tp.split(vocab_size)
    param = nn.Parameter(torch.empty(per_rank, dim), requires_grad=False)

    def load(p: nn.Parameter, loaded, shard_id=None) -> None:
        _check_shape(getattr(p, "nanokv_name", "a parameter"), (vocab_size, dim), loaded.get_shape())
        p.data.copy_(loaded[start:start + per_rank])

    param.weight_loader = load
    return param, start


class VocabParallelEmbedding(CustomOp):
    """Token embeddings. On the CPU kernels, a tied one reads its rows from the LM head's
    packed copy (read_packed_rows), so the matrix is stored once (in the head's format)."""

    packed: kernels.PackedWeight | None = None  # the tied LM head's packed matrix, in place of weight

    def __init__(self, vocab_size: int, dim: int, tp: TP):
        super().__init__()
        self.tp = tp
        self.weight, self.start = vocab_parallel_param(vocab_size, dim, tp)
        self.rows = self.weight.shape[0]

    def forward_native(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, dim]
        return self._vocab_parallel(ids, lambda local: F.embedding(local, self.weight))

    def forward_cpu(self, ids: torch.Tensor) -> torch.Tensor:
        return self._vocab_parallel(ids, lambda local: kernels.embed(local, self.packed))

    def prepare_cpu(self, choice):
        # the tied LM head, prepared first, handed over its packed matrix
        return self.forward_cpu if self.packed is not None else self.forward_native

    def read_packed_rows(self, packed: kernels.PackedWeight) -> None:
        """Look rows up in `packed` (this rank's vocabulary rows) and drop the weight."""
        assert packed.n == self.rows
        self.packed, self.weight = packed, None

    def _vocab_parallel(self, ids: torch.Tensor, lookup) -> torch.Tensor:
        if self.tp.size == 1:
            return lookup(ids)
        local = ids - self.start
        mine = (local >= 0) & (local < self.rows)
        x = lookup(torch.where(mine, local, torch.zeros_like(local)))
        return self.tp.all_reduce(x * mine[:, None].to(x.dtype))


class LMHead(_Matmul):
    """Logits for this rank's vocabulary slice; the runner gathers them on rank 0."""

    def __init__(self, vocab_size: int, dim: int, tp: TP, tied_to: VocabParallelEmbedding | None = None):
        super().__init__()
        object.__setattr__(self, "tied_to", tied_to)  # a reference, not a submodule: it has its own place
        self.tied = tied_to is not None
        if self.tied:
            self.weight = tied_to.weight  # the same Parameter: loaded once, stored once
        else:
            self.weight, _ = vocab_parallel_param(vocab_size, dim, tp)

    def prepare_cpu(self, choice):
        """Packed in the LM head's own format (choice.lm_head: float32, bfloat16 or int8)."""
        forward = super().prepare_cpu(dataclasses.replace(choice, weights=choice.lm_head))
        if self.tied:  # one copy: the embedding looks its rows up in the packed panels
            self.tied_to.read_packed_rows(self.packed)
        return forward

    def forward_native(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, dim] -> [N, vocab / tp] fp32
        return F.linear(hidden, self.weight).float()

    def forward_cpu(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._gemm(hidden).float()
