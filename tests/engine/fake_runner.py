"""A torch-free stand-in for the model runner that really uses the paged memory.

It stores each computed token id in the slot its block table names, and derives the
next token from the context it reads back through the block table. A scheduling or
paging bug (wrong block, missing token, stale page) changes the output, just as it would
corrupt a real KV cache, while thousands of steps run in well under a second.

Like the real runner it keeps block tables across steps (runner/inputs.py): a row per
sequence that only ever appends the entries past what it holds, dropped when the batch
lists the sequence in freed_seq_ids. A free the scheduler fails to report (a preempted
sequence coming back with a new table) makes it read the wrong pages.
"""

from __future__ import annotations

from nanokv.engine.types import ScheduledBatch, StepOutput


def next_token(context: list[int], vocab: int = 97) -> int:
    h = 0
    for t in context[-8:]:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
    return (h + len(context)) % vocab


def reference_generate(prompt: list[int], max_tokens: int, vocab: int = 97) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens, vocab))
    return tokens[len(prompt):]


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int, vocab: int = 97):
        self.block_size, self.vocab = block_size, vocab
        self.cache = [[None] * block_size for _ in range(num_blocks)]
        self.computed_tokens = 0
        self.tables: dict[int, list[int]] = {}  # seq id -> its persistent row

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        bs, out = self.block_size, []
        for seq_id in batch.freed_seq_ids:
            self.tables.pop(seq_id, None)
        for s in batch.seqs:
            table = self.tables.setdefault(s.seq_id, [])
            table += s.block_table[len(table):]  # only what is new
            for i, t in enumerate(s.token_ids):
                pos = s.start_pos + i
                self.cache[table[pos // bs]][pos % bs] = t
            self.computed_tokens += len(s.token_ids)
            if s.sample:
                n = s.start_pos + len(s.token_ids)
                context = [self.cache[table[p // bs]][p % bs] for p in range(n)]
                assert None not in context, "read a slot that was never written"
                out.append(next_token(context, self.vocab))
        return StepOutput(out)
