"""SamplingParams: how one request is decoded (vLLM's names, defaults and meanings)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

# Below this temperature a request is greedy (vLLM's _SAMPLING_EPS): logits divided by a
# tinier one overflow to inf and the softmax to NaN.
SAMPLING_EPS = 1e-5
_MAX_INT = 2**31 - 1  # counts and token ids beyond this are no real request: say so early
MAX_N = 1024  # samples per request: each holds its own copy of the prompt's token ids
# What one request may list. A request's lists are built into per-request structures once
# (the min_tokens ban list, the stop-string automaton) and a step's work does not grow with
# them, but their size is still the request's memory and setup time: bounded, with room to spare.
MAX_STOP_STRINGS = 256  # strings in stop
MAX_STOP_STRING_CHARS = 256  # characters in one stop string (streaming holds back up to this - 1)
MAX_STOP_TOKEN_IDS = 1024  # ids in stop_token_ids
# repetition_penalty divides or multiplies logits: within [1/100, 100] any finite float32
# logit below 3e36 in magnitude stays finite (1e-40, a float32 subnormal, made them inf)
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100
MAX_ADDITIVE_PENALTY = 2  # |presence_penalty|, |frequency_penalty| (OpenAI's and vLLM's range)


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
    repetition_penalty (>1 discourages tokens of the prompt or output; 1: off; in
    [MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY]), presence_penalty and
    frequency_penalty (subtracted per generated occurrence; 0: off; within
    +-MAX_ADDITIVE_PENALTY).
    Numbers and flags may be Python or numpy scalars (kept as int / float / bool); ints
    must be integral types (no bools, no floats), lists are bounded by the MAX_* constants above.
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
        self.n = _int("n", self.n, 1, MAX_N)
        self.temperature = _number("temperature", self.temperature, 0, None, "0 means greedy")
        self.top_p = _number("top_p", self.top_p, 0, 1, low_open=True)
        self.top_k = _int("top_k", self.top_k, -1, _MAX_INT, "-1 or 0 means off")
        self.min_p = _number("min_p", self.min_p, 0, 1)
        if self.seed is not None:
            self.seed = _int("seed", self.seed, -(2**63), 2**64 - 1)
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens, 1, None)
        self.min_tokens = _int("min_tokens", self.min_tokens, 0, _MAX_INT)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        self.stop = _str_list("stop", self.stop, MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS)
        self.stop_token_ids = _int_list("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS)
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs, 0, _MAX_INT)
        self.repetition_penalty = _number("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY,
                                          MAX_REPETITION_PENALTY, "1 means off")
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, _number(name, getattr(self, name), -MAX_ADDITIVE_PENALTY, MAX_ADDITIVE_PENALTY,
                                        "0 means off"))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            setattr(self, name, _bool(name, getattr(self, name)))

    @property
    def greedy(self) -> bool:
        """Temperatures below SAMPLING_EPS are greedy: dividing logits by them overflows."""
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1 or self.presence_penalty != 0
                or self.frequency_penalty != 0)


def _bool(name: str, value) -> bool:
    """value as a bool: True / False or a numpy bool, never an int."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0
                                   and getattr(value, "dtype", None) == bool):
        return bool(value)
    raise ValueError(f"{name} must be True or False, got {value!r}")


def _int(name: str, value, low: int | None, high: int | None, hint: str = "") -> int:
    """value as an int in [low, high]: an int or a numpy integer, never a bool or a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an int {bounds}, got {value}" + (f" ({hint})" if hint else ""))
    return value


def _number(name: str, value, low: float | None, high: float | None, hint: str = "",
            low_open: bool = False) -> float:
    """value as a finite float in [low, high] ((low, high] with low_open): an int, a float
    or a numpy scalar, never a bool."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond float's range
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if (low is not None and (number < low or (low_open and number == low))) or (high is not None and number > high):
        left = "(" if low_open else "["
        bounds = f"in {left}{low}, {high}]" if high is not None else (f"> {low}" if low_open else f">= {low}")
        raise ValueError(f"{name} must be {bounds}, got {value}" + (f" ({hint})" if hint else ""))
    return number


def _str_list(name: str, value, max_count: int, max_chars: int) -> list[str]:
    """None, one string or a list of at most max_count non-empty strings of at most
    max_chars characters -> a list."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"{name} must be a non-empty string or a list of them, got {type(value).__name__}")
    if len(items) > max_count:
        raise ValueError(f"{name} has {len(items)} strings; at most {max_count} are allowed, send fewer")
    for s in items:
        if not isinstance(s, str) or not s:
            raise ValueError(f"{name} must be a non-empty string or a list of them, got an item {s!r:.80}")
        if len(s) > max_chars:
            raise ValueError(f"{name} has a string of {len(s)} characters; at most {max_chars} are allowed, "
                             "shorten it")
    return list(items)


def _int_list(name: str, value, max_count: int) -> list[int]:
    """None or a list (or 1-D numpy / torch array) of at most max_count token ids (ints
    >= 0) -> a list of ints."""
    if value is None:
        return []
    if hasattr(value, "tolist") and getattr(value, "ndim", None) == 1:
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids, got {type(value).__name__}")
    if len(value) > max_count:
        raise ValueError(f"{name} has {len(value)} ids; at most {max_count} are allowed, send fewer")
    return [_int(f"each of {name}", t, 0, _MAX_INT) for t in value]
