"""Step inputs: the persistent block table and the one packed buffer a step travels in.

Rank 0 turns a ScheduledBatch into a PackedStep (StepPacker.pack): every per-step input in
one int32 host buffer, pinned on CUDA (its int64 sections are views of pairs of words),
and the few sizes that say how to read it. Every rank then unpacks it (unpack_step): one
copy to the device (non_blocking from pinned memory; none on the CPU), views of that
copy, the step's block-table writes applied to the rank's persistent table, and the
step's rows gathered from it. Tensor-parallel workers receive the same PackedStep
(executor/step_message.py) and read its sizes and host-side lengths from host memory, so
no rank reads step metadata back from its device.

The block table is persistent (vLLM v1's BlockTable): one row per running sequence,
written only when the sequence gains blocks (its whole table when it is admitted, one
entry every block_size decode tokens) and released when the scheduler frees the sequence
(ScheduledBatch.freed_seq_ids). A step carries only the new entries, so the host work per
step grows with the number of sequences, not with their context length.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import astuple, dataclass
from functools import lru_cache
from itertools import chain
from operator import attrgetter, itemgetter
from typing import NamedTuple

import torch

from nanokv.attention import AttentionMetadata
from nanokv.engine.types import ScheduledBatch
from nanokv.layers.sampler import list_tensor

_SEQ_ID, _BLOCK_TABLE, _START_POS, _TOKEN_IDS, _SAMPLE, _PROMPT_LOGPROBS = (
    attrgetter(f) for f in ("seq_id", "block_table", "start_pos", "token_ids", "sample", "prompt_logprobs"))
_ALIGN = 16  # int32 words: every section starts on a 64-byte boundary (Triton specialises on alignment)
_PREFILL_KEY = 1 << 40  # sort key offset: decodes (by context) before prefill chunks (by length)


class StepInputs(NamedTuple):
    """One step as tensors on the rank's device: what its forward needs."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    # [N] rows whose logits are computed: the sampled ones in batch order, then the rows that
    # score prompt tokens (ScheduledSeq.prompt_positions, batch order, position order)
    logits_rows: torch.Tensor | None


@dataclass(frozen=True)
class StepSizes:
    """How to read a packed step: section lengths and the host-side maxima."""

    num_tokens: int  # T
    num_seqs: int  # B
    num_decodes: int
    num_logits_rows: int  # R
    num_table_writes: int  # K: new block-table entries this step
    table_width: int  # W: block-table columns this step reads
    max_query_len: int
    max_seq_len: int

    def as_list(self) -> list[int]:
        return list(astuple(self))


class _Layout(NamedTuple):
    """Offsets (in int32 words) of a packed step's sections, each _ALIGN-aligned: int64
    input_ids, positions, slot_mapping [T], logits_rows [R]; int32 query_start_loc [B + 1],
    seq_lens [B], rows [B] (of the persistent table); then the table writes, int64
    write_index [K] and int32 write_values [K], last: what comes before them depends on
    T, R and B only."""

    input_ids: int
    positions: int
    slot_mapping: int
    logits_rows: int
    query_start_loc: int
    seq_lens: int
    rows: int
    write_index: int
    write_values: int
    total: int


def _section_lengths(s: StepSizes) -> tuple[int, ...]:
    """Each section's length in values, in _Layout's order."""
    return ((s.num_tokens,) * 3 + (s.num_logits_rows, s.num_seqs + 1, s.num_seqs, s.num_seqs)
            + (s.num_table_writes,) * 2)


@lru_cache(maxsize=256)
def _layout(s: StepSizes) -> _Layout:
    offsets, at = [], 0
    for n, dtype in zip(_section_lengths(s), _DTYPES):
        offsets.append(at)
        at += -(-n * (2 if dtype == torch.int64 else 1) // _ALIGN) * _ALIGN
    return _Layout(*offsets, at)


@dataclass
class PackedStep:
    """One step's inputs in one int32 host buffer (pinned when the step runs on CUDA).
    query_lens / seq_lens: the host-side lengths in step order when the packer has them
    (rank 0); a receiving rank reads them from the buffer."""

    sizes: StepSizes
    buffer: torch.Tensor  # [layout.total] int32, host
    query_lens: list[int] | None = None
    seq_lens: list[int] | None = None


# the sections' dtypes, in _Layout's order
_DTYPES = (torch.int64,) * 4 + (torch.int32,) * 3 + (torch.int64, torch.int32)


@lru_cache(maxsize=256)
def _tail_packer(k: int, values_at: int, words: int) -> struct.Struct:
    """The struct of a buffer's table writes: k int64 indices, the k int32 values at word
    values_at, zeros up to `words` words."""
    return struct.Struct(f"<{k}q{4 * (values_at - 2 * k)}x{k}i{4 * (words - values_at - k)}x")


@lru_cache(maxsize=256)
def _packer_of(sizes: StepSizes) -> struct.Struct:
    """The struct that writes a step of these sizes whole: its sections (lists, in _Layout's
    order) at their offsets, zeros between and after them."""
    lay, fmt, at = _layout(sizes), ["<"], 0
    for offset, n, dtype in zip(lay[:-1], _section_lengths(sizes), _DTYPES):
        if not n:
            continue
        if offset > at:
            fmt.append(f"{4 * (offset - at)}x")  # zero padding up to the section
        wide = dtype == torch.int64
        fmt.append(f"{n}{'q' if wide else 'i'}")
        at = offset + (2 * n if wide else n)
    fmt.append(f"{4 * (lay.total - at)}x")
    return struct.Struct("".join(fmt))


def _section(buf: torch.Tensor, offset: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.int64:
        return buf[offset:offset + 2 * n].view(torch.int64)
    return buf[offset:offset + n]


class BlockTableRows:
    """Rank 0's bookkeeping of the persistent block table: which row each running sequence
    holds and how many of its entries the row already has. `table` is rank 0's host copy
    (the device table itself on the CPU); slot mappings are read from it."""

    def __init__(self, table: torch.Tensor):
        assert table.device.type == "cpu" and table.is_contiguous() and table.dtype == torch.int32
        self.table = table  # [num_rows, width] int32, host
        # the same memory, entry by entry: a few entries written from Python cost less so
        # than through any tensor op
        self.entries = (ctypes.c_int32 * table.numel()).from_address(table.data_ptr())
        self.num_rows, self.width = table.shape
        self.row_of: dict[int, int] = {}  # seq id -> row
        self.held = [0] * self.num_rows  # leading entries of each row that are the sequence's
        self.free_rows = list(range(self.num_rows - 1, -1, -1))  # pop() hands out the lowest

    def release(self, seq_ids) -> None:
        for seq_id in seq_ids:
            row = self.row_of.pop(seq_id, None)
            if row is not None:
                self.held[row] = 0
                self.free_rows.append(row)

    def reset(self) -> None:
        """Forget every row: each sequence is written afresh at its next step."""
        self.release(list(self.row_of))

    def assign(self, seq_id: int, step_seqs) -> int:
        """A free row for seq_id; step_seqs: the step's sequences (their rows stay)."""
        if not self.free_rows:
            # Only when sequences were freed without word (a batch that never reached the
            # runner): take back every row that no sequence of this step holds.
            live = {s.seq_id for s in step_seqs}
            self.release([s for s in self.row_of if s not in live])
            assert self.free_rows, "a step holds more sequences than the block table has rows (max_num_seqs)"
        row = self.free_rows.pop()
        self.row_of[seq_id] = row
        return row


class _Decoding:
    """A decode step (one token per sequence, every one sampling) kept for the batch that
    continues it (ScheduledBatch.continues): the same sequences in the same order, each one
    position on. Its buffer up to the table writes is the next one's after a few in-place
    updates: positions, slots and lengths one further, the tokens it sampled as input ids,
    the slots of the sequences that start a block looked up."""

    def __init__(self, index: int, buffer: torch.Tensor, sizes: StepSizes, order: list[int], rank: list[int],
                 rows: list[int], starts: list[int], block_size: int):
        n, lay = sizes.num_seqs, _layout(sizes)
        self.index = index  # the batch's ScheduledBatch.index
        self.head = buffer[:lay.write_index].clone()  # int32: the buffer before its table writes
        self.num_seqs, self.width, self.max_seq_len = n, sizes.table_width, sizes.max_seq_len
        self.input_ids, self.positions, self.slots = (_section(self.head, at, n, torch.int64)
                                                      for at in (lay.input_ids, lay.positions, lay.slot_mapping))
        self.seq_lens = _section(self.head, lay.seq_lens, n, torch.int32)
        # positions and slots move on together: one view over both where no padding parts them
        self.moving = [_section(self.head, lay.positions, 2 * n, torch.int64)] \
            if lay.slot_mapping == lay.positions + 2 * n else [self.positions, self.slots]
        self.slot_entries = (ctypes.c_int64 * n).from_address(self.slots.data_ptr())  # a few set from Python
        self.order = torch.tensor(order)  # [B] int64: the batch index of each step position
        self.rank, self.rows, self.starts = rank, rows, starts  # batch order: step position, row, start then
        self.by_phase: list[list[int]] = [[] for _ in range(block_size)]  # who starts a block when
        for i, p in enumerate(starts):
            self.by_phase[p % block_size].append(i)  # k steps on, where (p + k) % block_size == 0
        self.step = 0  # steps carried over since


class StepPacker:
    """Rank 0: ScheduledBatch -> PackedStep. Sequences are ordered decodes first, shortest
    context first, then prefill chunks, shortest first (backends that group or pad
    similar sequences waste little); logits rows stay in batch order."""

    def __init__(self, block_size: int, table: torch.Tensor, pin_memory: bool):
        self.block_size = block_size
        self.rows = BlockTableRows(table)
        self.pin_memory = pin_memory
        self.decode_fast_path = True  # False: decode-only steps take the general path too (tests)
        self._decoding: _Decoding | None = None
        # (ScheduledBatch.index, [N] int64 host tensor): the tokens the runner sampled for a
        # batch in which every sequence sampled, in batch order (set by the runner)
        self.sampled: tuple[int, torch.Tensor] | None = None

    def pack(self, batch: ScheduledBatch) -> PackedStep:
        decoding, self._decoding = self._decoding, None
        try:
            if (batch.continues and decoding is not None and decoding.index == batch.index - 1
                    and self.sampled is not None and self.sampled[0] == decoding.index
                    and len(batch.seqs) == decoding.num_seqs and self.decode_fast_path):
                return self._pack_continuing(batch, decoding, self.sampled[1])
            return self._pack(batch)
        except BaseException:
            self.reset()  # a half-recorded step must not leave rows out of step with the tables
            raise

    def reset(self) -> None:
        """Forget every row (and the step carried over): each sequence is written afresh."""
        self._decoding = None
        self.rows.reset()

    def _pack(self, batch: ScheduledBatch) -> PackedStep:
        rows_state = self.rows
        rows_state.release(batch.freed_seq_ids)
        seqs = batch.seqs
        row_of, held = rows_state.row_of, rows_state.held
        # O(sequences), each field read in one C-level pass; only a row's new entries are copied
        rows = list(map(row_of.get, map(_SEQ_ID, seqs)))
        if None in rows:  # sequences new to the table (admitted, or back from preemption)
            rows = [rows_state.assign(s.seq_id, seqs) if row is None else row for s, row in zip(seqs, rows)]
        tables = list(map(_BLOCK_TABLE, seqs))
        lens = list(map(len, tables))
        have_lens = list(map(held.__getitem__, rows))
        writes = self._write_tables(rows, tables, lens, have_lens) if lens != have_lens else ([], [])
        width = max(lens, default=0)
        starts = list(map(_START_POS, seqs))
        ids = list(chain.from_iterable(map(_TOKEN_IDS, seqs)))
        scoring = list(map(_PROMPT_LOGPROBS, seqs)).count(None) != len(seqs)  # one C-level pass
        if len(ids) == len(seqs) and self.decode_fast_path and not scoring:
            return self._pack_decodes(seqs, rows, starts, ids, writes, width, tables, batch.index)
        return self._pack_general(seqs, rows, starts, ids, writes, width)

    def _write_tables(self, rows, tables, lens, have_lens):
        """The new entries of the tables whose length is not their row's (held): written into
        the host table and returned as (flat indices, values) for the other ranks."""
        held, full_width, entries = self.rows.held, self.rows.width, self.rows.entries
        write_index, write_values = [], []
        for row, table, n, have in zip(rows, tables, lens, have_lens):
            if n != have:  # new blocks (or, should a table ever shrink, rewrite it)
                assert n <= full_width, f"a block table of {n} blocks exceeds max_model_len ({full_width} blocks)"
                have = have if n > have else 0
                base = row * full_width
                new = table[have:n]
                entries[base + have:base + n] = new
                write_index += range(base + have, base + n)
                write_values += new
                held[row] = n
        return write_index, write_values

    def _pack_continuing(self, batch: ScheduledBatch, d: _Decoding, sampled: torch.Tensor) -> PackedStep:
        """The batch continuing d's: d's buffer head moved one position on in place (a few
        tensor ops, nothing per sequence), then the slots and table entries of the
        sequences whose new position starts a block."""
        bs, n = self.block_size, d.num_seqs
        torch.index_select(sampled, 0, d.order, out=d.input_ids)
        for t in d.moving:
            t.add_(1)
        d.seq_lens.add_(1)
        d.step += 1
        d.index = batch.index
        d.max_seq_len += 1
        starting = d.by_phase[-d.step % bs]  # new position p with p % bs == 0: a new block
        write_index, write_values = [], []
        if starting:
            seqs, held, step = batch.seqs, self.rows.held, d.step
            tables = [seqs[i].block_table for i in starting]
            rows = [d.rows[i] for i in starting]
            lens = list(map(len, tables))
            write_index, write_values = self._write_tables(rows, tables, lens, [held[r] for r in rows])
            d.width = max(d.width, max(lens))
            slots, rank, starts = d.slot_entries, d.rank, d.starts
            for i, table in zip(starting, tables):
                slots[rank[i]] = table[(starts[i] + step) // bs] * bs
        sizes = StepSizes(n, n, n, n, len(write_index), d.width, 1, d.max_seq_len)
        lay = _layout(sizes)
        head_words = d.head.numel()
        if not write_index and not self.pin_memory:  # the head is the whole step
            buf = d.head.clone()
        else:
            buf = torch.empty(lay.total, dtype=torch.int32, pin_memory=self.pin_memory)
            buf[:head_words].copy_(d.head)
            tail = buf[head_words:]
            if write_index:
                _tail_packer(len(write_index), lay.write_values - head_words, lay.total - head_words).pack_into(
                    (ctypes.c_char * (4 * tail.numel())).from_address(tail.data_ptr()), 0, *write_index, *write_values)
            else:
                tail.zero_()
        self._decoding = d
        return PackedStep(sizes, buf, [1] * n, d.seq_lens.tolist())

    def _pack_decodes(self, seqs, rows, starts, ids, writes, width, tables, batch_index: int) -> PackedStep:
        """One query token per sequence: plain lists in step order, written into the
        buffer by one struct call (cheaper than any tensor op at these sizes)."""
        bs, num_seqs = self.block_size, len(seqs)
        order = sorted(range(num_seqs), key=starts.__getitem__)  # stable: shortest context first
        pick = itemgetter(*order) if num_seqs > 1 else (lambda xs: (xs[order[0]],))
        positions = pick(starts)
        slots = pick([table[p // bs] * bs + p % bs for table, p in zip(tables, starts)])
        rank = [0] * num_seqs
        for k, i in enumerate(order):
            rank[i] = k
        samples = list(map(_SAMPLE, seqs))
        logits_rows = rank if all(samples) else [k for k, keep in zip(rank, samples) if keep]
        seq_lens = list(map((1).__add__, positions))
        sizes = StepSizes(num_seqs, num_seqs, num_seqs, len(logits_rows), len(writes[0]), width, 1, max(seq_lens))
        sections = (pick(ids), positions, slots, logits_rows, range(num_seqs + 1), seq_lens, pick(rows), *writes)
        packed = PackedStep(sizes, self._buffer(sizes, sections), [1] * num_seqs, seq_lens)
        if logits_rows is rank and batch_index >= 0:  # a batch that continues this one may carry it over
            self._decoding = _Decoding(batch_index, packed.buffer, sizes, order, rank, rows, starts, bs)
        return packed

    def _pack_general(self, seqs, rows, starts, ids, writes, width) -> PackedStep:
        """Prefill chunks (and decodes beside them): positions, token order and slot
        mapping with tensor ops over the tokens."""
        q_lens = [len(s.token_ids) for s in seqs]
        num_seqs, num_tokens = len(seqs), len(ids)
        q, starts_t = list_tensor(q_lens), list_tensor(starts)
        order = torch.argsort(torch.where(q == 1, starts_t, q + _PREFILL_KEY), stable=True)
        q_s, starts_s, rows_s = q[order], starts_t[order], list_tensor(rows)[order]
        seq_lens = starts_s + q_s
        cu = torch.zeros(num_seqs + 1, dtype=torch.int64)
        torch.cumsum(q_s, 0, out=cu[1:])
        owner = torch.repeat_interleave(q_s, output_size=num_tokens)  # [T] its sequence, in step order
        offset = torch.arange(num_tokens) - cu[:-1][owner]
        positions = starts_s[owner] + offset
        first_in_batch = (torch.cumsum(q, 0) - q)[order]  # where each sequence's tokens start in ids
        input_ids = list_tensor(ids)[first_in_batch[owner] + offset]
        bs = self.block_size
        slots = self.rows.table[rows_s[owner], positions // bs].long() * bs + positions % bs
        logits_rows = (cu[1:] - 1)[order.argsort()][torch.tensor([s.sample for s in seqs])]
        if any(s.prompt_logprobs is not None for s in seqs):
            logits_rows = torch.cat([logits_rows, *_prompt_rows(seqs, cu[:-1][order.argsort()])])
        seq_lens_list = seq_lens.tolist()
        sizes = StepSizes(num_tokens, num_seqs, q_lens.count(1), logits_rows.numel(), len(writes[0]), width,
                          max(q_lens), max(seq_lens_list))
        sections = (input_ids, positions, slots, logits_rows, cu, seq_lens, rows_s, *writes)
        return PackedStep(sizes, self._buffer(sizes, sections), q_s.tolist(), seq_lens_list)

    def _buffer(self, sizes: StepSizes, sections) -> torch.Tensor:
        """The packed buffer: the sections (in _Layout's order) at their offsets. Lists
        only: one struct call writes them all; else each is copied in as a tensor."""
        lay = _layout(sizes)
        buf = torch.empty(lay.total, dtype=torch.int32, pin_memory=self.pin_memory)
        if any(isinstance(data, torch.Tensor) for data in sections):
            buf.zero_()  # the padding too: a step's buffer is a function of the step
            for offset, data, dtype in zip(lay[:-1], sections, _DTYPES):
                if len(data):
                    _section(buf, offset, len(data), dtype).copy_(
                        data if isinstance(data, torch.Tensor) else list_tensor(data, dtype))
            return buf
        _packer_of(sizes).pack_into((ctypes.c_char * (4 * lay.total)).from_address(buf.data_ptr()), 0,
                                    *chain.from_iterable(sections))
        return buf


def _prompt_rows(seqs, first: torch.Tensor) -> list[torch.Tensor]:
    """The step-order rows whose logits score prompt tokens: each scoring sequence's
    prompt_positions, where first[i] is the step row of sequence i's first token."""
    rows = []
    for i, s in enumerate(seqs):
        positions = s.prompt_positions()
        if positions:
            at = int(first[i]) - s.start_pos
            rows.append(torch.arange(positions.start + at, positions.stop + at))
    return rows


def unpack_step(packed: PackedStep, table: torch.Tensor, apply_writes: bool = True) -> StepInputs:
    """A packed step as tensors on table's device: one copy of the buffer (non_blocking
    from pinned memory on CUDA; on the CPU the buffer's own views), the block-table writes
    applied to table ([rows, width] int32, this rank's persistent table; apply_writes False
    where the packer wrote them already, the same tensor), the step's rows gathered."""
    sz, host = packed.sizes, packed.buffer
    device = table.device
    buf = host if device.type == "cpu" else host.to(device, non_blocking=True)
    lay = _layout(sz)
    T, B, R, K = sz.num_tokens, sz.num_seqs, sz.num_logits_rows, sz.num_table_writes
    if K and apply_writes:
        table.view(-1).index_copy_(0, _section(buf, lay.write_index, K, torch.int64),
                                   _section(buf, lay.write_values, K, torch.int32))
    rows = _section(buf, lay.rows, B, torch.int32)
    block_tables = torch.index_select(table[:, :sz.table_width], 0, rows)  # [B, W] int32
    query_lens, seq_lens = packed.query_lens, packed.seq_lens
    if query_lens is None:  # a receiving rank: the lengths from its host copy
        qsl = _section(host, lay.query_start_loc, B + 1, torch.int32)
        query_lens = (qsl[1:] - qsl[:-1]).tolist()
        seq_lens = _section(host, lay.seq_lens, B, torch.int32).tolist()
    meta = AttentionMetadata(
        slot_mapping=_section(buf, lay.slot_mapping, T, torch.int64),
        query_start_loc=_section(buf, lay.query_start_loc, B + 1, torch.int32),
        seq_lens=_section(buf, lay.seq_lens, B, torch.int32),
        block_tables=block_tables,
        num_decodes=sz.num_decodes,
        max_query_len=sz.max_query_len,
        max_seq_len=sz.max_seq_len,
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
    logits_rows = _section(buf, lay.logits_rows, R, torch.int64) if R else None
    return StepInputs(_section(buf, lay.input_ids, T, torch.int64), _section(buf, lay.positions, T, torch.int64),
                      meta, logits_rows)
