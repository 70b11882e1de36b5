"""SamplingParams: how one request is decoded (vLLM's names, defaults and meanings)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Below this temperature a request is greedy (vLLM's _SAMPLING_EPS): logits divided by a
# tinier one overflow to inf and the softmax to NaN.
SAMPLING_EPS = 1e-5
_MAX_INT = 2**31 - 1  # counts and token ids beyond this are no real request: say so early
MAX_N = 1024  # samples per request: each holds its own copy of the prompt's token ids


@dataclass
class SamplingParams:
    """Per-request decoding settings.

    temperature: 0 (or below SAMPLING_EPS) means greedy (argmax).
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
        _int("n", self.n, 1, MAX_N)
        _number("temperature", self.temperature, 0, None, "0 means greedy")
        _number("top_p", self.top_p, 0, 1, low_open=True)
        _int("top_k", self.top_k, -1, _MAX_INT, "-1 or 0 means off")
        _number("min_p", self.min_p, 0, 1)
        if self.seed is not None:
            _int("seed", self.seed, -(2**63), 2**64 - 1)
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, 1, None)
        _int("min_tokens", self.min_tokens, 0, _MAX_INT)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        self.stop = _str_list("stop", self.stop)
        self.stop_token_ids = _int_list("stop_token_ids", self.stop_token_ids)
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0, _MAX_INT)
        _number("repetition_penalty", self.repetition_penalty, 0, None, "1 means off", low_open=True)
        _number("presence_penalty", self.presence_penalty, -2, 2)
        _number("frequency_penalty", self.frequency_penalty, -2, 2)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        """Temperatures below SAMPLING_EPS are greedy: dividing logits by them overflows."""
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1 or self.presence_penalty != 0
                or self.frequency_penalty != 0)


def _int(name: str, value, low: int | None, high: int | None, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an int {bounds}, got {value}" + (f" ({hint})" if hint else ""))


def _number(name: str, value, low: float | None, high: float | None, hint: str = "",
            low_open: bool = False) -> None:
    """A finite int or float in [low, high] ((low, high] with low_open)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if (low is not None and (value < low or (low_open and value == low))) or (high is not None and value > high):
        left = "(" if low_open else "["
        bounds = f"in {left}{low}, {high}]" if high is not None else (f"> {low}" if low_open else f">= {low}")
        raise ValueError(f"{name} must be {bounds}, got {value}" + (f" ({hint})" if hint else ""))


def _str_list(name: str, value) -> list[str]:
    """None, one string or a list of non-empty strings -> a list."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
        raise ValueError(f"{name} must be a non-empty string or a list of them, got {value!r}")
    return list(items)


def _int_list(name: str, value) -> list[int]:
    """None or a list of token ids (ints >= 0) -> a list."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids, got {value!r}")
    for t in value:
        _int(f"each of {name}", t, 0, _MAX_INT)
    return list(value)
