"""Batched sampling: every option is a tensor op over the whole batch with per-row values.

Order (vLLM's): min_tokens mask -> penalties -> [logprobs taken here] -> greedy argmax,
or temperature -> top-k -> top-p -> min-p -> draw. Greedy rows take the argmax of the
penalised logits and are exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio increment: spreads (seed, step) pairs


@dataclass
class SamplingTensors:
    """Per-row sampling settings for the N sampled rows of a step (built by the runner)."""

    temperatures: torch.Tensor  # [N] float32, 0 = greedy
    all_greedy: bool
    top_k: torch.Tensor | None = None  # [N] int64, vocab size where off
    top_p: torch.Tensor | None = None  # [N] float32, 1 where off
    min_p: torch.Tensor | None = None  # [N] float32, 0 where off
    # penalties: only when some row asks for them
    repetition: torch.Tensor | None = None  # [N] float32
    presence: torch.Tensor | None = None  # [N] float32
    frequency: torch.Tensor | None = None  # [N] float32
    output_counts: torch.Tensor | None = None  # [N, V] generated-token counts
    seen_mask: torch.Tensor | None = None  # [N, V] bool: in prompt or output
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) masked (min_tokens)
    seeded: list[tuple[int, int]] | None = None  # (row, seed for this token) for seeded rows
    max_logprobs: int | None = None  # largest top-N asked for, None when no row asks


@dataclass
class SamplerOutput:
    tokens: torch.Tensor  # [N] int64
    logprobs: torch.Tensor | None = None  # [N] logprob of the sampled token
    ranks: torch.Tensor | None = None  # [N] 1-based rank of the sampled token
    top_ids: torch.Tensor | None = None  # [N, max_logprobs]
    top_logprobs: torch.Tensor | None = None  # [N, max_logprobs]


def seed_for_token(seed: int, index: int) -> int:
    """The generator seed of a seeded request's index-th token: independent of the batch,
    of its position in it and of preemption."""
    return (seed * _SEED_MIX + index * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


class Sampler:
    def __call__(self, logits: torch.Tensor, t: SamplingTensors,
                 generator: torch.Generator | None = None) -> SamplerOutput:
        logits = logits.float()  # [N, V]
        if t.banned is not None:
            logits[t.banned] = float("-inf")
        if t.repetition is not None:
            logits = apply_penalties(logits, t)
        logprobs = torch.log_softmax(logits, dim=-1) if t.max_logprobs is not None else None
        greedy = logits.argmax(dim=-1)
        tokens = greedy if t.all_greedy else self._draw(logits, t, greedy, generator)
        out = SamplerOutput(tokens)
        if logprobs is not None:
            out.logprobs = logprobs.gather(1, tokens[:, None]).squeeze(1)
            out.ranks = (logprobs > out.logprobs[:, None]).sum(dim=-1) + 1
            if t.max_logprobs > 0:
                out.top_logprobs, out.top_ids = logprobs.topk(t.max_logprobs, dim=-1)
        return out

    def _draw(self, logits, t: SamplingTensors, greedy, generator) -> torch.Tensor:
        is_greedy = t.temperatures == 0
        temps = torch.where(is_greedy, torch.ones_like(t.temperatures), t.temperatures)
        logits = logits / temps[:, None]
        if t.top_k is not None or t.top_p is not None:
            logits = apply_top_k_top_p(logits, t.top_k, t.top_p)
        probs = torch.softmax(logits, dim=-1)
        if t.min_p is not None:
            keep = probs >= t.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = torch.where(keep, probs, torch.zeros_like(probs))
        # Gumbel-max in exponential form: argmax(p / E), E ~ Exp(1), draws from p.
        noise = torch.empty_like(probs).exponential_(generator=generator)
        for row, seed in t.seeded or ():
            g = torch.Generator(device=probs.device).manual_seed(seed)
            noise[row].exponential_(generator=g)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(is_greedy, greedy, sampled)


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """vLLM's definitions: repetition divides positive / multiplies negative logits of
    tokens seen in the prompt or output; frequency and presence subtract per generated
    occurrence / once per generated token."""
    rep = t.repetition[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(t.seen_mask, penalised, logits)
    logits = logits - t.frequency[:, None] * t.output_counts
    return logits - t.presence[:, None] * (t.output_counts > 0).to(logits.dtype)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    if top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        drop = (before >= top_p[:, None]) & (top_p[:, None] < 1)  # rounding must not cut p=1 rows
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
