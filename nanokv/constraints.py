"""Per-request token constraints as a packed bitmask (vLLM's contract, llguidance's layout).

A constrained row is (vocab + 31) // 32 uint32 words; bit i of word w allows token 32 * w + i.
The sampler sets every token whose bit is clear to -inf before penalties, temperature and
top-k/p (layers/sampler.py), so a constraint is one mechanism for allowed_token_ids,
bad_words and, later, grammars. This module is torch-free: the engine keeps a reference per
sequence, and the runner asks each constrained row for its words once per step.
"""

from __future__ import annotations

from array import array

WORD_BITS = 32
_ALL = 0xFFFFFFFF


def mask_words(vocab: int) -> int:
    """Words in one row of a vocabulary of `vocab` tokens."""
    return (vocab + WORD_BITS - 1) // WORD_BITS


def bad_words_token_ids(bad_words: list[str], tokenizer) -> list[list[int]]:
    """vLLM's tokenization of bad_words: each word as it is (its leading spaces dropped),
    and with one leading space where that gives a different first token and as many
    tokens (the word in the middle of a text)."""
    out: list[list[int]] = []
    for word in bad_words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if plain:
            out.append(list(plain))
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(list(spaced))
    return out


class TokenConstraint:
    """One request's allowed_token_ids and bad_words (vLLM's meanings), as a row per step.

    allowed: only these ids (None: every id). bad_ids: tokenized bad words; a word of one
    token is banned always, a longer one bans its last token when the tokens before it are
    the last ones generated (output tokens only, as vLLM's). Stateless across steps: the n
    samples of a request share one."""

    __slots__ = ("vocab", "words", "_base", "_multi")

    def __init__(self, vocab: int, allowed: list[int] | None = None, bad_ids: list[list[int]] = ()):
        self.vocab = vocab
        self.words = mask_words(vocab)
        if allowed is None:
            base = [_ALL] * self.words
            tail = vocab % WORD_BITS
            if tail:  # ids past the vocabulary: never allowed
                base[-1] = (1 << tail) - 1
        else:
            base = [0] * self.words
            for t in allowed:
                base[t >> 5] |= 1 << (t & 31)
        self._multi: list[tuple[tuple[int, ...], int]] = []  # (prefix, last token)
        for ids in bad_ids:
            if len(ids) == 1:
                base[ids[0] >> 5] &= ~(1 << (ids[0] & 31))
            else:
                self._multi.append((tuple(ids[:-1]), ids[-1]))
        self._base = array("I", base)

    def row(self, token_ids: list[int], num_prompt_tokens: int) -> array:
        """This step's words for a sequence of token_ids whose first num_prompt_tokens are
        its prompt (the returned array may be shared: read only)."""
        row = self._base
        generated = len(token_ids) - num_prompt_tokens
        for prefix, last in self._multi:
            k = len(prefix)
            if k <= generated and tuple(token_ids[len(token_ids) - k:]) == prefix:
                if row is self._base:
                    row = array("I", row)
                row[last >> 5] &= ~(1 << (last & 31))
        return row
