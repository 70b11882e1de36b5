"""Token embedding and LM head, vocab-parallel: each rank holds a slice of the vocabulary
rows (the LM head may share the embedding's)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from nanokv.distributed import TP
from nanokv import kernels
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


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, tp: TP):
        super().__init__()
        self.tp = tp
        self.weight, self.start = vocab_parallel_param(vocab_size, dim, tp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, dim]
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(torch.where(mine, local, torch.zeros_like(local)), self.weight)
        return self.tp.all_reduce(x * mine[:, None].to(x.dtype))


class LMHead(_Matmul):
    """Logits for this rank's vocabulary slice; the runner gathers them on rank 0."""

    def __init__(self, vocab_size: int, dim: int, tp: TP, tied_to: VocabParallelEmbedding | None = None):
        super().__init__()
        self.tied = tied_to is not None
        if self.tied:
            self.weight = tied_to.weight  # the same Parameter: loaded once, stored once
        else:
            self.weight, _ = vocab_parallel_param(vocab_size, dim, tp)

    def prepare_cpu(self, choice):
        """Packed in the LM head's own format (choice.lm_head: float32, bfloat16 or int8)."""
        if not self.tied:
            return super().prepare_cpu(dataclasses.replace(choice, weights=choice.lm_head))
        # the embedding still needs its rows: the packed panels are a second copy
        self.packed = kernels.pack_weight(self.weight.data, choice.lm_head)
        self.out_features = self.weight.shape[0]
        return self.forward_cpu

    def forward_native(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, dim] -> [N, vocab / tp] fp32
        return F.linear(hidden, self.weight).float()

    def forward_cpu(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._gemm(hidden).float()
