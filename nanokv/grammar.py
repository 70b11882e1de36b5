"""Structured outputs: llguidance grammars as per-sequence token masks (torch-free).

A request's StructuredOutputsParams compiles once per spec (GrammarCompiler, cached by the
spec's canonical JSON) when the request is made, in the caller's thread, so a bad schema,
regex or grammar is a ValueError before any work starts. Each sequence then holds its own
llguidance matcher (GrammarConstraint) that the runner asks for a mask row per step, as it
asks a TokenConstraint (nanokv/constraints.py).
"""

from __future__ import annotations

import json
import threading
from array import array

from nanokv.constraints import TokenConstraint, mask_words
from nanokv.sampling_params import StructuredOutputsParams

MAX_CACHED_GRAMMARS = 256  # compiled specs kept per engine (the oldest goes first)
# Bounds a JSON grammar adds where the schema gives none (closed()), so that a sampled small
# model cannot write one value forever (an endless string or number, a growing list): strings
# (without maxLength, enum, const or format) at most this many characters, lists at most
# this many items, integers within JSON's safe range. Outputs stay valid against the schema.
MAX_STRING_CHARS = 256
MAX_ARRAY_ITEMS = 8
MAX_SAFE_INTEGER = 2**53 - 1
# String formats llguidance writes; another (OpenAPI's password, byte, binary, ...) is an
# annotation the grammar drops, as JSON Schema reads an unknown format
GRAMMAR_FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
                             "uuid"})
_VALUES = ("enum", "const", "default", "examples")  # schema keywords whose values are data, not schemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema


def closed(schema):
    """The schema narrowed for a grammar, every output still valid against it:
    additionalProperties false on each object that lists properties and leaves it unset
    (OpenAI's strict mode: the grammar writes the listed keys only, instead of inventing
    keys until max_tokens), and the MAX_STRING_CHARS / MAX_ARRAY_ITEMS / MAX_SAFE_INTEGER
    bounds where the schema sets none."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _VALUES else {name: closed(s) for name, s in v.items()}
           if k in _SCHEMA_MAPS and isinstance(v, dict) else closed(v) for k, v in schema.items()}
    kind = schema.get("type")
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema \
            and kind in (None, "object"):
        out["additionalProperties"] = False
    if kind == "string":
        if out.get("format") not in GRAMMAR_FORMATS:
            out.pop("format", None)
        if not any(k in out for k in ("maxLength", "enum", "const", "format")):
            out["maxLength"] = max(MAX_STRING_CHARS, schema.get("minLength", 0))
    elif kind == "array" and "maxItems" not in schema:
        out["maxItems"] = max(MAX_ARRAY_ITEMS, schema.get("minItems", 0))
    elif kind == "integer":
        if "maximum" not in schema and "exclusiveMaximum" not in schema:
            out["maximum"] = MAX_SAFE_INTEGER
        if "minimum" not in schema and "exclusiveMinimum" not in schema:
            out["minimum"] = -MAX_SAFE_INTEGER
    return out


def _grammar_text(spec: StructuredOutputsParams) -> str:
    """The spec as an llguidance grammar (not yet validated)."""
    from llguidance import LLMatcher, grammar_from

    if spec.json is not None or spec.json_object:
        schema = spec.json if spec.json is not None else {"type": "object"}
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(schema).__name__}")
        schema = closed(schema)
        defaults = {"whitespace_flexible": spec.disable_any_whitespace is False}  # None: compact
        overrides = {"whitespace_pattern": spec.whitespace_pattern} if spec.whitespace_pattern else None
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=defaults, overrides=overrides)
        except (ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs.json: {e}") from None
    if spec.regex is not None:
        return LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    try:
        return grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise ValueError(f"structured_outputs.grammar: {e}") from None


def _kind(spec: StructuredOutputsParams) -> str:
    return next(k for k in ("json", "json_object", "regex", "choice", "grammar") if getattr(spec, k))


class GrammarCompiler:
    """One engine's llguidance tokenizer (built on first use: about a second for a big
    vocabulary) and its compiled grammars, keyed by spec."""

    def __init__(self, tokenizer, vocab: int, eos_token_ids: list[int]):
        self._hf = tokenizer
        self.vocab = vocab
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer = None
        self._cache: dict[str, str] = {}
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            with self._lock:
                if self._tokenizer is None:
                    self._tokenizer = self._build_tokenizer()
        return self._tokenizer

    def _build_tokenizer(self):
        if self._hf is None:
            raise ValueError("structured_outputs needs a tokenizer (the engine has none)")
        if not self.eos_token_ids:
            raise ValueError("structured_outputs needs an EOS token to end the output; the model has none")
        try:
            import llguidance.hf
        except ImportError:
            raise ValueError("structured_outputs needs the llguidance package: pip install llguidance") from None
        try:
            return llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab, eos_token=self.eos_token_ids)
        except ValueError as e:
            raise ValueError(f"structured_outputs cannot use this tokenizer: {e}") from None

    def compile(self, spec: StructuredOutputsParams) -> str:
        """The spec's validated grammar (cached); ValueError naming what is wrong."""
        key = spec.key()
        grammar = self._cache.get(key)
        if grammar is not None:
            return grammar
        from llguidance import LLMatcher

        text = _grammar_text(spec)
        error = LLMatcher.validate_grammar(text, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"structured_outputs.{_kind(spec)} is not usable: {error}")
        with self._lock:
            if len(self._cache) >= MAX_CACHED_GRAMMARS:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = text
        return text

    def constraint(self, grammar: str, base: TokenConstraint | None) -> "GrammarConstraint":
        """A new sequence's mask source for a compiled grammar."""
        from llguidance import LLMatcher

        return GrammarConstraint(LLMatcher(self.tokenizer, grammar, log_level=0), self.vocab,
                                 self.eos_token_ids, base)


class GrammarConstraint:
    """One sequence's grammar state: an llguidance matcher advanced lazily in row() by the
    tokens generated since the last call (so preemption and recompute need nothing), rolled
    back when the output got shorter. base: the request's allowed_token_ids / bad_words,
    ANDed into the grammar's words. When the grammar is complete only EOS is allowed, which
    ends the sequence (with ignore_eos it keeps producing EOS up to max_tokens)."""

    __slots__ = ("matcher", "vocab", "words", "base", "consumed", "_eos_row")

    def __init__(self, matcher, vocab: int, eos_token_ids: list[int], base: TokenConstraint | None = None):
        self.matcher = matcher
        self.vocab = vocab
        self.words = mask_words(vocab)
        self.base = base
        self.consumed = 0  # generated tokens the matcher has seen
        eos = array("I", bytes(4 * self.words))
        for t in eos_token_ids:
            eos[t >> 5] |= 1 << (t & 31)
        self._eos_row = eos

    def advance(self, token_ids: list[int], num_prompt_tokens: int) -> bool:
        """Move the matcher to the sequence's generated tokens (consume the new ones, roll
        back what the output lost); False when it is in error (its row is then EOS only)."""
        m = self.matcher
        generated = len(token_ids) - num_prompt_tokens
        if generated < self.consumed:
            m.rollback(self.consumed - generated)
            self.consumed = generated
        while self.consumed < generated and not m.is_error():
            m.consume_token(token_ids[num_prompt_tokens + self.consumed])
            self.consumed += 1
        if m.is_error():  # a token outside the grammar (cannot happen through the mask): end it
            self.consumed = generated
            return False
        return True

    def finish(self, out, token_ids: list[int], num_prompt_tokens: int) -> None:
        """The base constraint ANDed into out (the grammar's words, written in place: an
        array or a numpy row of 32-bit words); EOS only where the two leave nothing."""
        if self.base is None:
            return
        import numpy as np

        words = np.frombuffer(out, dtype=np.uint32) if isinstance(out, array) else out.view(np.uint32)
        np.bitwise_and(words, np.frombuffer(self.base.row(token_ids, num_prompt_tokens), dtype=np.uint32), out=words)
        if not words.any():  # the two constraints leave nothing: end the sequence
            words[:] = np.frombuffer(self._eos_row, dtype=np.uint32)

    def row(self, token_ids: list[int], num_prompt_tokens: int) -> array:
        if not self.advance(token_ids, num_prompt_tokens):
            return self._eos_row
        out = array("I", bytes(4 * self.words))
        self.matcher.unsafe_compute_mask_ptr(out.buffer_info()[0], 4 * self.words)
        self.finish(out, token_ids, num_prompt_tokens)
        return out


def _as_words(row: array, like):
    """row's words as the numpy dtype of like (int32 words hold the same bits)."""
    import numpy as np

    return np.frombuffer(row, dtype=np.uint32).view(like.dtype)


def fill_masks(rows: list, out) -> None:
    """Each row's words into out ([len(rows), words] C-contiguous int32 numpy): rows are
    (constraint, token_ids, num_prompt_tokens). A grammar row's matcher advances, computes
    its mask straight into its row of out (outside the GIL) and takes its base constraint;
    the other rows copy their words. One row after another: llguidance's thread pool
    (LLExecutor) measured slower on two cores, and the runner overlaps this with the
    forward instead (runner/model_runner.py's _start_masks)."""
    nbytes = 4 * out.shape[1]
    for k, (c, token_ids, num_prompt) in enumerate(rows):
        if isinstance(c, GrammarConstraint) and c.advance(token_ids, num_prompt):
            c.matcher.unsafe_compute_mask_ptr(out[k].ctypes.data, nbytes)
            c.finish(out[k], token_ids, num_prompt)
        else:
            out[k] = _as_words(c.row(token_ids, num_prompt), out)
