"""The contract between the torch-free engine and the model runner.

The scheduler produces a ScheduledBatch; the runner turns it into tensors, runs the
model and answers with a StepOutput. Nothing else crosses that border.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanokv.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine cannot run any more (closed, or a tensor-parallel worker died): every
    request fails, not one. Raised by the runner; the engine then refuses further work."""


@dataclass(slots=True)  # one per sequence per step: slots build and read faster
class ScheduledSeq:
    """One sequence's share of a step.

    token_ids: the tokens to compute this step (a prefill chunk, or the one newest
        token of a decode); their positions are start_pos, start_pos + 1, ...
    start_pos: tokens of this sequence whose K/V is already in the cache (the cached
        prefix or earlier chunks); attention covers [0, start_pos + len(token_ids)).
    block_table: the sequence's pages, covering at least start_pos + len(token_ids)
        tokens. It is the sequence's own list: read it during the step, do not keep it.
    sample: True when this step reaches the end of the sequence's known tokens, so
        the logits of its last token are sampled into a new token.
    params: the request's sampling settings (read only).
    seed: the sequence's own seed (the request seed plus the sample index), or None.
    num_generated: tokens generated so far (the index of the token sampled now).
    all_token_ids, num_prompt_tokens: the sequence's tokens (its own list, read only),
        for penalties, token masks and prompt logprobs; the runner looks at them only when
        params asks for penalties, a mask or prompt_logprobs.
    constraint: the sequence's token mask (nanokv.constraints, opaque to the engine),
        applied when it samples; None: none.
    prompt_logprobs: None, or the top-N (params.prompt_logprobs, -1 resolved) of the prompt
        logprobs this step computes: for each position p of this chunk with
        prompt_logprobs_from <= p < num_prompt_tokens - 1, the logprob of prompt token p + 1
        under the raw logits at p. Set only where that range is not empty.
    """

    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    params: SamplingParams
    seed: int | None = None
    num_generated: int = 0
    all_token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    constraint: object | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_from: int = 0

    def prompt_positions(self) -> range:
        """The positions whose logits score the next prompt token this step."""
        if self.prompt_logprobs is None:
            return range(0)
        return range(max(self.start_pos, self.prompt_logprobs_from),
                     min(self.start_pos + len(self.token_ids), self.num_prompt_tokens - 1))


@dataclass
class ScheduledBatch:
    """Everything the runner needs for one forward pass.

    The scheduler lists running decodes before prefill chunks, but the runner must not
    rely on any order: it groups sequences by query length itself.

    freed_seq_ids: sequences the scheduler freed (finished, aborted, preempted) since
        the last batch it handed out, once per free, handed over in the next batch that
        holds sequences. The runner drops what it keeps per sequence (block-table rows);
        a preempted sequence that comes back starts afresh. Ids the runner never saw (a
        request aborted while waiting) mean nothing to it.
    index: the scheduler's count of the batches it handed out before this one (-1: a
        batch made elsewhere, e.g. to rerun one sequence).
    continues: this batch is a decode step of exactly the batch numbered index - 1: the
        same sequences in the same order, each computing the token sampled for it there
        (one token, one position on, sampled), its block table that step's, grown (blocks
        appended) only where its new position starts a block. The runner may carry that step's
        inputs over instead of rebuilding them (vLLM v1's cached requests); it must not
        rely on it unless it ran and sampled that very batch.
    """

    seqs: list[ScheduledSeq] = field(default_factory=list)
    num_tokens: int = 0
    freed_seq_ids: list[int] = field(default_factory=list)
    index: int = -1
    continues: bool = False


@dataclass
class TokenLogprobs:
    """Logprobs for one sampled token: its own, its rank (1 = most likely), and the top-N."""

    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class StepOutput:
    """The runner's answer, for the sampling sequences in batch order: one new token
    each, and its logprobs where the request asked for them (else None).
    prompt_logprobs: seq_id -> the prompt tokens' logprobs its ScheduledSeq asked for (in
    position order), for the sequences that asked (None: none did)."""

    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs: dict[int, list[TokenLogprobs]] | None = None
