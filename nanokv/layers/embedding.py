"""Token embedding and LM head (optionally tied to the embedding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, dim]
        return F.embedding(ids, self.weight)


class LMHead(nn.Module):
    def __init__(self, vocab_size: int, dim: int, tied_to: Embedding | None = None):
        super().__init__()
        if tied_to is not None:
            self.weight = tied_to.weight  # the same Parameter: loaded once, stored once
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, dim), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, dim] -> [N, vocab] fp32
        return F.linear(hidden, self.weight).float()
