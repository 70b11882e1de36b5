"""SamplingParams: how one request is decoded (vLLM's names, defaults and meanings)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Per-request decoding settings.

    temperature: 0 means greedy (argmax).
    top_k: keep the k most likely tokens (-1 or 0: off). top_p: keep the smallest set
        whose probability reaches top_p (1: off). min_p: drop tokens below min_p times
        the top probability (0: off). All three apply after temperature.
    seed: per-request seed; the same seed gives the same tokens whatever else runs.
    max_tokens: generated-token limit (None: up to max_model_len), clamped so prompt +
        output fits max_model_len (the request then ends with finish_reason "length").
    min_tokens: EOS, stop_token_ids and stop strings are ignored before this many tokens.
    stop: strings that end generation; the text is cut before them unless
        include_stop_str_in_output. stop_token_ids: tokens that end generation (kept).
    logprobs: return the sampled token's logprob and the top-N per generated token,
        from the distribution after penalties and before temperature and top-k/p.
    n: independent samples of the prompt, sharing its KV blocks.
    repetition_penalty (>1 discourages tokens of the prompt or output; 1: off),
    presence_penalty and frequency_penalty (subtracted per generated occurrence; 0: off).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = field(default_factory=list)
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        _int("n", self.n, 1)
        _number("temperature", self.temperature, 0, None, "0 means greedy")
        _number("top_p", self.top_p, 0, 1)
        if self.top_p == 0:
            raise ValueError("top_p must be in (0, 1], got 0")
        _int("top_k", self.top_k, -1)
        _number("min_p", self.min_p, 0, 1)
        if self.seed is not None:
            _int("seed", self.seed, None)
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, 1)
        _int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        for t in self.stop_token_ids:
            _int("each of stop_token_ids", t, 0)
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0)
        _number("repetition_penalty", self.repetition_penalty, 0, None)
        if self.repetition_penalty == 0:
            raise ValueError("repetition_penalty must be > 0 (1 means off)")
        _number("presence_penalty", self.presence_penalty, -2, 2)
        _number("frequency_penalty", self.frequency_penalty, -2, 2)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1 or self.presence_penalty != 0
                or self.frequency_penalty != 0)


def _int(name: str, value, minimum: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _number(name: str, value, low: float | None, high: float | None, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bounds}, got {value}" + (f" ({hint})" if hint else ""))
