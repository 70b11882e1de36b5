"""One request's tokens, progress and pages."""

from __future__ import annotations

import enum
from itertools import count

from nanokv.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_ids = count()


class Sequence:
    """A request in flight.

    token_ids holds prompt + generated tokens. num_computed_tokens counts the leading
    tokens whose K/V sits in the pages of block_table; the scheduler advances it as
    prefill chunks and decodes run, and resets it to 0 on preemption (recompute).
    block_hashes caches the chained hash of each full block of token_ids (tokens never
    change, so the hashes stay valid across preemption).
    """

    __slots__ = (
        "seq_id", "request_id", "token_ids", "num_prompt_tokens", "num_computed_tokens",
        "block_table", "block_hashes", "num_hashed_blocks", "status", "params", "max_tokens",
        "stop_token_ids", "finish_reason", "stop_reason", "num_cached_tokens",
        "index", "seed", "logprobs", "cumulative_logprob", "token_limit", "stoppers", "constraint",
        "prompt_logprobs",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 max_tokens: int, index: int = 0, constraint=None):
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.num_hashed_blocks = 0  # leading blocks of block_table already in the prefix cache
        self.status = SequenceStatus.WAITING
        self.params = params
        self.max_tokens = max_tokens  # params.max_tokens clamped to fit max_model_len
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.token_limit = self.num_prompt_tokens + max_tokens  # len(token_ids) at which it ends
        self.stoppers = self.stop_token_ids  # tokens that may end it: the scheduler adds its EOS ids
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at admission
        self.index = index  # which of the request's n samples this is
        self.seed = None if params.seed is None else params.seed + index
        self.logprobs: list = []  # TokenLogprobs per generated token, when params.logprobs is set
        self.cumulative_logprob = 0.0
        # a token mask for its sampled rows (nanokv.constraints; opaque here), or None
        self.constraint = constraint
        # the first sample of a request with params.prompt_logprobs scores its prompt: entry i
        # is prompt token i + 1's TokenLogprobs (None: this sequence does not score)
        self.prompt_logprobs: list | None = [] if params.prompt_logprobs is not None and index == 0 else None

    @property
    def scores_prompt(self) -> bool:
        """It still has prompt tokens to score (it then bypasses the prefix cache)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table}, {self.status.value})")
