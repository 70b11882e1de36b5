"""Prompt forms, vLLM's names: a prompt is a str, a list of token ids, a TextPrompt or a
TokensPrompt. The two TypedDicts are plain dicts, which the engine reads."""

from __future__ import annotations

from typing import TypedDict, Union

from nanokv.unsupported import missing


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the engine."""

    prompt: str


class _TokenIds(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokenIds, total=False):
    """A prompt as token ids; its text (prompt) is optional and only reported back."""

    prompt: str


PromptType = Union[str, list[int], TextPrompt, TokensPrompt]


def __getattr__(name: str):
    raise missing(__name__, name)
