"""Incremental detokenization: text deltas as tokens arrive, without re-decoding the
whole sequence each step."""

from __future__ import annotations


def decode_options(spaces_between_special_tokens: bool) -> dict:
    """tokenizer.decode's keyword for SamplingParams.spaces_between_special_tokens: only
    when it is off (the default needs none; fast tokenizers ignore it)."""
    return {} if spaces_between_special_tokens else {"spaces_between_special_tokens": False}


class IncrementalDetokenizer:
    """Decodes a short window of the newest tokens each step.

    Text is emitted only up to the last complete character: a token that ends in the
    middle of a multi-byte character (decoded as U+FFFD) waits for the next one.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.options = decode_options(spaces_between_special_tokens)
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # window start: context for the tokenizer's spacing rules
        self.read_offset = 0  # tokens before this are already in self.text
        self.text = ""

    def add(self, new_token_ids: list[int]) -> str:
        """Append tokens; returns the newly completed text (possibly "")."""
        self.token_ids.extend(new_token_ids)
        decode = self.tokenizer.decode
        ids, skip, options = self.token_ids, self.skip_special_tokens, self.options
        prefix = decode(ids[self.prefix_offset:self.read_offset], skip_special_tokens=skip, **options)
        full = decode(ids[self.prefix_offset:], skip_special_tokens=skip, **options)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        self.text += delta
        return delta
