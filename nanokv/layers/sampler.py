"""Batched sampling: greedy rows take the argmax, the others sample softmax(logits / T)."""

from __future__ import annotations

import torch


class Sampler:
    def __call__(self, logits: torch.Tensor, temperatures: torch.Tensor, all_greedy: bool,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        # logits [N, V] float32; temperatures [N] (0 = greedy) -> tokens [N] int64
        greedy = logits.argmax(dim=-1)
        if all_greedy:
            return greedy
        t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
        probs = torch.softmax(logits / t[:, None], dim=-1)
        # Gumbel-max in exponential form: argmax(p / E), E ~ Exp(1), draws from p.
        noise = torch.empty_like(probs).exponential_(generator=generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(temperatures > 0, sampled, greedy)
