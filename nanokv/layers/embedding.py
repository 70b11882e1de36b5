"""Token embedding and LM head, vocab-parallel: each rank holds a slice of the vocabulary
rows (the LM head may share the embedding's)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanokv.distributed import TP
from nanokv.layers.linear import _check_shape


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, tp: TP):
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.start, per_rank = tp.split(vocab_size)
        self.weight = nn.Parameter(torch.empty(per_rank, dim), requires_grad=False)
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        _check_shape(getattr(param, "nanokv_name", "a parameter"), (self.vocab_size, param.shape[1]),
                     loaded.get_shape())
        param.data.copy_(loaded[self.start:self.start + param.shape[0]])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, dim]
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(torch.where(mine, local, torch.zeros_like(local)), self.weight)
        return self.tp.all_reduce(x * mine[:, None].to(x.dtype))


class LMHead(nn.Module):
    """Logits for this rank's vocabulary slice; the runner gathers them on rank 0."""

    def __init__(self, vocab_size: int, dim: int, tp: TP, tied_to: VocabParallelEmbedding | None = None):
        super().__init__()
        if tied_to is not None:
            self.weight = tied_to.weight  # the same Parameter: loaded once, stored once
        else:
            self.start, per_rank = tp.split(vocab_size)
            self.vocab_size = vocab_size
            self.weight = nn.Parameter(torch.empty(per_rank, dim), requires_grad=False)
            self.weight.weight_loader = VocabParallelEmbedding._load.__get__(self)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, dim] -> [N, vocab / tp] fp32
        return F.linear(hidden, self.weight).float()
