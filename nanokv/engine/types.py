"""The contract between the torch-free engine and the model runner.

The scheduler produces a ScheduledBatch; the runner turns it into tensors, runs the
model and answers with a StepOutput. Nothing else crosses that border.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
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
    temperature: 0 means greedy.
    """

    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    temperature: float
    num_generated: int = 0


@dataclass
class ScheduledBatch:
    """Everything the runner needs for one forward pass.

    The scheduler lists running decodes before prefill chunks, but the runner must not
    rely on any order: it groups sequences by query length itself.
    """

    seqs: list[ScheduledSeq] = field(default_factory=list)
    num_tokens: int = 0

    @property
    def num_sampled(self) -> int:
        return sum(1 for s in self.seqs if s.sample)


@dataclass
class StepOutput:
    """The runner's answer: one new token per sampling sequence, in batch order."""

    sampled_token_ids: list[int] = field(default_factory=list)
