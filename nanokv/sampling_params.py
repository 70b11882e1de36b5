"""SamplingParams: how one request is decoded (vLLM's names, defaults and meanings)."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import enum
import functools
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from nanokv.unsupported import BEAM_SEARCH, missing

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
MAX_LOGIT_BIAS = 100  # |a logit_bias value| (OpenAI's range)
MAX_LOGIT_BIAS_ENTRIES = 1024  # token ids in logit_bias
MAX_ALLOWED_TOKEN_IDS = 1 << 20  # ids in allowed_token_ids (more than any vocabulary has)
MAX_BAD_WORDS = 256  # strings in bad_words
MAX_BAD_WORD_CHARS = 256  # characters in one bad word


class RequestOutputKind(enum.Enum):
    """What a request's outputs hold (vLLM's enum, same values)."""

    CUMULATIVE = 0  # the whole output so far, each step that moves the request
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # one output, when the request finishes


# vLLM's SamplingParams fields nanokv does not implement yet -> what they are: None (off)
# is accepted, anything else refused by name (not reported as an unknown field).
_NOT_YET = {
    "logits_processors": "custom logits processors",
}
MAX_CHOICES = 1024  # strings in StructuredOutputsParams.choice
MAX_SPEC_CHARS = 1 << 20  # characters of one schema, regex or grammar (compiled at make_request)
_SPEC_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """A grammar the output must match (vLLM's class and field names); exactly one of:

    json: a JSON schema (a dict or its JSON text); the output is one JSON value valid against it.
    json_object=True: any JSON object. regex: the whole output matches it (Rust regex syntax).
    choice: the output is one of these strings. grammar: a Lark or GBNF grammar.
    whitespace_pattern: for json / json_object, a regex for the whitespace allowed between
        tokens. disable_any_whitespace: True none at all, False JSON's whitespace, None (the
        default) none unless whitespace_pattern is given: a sampled model free to write
        whitespace can repeat it until max_tokens, and its output is then no JSON.
    Compiled by llguidance when the request is made; a bad spec raises ValueError then."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in _SPEC_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                             f"got {', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or a JSON string), "
                             f"got {type(self.json).__name__}")
        if self.json_object is not None and self.json_object is not True and self.json_object is not False:
            raise ValueError(f"structured_outputs.json_object must be True or False, got {self.json_object!r}")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r:.80}")
        if self.choice is not None:
            self.choice = _str_list("structured_outputs.choice", self.choice, MAX_CHOICES, MAX_SPEC_CHARS)
            if not self.choice:
                raise ValueError("structured_outputs.choice is empty; give at least one string")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if isinstance(value, str) and len(value) > MAX_SPEC_CHARS:
                raise ValueError(f"structured_outputs.{name} has {len(value)} characters; at most "
                                 f"{MAX_SPEC_CHARS} are allowed")
        if self.disable_any_whitespace is not None:
            self.disable_any_whitespace = _bool("structured_outputs.disable_any_whitespace",
                                                self.disable_any_whitespace)

    @classmethod
    def of(cls, value, name: str = "structured_outputs") -> "StructuredOutputsParams":
        """value as a StructuredOutputsParams: one already, or a dict of its fields (JSON input)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{name} must be a StructuredOutputsParams or a dict of its fields "
                             f"(json, json_object, regex, choice, grammar), got {type(value).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in value if k not in fields and value[k] is not None]
        if unknown:
            raise ValueError(f"{name} has no field {unknown[0]!r}; the fields are {', '.join(sorted(fields))}")
        return cls(**{k: v for k, v in value.items() if k in fields})

    @classmethod
    def from_response_format(cls, fmt) -> "StructuredOutputsParams | None":
        """OpenAI's response_format ({"type": "text" | "json_object" | "json_schema", ...}) as
        a spec; None for text (no constraint)."""
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(json_object=True)
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, str)):
                raise ValueError("response_format json_schema needs json_schema: {name, schema, strict}, with the "
                                 "schema an object")
            return cls(json=spec["schema"])
        shown = repr(fmt) if len(repr(fmt)) <= 80 else repr(fmt)[:77] + "..."
        raise ValueError(f"response_format must be an object with type text, json_object or json_schema, got "
                         f"{shown}")

    def key(self) -> str:
        """The spec as canonical JSON (the compiled-grammar cache's key)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name, same fields

# vLLM V0's beam-search fields and their "off" values
_BEAM_SEARCH_OFF = {"use_beam_search": (None, False), "length_penalty": (None, 1.0), "early_stopping": (None, False)}
# Fields where None is a value of its own; from_optional keeps None there.
_NONE_IS_A_VALUE = ("seed", "max_tokens", "stop", "stop_token_ids", "logprobs", "prompt_logprobs",
                    "truncate_prompt_tokens", "extra_args")


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
    logprobs=-1: the whole vocabulary (allowed when the engine's max_logprobs covers it).
    prompt_logprobs: per prompt token after the first, its logprob, rank and the top-N
        (0: the prompt token's alone; -1: the whole vocabulary, as logprobs) under the
        model's raw logits at the position before it (log_softmax before penalties and
        temperature, as vLLM). Bounded by max_logprobs. Such a request computes its whole
        prompt (no prefix-cache hits: cached positions have no logits).
    truncate_prompt_tokens: keep only the last k prompt tokens (-1: as many as
        max_model_len leaves room for, max_model_len - 1; None: no truncation).
    detokenize=False: no text (CompletionOutput.text is ""), token ids only; stop strings
        need text and are refused then.
    spaces_between_special_tokens: passed to the tokenizer's decode where it takes it.
    output_kind: what the step API (LLMEngine.add_request in vLLM's argument order) and
        AsyncLLM.generate return: CUMULATIVE (the default), DELTA or FINAL_ONLY.
        LLM.generate always returns final outputs.
    extra_args: a dict kept with the request for the caller's own use (nanokv reads none).
    allowed_token_ids: only these token ids may be generated (None: all).
    bad_words: words never generated: a word's last token is banned where the tokens
        before it were just generated (a one-token word: always), for the word as given
        and with a leading space (vLLM's rule).
    logit_bias: {token id: bias in [-100, 100]} added to the logits before penalties
        (OpenAI's semantics; ids may be decimal strings, as JSON keys are).
    structured_outputs: a StructuredOutputsParams (or a dict of its fields; vLLM's older
        guided_decoding=GuidedDecodingParams(...) is the same): the output matches its
        JSON schema, regex, choice or grammar; the sequence ends at EOS (finish_reason
        "stop") once the grammar is complete, or with "length" at max_tokens.
    Unknown field names raise ValueError naming the closest known one; vLLM fields that
    nanokv does not implement yet (prompt_logprobs, ...) raise ValueError
    naming them, unless None.
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
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict[str, Any] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

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
            self.logprobs = _int("logprobs", self.logprobs, -1, _MAX_INT, "-1 means the whole vocabulary")
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _int("prompt_logprobs", self.prompt_logprobs, -1, _MAX_INT,
                                        "-1 means the whole vocabulary")
        self.repetition_penalty = _number("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY,
                                          MAX_REPETITION_PENALTY, "1 means off")
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, _number(name, getattr(self, name), -MAX_ADDITIVE_PENALTY, MAX_ADDITIVE_PENALTY,
                                        "0 means off"))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize"):
            setattr(self, name, _bool(name, getattr(self, name)))
        if self.truncate_prompt_tokens is not None:
            self.truncate_prompt_tokens = _int("truncate_prompt_tokens", self.truncate_prompt_tokens, -1, _MAX_INT,
                                               "k >= 1 keeps the last k prompt tokens, -1 as many as fit")
            if self.truncate_prompt_tokens == 0:
                raise ValueError("truncate_prompt_tokens must be an int >= 1 or -1, got 0")
        if not self.detokenize and self.stop:
            raise ValueError("stop strings need detokenize=True (they are found in the text); set "
                             "detokenize=True, or use stop_token_ids")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY), "
                             f"got {self.output_kind!r}")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict or None, got {type(self.extra_args).__name__}")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _int_list("allowed_token_ids", self.allowed_token_ids, MAX_ALLOWED_TOKEN_IDS)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids is empty; give at least one token id, or None for all")
        if self.bad_words is not None:
            self.bad_words = _str_list("bad_words", self.bad_words, MAX_BAD_WORDS, MAX_BAD_WORD_CHARS) or None
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias) or None
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
            if self.min_tokens:  # EOS is banned below min_tokens, and it is all a complete grammar allows
                raise ValueError("min_tokens cannot be combined with structured_outputs (the grammar decides "
                                 "where the output ends); set min_tokens=0")

    @classmethod
    def from_optional(cls, **kwargs) -> "SamplingParams":
        """vLLM's constructor for optional values: a field given as None takes its default,
        except where None is a value of its own (max_tokens=None: up to max_model_len; seed,
        stop, stop_token_ids, logprobs, prompt_logprobs, truncate_prompt_tokens, extra_args)."""
        return cls(**{k: v for k, v in kwargs.items() if v is not None or k in _NONE_IS_A_VALUE})

    def clone(self) -> "SamplingParams":
        """A deep copy (stop lists and extra_args included)."""
        return copy.deepcopy(self)

    @property
    def greedy(self) -> bool:
        """Temperatures below SAMPLING_EPS are greedy: dividing logits by them overflows."""
        return self.temperature < SAMPLING_EPS

    @property
    def has_token_mask(self) -> bool:
        """allowed_token_ids, bad_words or structured_outputs: the request's rows carry a token mask."""
        return (self.allowed_token_ids is not None or self.bad_words is not None
                or self.structured_outputs is not None)

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1 or self.presence_penalty != 0
                or self.frequency_penalty != 0)


_dataclass_init = SamplingParams.__init__


@functools.wraps(_dataclass_init)
def _init(self, *args, **kwargs) -> None:
    # the dataclass __init__ raises a bare TypeError on an unknown keyword: say which field was meant
    _dataclass_init(self, *args, **_known_fields(len(args), kwargs))


SamplingParams.__init__ = _init


def _known_fields(num_positional: int, kwargs: dict) -> dict:
    """kwargs without vLLM's fields that are off (None); ValueError for a keyword that is
    no field: vLLM's not-yet-implemented ones by name, others with the closest field's name."""
    names = [f.name for f in dataclasses.fields(SamplingParams)]
    if num_positional > len(names):
        raise ValueError(f"SamplingParams takes at most {len(names)} positional arguments, got "
                         f"{num_positional}; pass fields by name")
    known = {}
    for key, value in kwargs.items():
        if key in names:
            known[key] = value
        elif key in _NOT_YET:
            if value is not None:
                raise ValueError(f"{key} is not supported yet by nanokv ({_NOT_YET[key]}); remove it")
        elif key == "guided_decoding":  # vLLM's older name for structured_outputs
            if value is not None:
                if kwargs.get("structured_outputs") is not None:
                    raise ValueError("give structured_outputs or guided_decoding, not both")
                known["structured_outputs"] = value
        elif key in _BEAM_SEARCH_OFF:  # vLLM V0's beam-search fields: accepted while off
            if value not in _BEAM_SEARCH_OFF[key]:
                raise ValueError(f"{key}={value!r}: {BEAM_SEARCH}")
        elif key == "best_of":  # vLLM V1 dropped it too
            if value is not None and value != kwargs.get("n", 1):
                raise ValueError(f"best_of={value!r} is not supported by nanokv (nor by vLLM V1); use n "
                                 "samples and pick among them")
        else:
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.75)
            hint = f"; did you mean {close[0]!r}?" if close else "; see help(SamplingParams) for the fields"
            raise ValueError(f"SamplingParams has no field {key!r}{hint}")
    return known


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


def _logit_bias(value) -> dict[int, float]:
    """{token id: bias}: ids as ints or decimal strings (JSON object keys), at most
    MAX_LOGIT_BIAS_ENTRIES, biases finite numbers within +-MAX_LOGIT_BIAS."""
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be an object mapping token ids to biases, got {type(value).__name__}")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"logit_bias has {len(value)} token ids; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed, "
                         "send fewer")
    out = {}
    for key, bias in value.items():
        if isinstance(key, str):
            if not key.strip().isdecimal():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r:.80}")
            key = int(key)
        out[_int("each logit_bias token id", key, 0, _MAX_INT)] = _number(
            f"logit_bias[{key}]", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    return out


def __getattr__(name: str):
    raise missing(__name__, name)
