"""Step inputs (runner/inputs.py): the persistent block table and the packed buffer,
against a from-scratch reference of every field, over steps in which sequences arrive,
grow, leave and come back; the buffer's layout; what a step sends."""

from __future__ import annotations

import random

import pytest
import torch

from nanokv.engine.types import ScheduledBatch, ScheduledSeq
from nanokv.runner.inputs import PackedStep, StepPacker, _layout, unpack_step
from nanokv.sampling_params import SamplingParams

BS = 4
PARAMS = SamplingParams(temperature=0)


def reference(batch: ScheduledBatch):
    """Every field from the batch alone: decodes first by context, then chunks by length."""
    seqs = batch.seqs
    order = sorted((i for i, s in enumerate(seqs) if len(s.token_ids) == 1), key=lambda i: seqs[i].start_pos)
    order += sorted((i for i, s in enumerate(seqs) if len(s.token_ids) != 1), key=lambda i: len(seqs[i].token_ids))
    ids, positions, slots, cu = [], [], [], [0]
    for i in order:
        s = seqs[i]
        for k, t in enumerate(s.token_ids):
            p = s.start_pos + k
            ids.append(t)
            positions.append(p)
            slots.append(s.block_table[p // BS] * BS + p % BS)
        cu.append(cu[-1] + len(s.token_ids))
    rank = {orig: k for k, orig in enumerate(order)}
    return dict(input_ids=ids, positions=positions, slot_mapping=slots, query_start_loc=cu,
                seq_lens=[seqs[i].start_pos + len(seqs[i].token_ids) for i in order],
                tables=[seqs[i].block_table for i in order],
                logits_rows=[cu[rank[i] + 1] - 1 for i, s in enumerate(seqs) if s.sample],
                num_decodes=sum(len(s.token_ids) == 1 for s in seqs))


def assert_matches_reference(inputs, batch):
    want = reference(batch)
    meta = inputs.meta
    assert inputs.input_ids.tolist() == want["input_ids"]
    assert inputs.positions.tolist() == want["positions"]
    assert meta.slot_mapping.tolist() == want["slot_mapping"]
    assert meta.slot_mapping.dtype == torch.int64 and meta.seq_lens.dtype == torch.int32
    assert meta.query_start_loc.tolist() == want["query_start_loc"]
    assert meta.seq_lens.tolist() == meta.seq_lens_cpu == want["seq_lens"]
    assert meta.query_lens_cpu == [b - a for a, b in zip(want["query_start_loc"], want["query_start_loc"][1:])]
    assert meta.num_decodes == want["num_decodes"]
    assert meta.max_query_len == max(meta.query_lens_cpu) and meta.max_seq_len == max(want["seq_lens"])
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.is_contiguous()
    assert meta.block_tables.shape == (len(batch.seqs), max(len(t) for t in want["tables"]))
    for row, table in zip(meta.block_tables.tolist(), want["tables"]):
        assert row[:len(table)] == table  # past a sequence's own blocks: whatever (never read)
    got_rows = None if inputs.logits_rows is None else inputs.logits_rows.tolist()
    assert got_rows == (want["logits_rows"] or None)


class Workload:
    """Sequences that prefill in chunks, decode, finish and get preempted (their tables
    rebuilt from other blocks), as the scheduler would hand them over."""

    def __init__(self, seed: int, max_seqs: int = 6):
        self.rng = random.Random(seed)
        self.max_seqs = max_seqs
        self.live: dict[int, dict] = {}
        self.free_blocks = list(range(400))
        self.rng.shuffle(self.free_blocks)
        self.next_id = 0
        self.freed: list[int] = []

    def _table(self, seq, tokens):
        while len(seq["table"]) * BS < tokens:
            seq["table"].append(self.free_blocks.pop())

    def _release(self, seq_id):
        self.free_blocks += self.live.pop(seq_id)["table"]
        self.freed.append(seq_id)

    def step(self) -> ScheduledBatch:
        rng = self.rng
        while len(self.live) < self.max_seqs and rng.random() < 0.5:
            self.live[self.next_id] = dict(prompt=rng.randint(1, 30), computed=0, table=[])
            self.next_id += 1
        for seq_id in list(self.live):
            if rng.random() < 0.08:  # finished or aborted
                self._release(seq_id)
            elif rng.random() < 0.05:  # preempted: its blocks go, it comes back later, same id
                seq = self.live[seq_id]
                self.free_blocks += seq["table"]
                self.freed.append(seq_id)
                seq.update(computed=0, table=[])
        seqs = []
        for seq_id, seq in self.live.items():
            todo = max(seq["prompt"] - seq["computed"], 1)
            n = min(todo, rng.randint(1, 9))
            self._table(seq, seq["computed"] + n)
            sample = seq["computed"] + n >= seq["prompt"]
            seqs.append(ScheduledSeq(seq_id, [rng.randrange(1000) for _ in range(n)], seq["computed"],
                                     seq["table"], sample, PARAMS))
            seq["computed"] += n
        self.rng.shuffle(seqs)  # the runner must not rely on the scheduler's order
        batch = ScheduledBatch(seqs, sum(len(s.token_ids) for s in seqs), self.freed)
        self.freed = []
        return batch


def new_packer(rows: int = 8, width: int = 32) -> StepPacker:
    return StepPacker(BS, torch.zeros(rows, width, dtype=torch.int32), pin_memory=False)


def test_steps_match_the_reference_as_sequences_come_grow_and_go():
    for seed in range(4):
        packer, work = new_packer(), Workload(seed)
        worker_table = torch.zeros_like(packer.rows.table)  # another rank's copy, fed by the writes only
        for _ in range(120):
            batch = work.step()
            if not batch.seqs:
                continue
            packed = packer.pack(batch)
            assert_matches_reference(unpack_step(packed, packer.rows.table, apply_writes=False), batch)
            received = PackedStep(packed.sizes, packed.buffer.clone())  # what a worker gets: no host lists
            assert_matches_reference(unpack_step(received, worker_table), batch)
        assert torch.equal(worker_table, packer.rows.table)


def test_decode_fast_path_equals_the_general_path():
    fast, general = new_packer(), new_packer()
    general.decode_fast_path = False
    work = Workload(7)
    for _ in range(60):
        batch = work.step()
        for s in batch.seqs:  # decode-shaped steps: one token each, some not sampling
            s.token_ids = s.token_ids[:1]
        if not batch.seqs:
            continue
        a, b = fast.pack(batch), general.pack(batch)
        assert a.sizes == b.sizes and torch.equal(a.buffer, b.buffer)
        assert (a.query_lens, a.seq_lens) == (b.query_lens, b.seq_lens)


def test_continuing_decode_steps_carry_the_last_step_over_exactly():
    """Runs of decode steps of the same sequences in the same order, each batch continuing
    the one before (ScheduledBatch.continues: the packer moves the last step's buffer one
    position on), pack exactly what the general path packs: across block starts (one
    block or several appended), and after steps that break the run: sequences that leave
    or arrive, a table rewritten shorter, a step in which one does not sample, a reset."""
    rng = random.Random(3)
    fast, general = new_packer(width=128), new_packer(width=128)
    general.decode_fast_path = False
    free = list(range(3000))
    rng.shuffle(free)
    carried = []
    real = fast._pack_continuing
    fast._pack_continuing = lambda *args: carried.append(real(*args)) or carried[-1]

    def new_seq(seq_id):
        return ScheduledSeq(seq_id, [1], rng.randrange(0, 40), [], True, PARAMS)

    seqs, next_id, sampled = [new_seq(i) for i in range(6)], 6, None
    for step in range(300):
        freed, event, continues = [], rng.random(), sampled is not None
        for i, s in enumerate(seqs):
            s.start_pos += step > 0
            s.token_ids = [sampled[i] if sampled else rng.randrange(1000)]
            s.sample = True
        if event < 0.03 and len(seqs) > 1:
            freed.append(seqs.pop(rng.randrange(len(seqs))).seq_id)
            continues = False
        elif event < 0.06:
            seqs.append(new_seq(next_id))
            next_id += 1
            continues = False
        elif event < 0.09:  # a table rewritten: fewer, other blocks, still covering the sequence
            for s in seqs:
                if len(s.block_table) > s.start_pos // BS + 1:  # grown ahead: it can shrink
                    s.block_table = [free.pop() for _ in range(s.start_pos // BS + 1)]
                    continues = False
                    break
        elif event < 0.12:  # a prefill's last chunk would be such a step
            rng.choice(seqs).sample = False
            continues = False
        elif event < 0.13:
            fast.reset()  # the packer forgets: a continuing batch is packed afresh
            general.reset()
        for s in seqs:
            ahead = s.start_pos % BS == 0 and rng.random() < 0.3  # a new block, now and then two
            while len(s.block_table) * BS < s.start_pos + 1 + ahead * BS:
                s.block_table.append(free.pop())
        batch = ScheduledBatch(list(seqs), len(seqs), freed, index=step, continues=continues)
        a, b = fast.pack(batch), general.pack(batch)
        assert a.sizes == b.sizes and torch.equal(a.buffer, b.buffer), step
        assert (a.query_lens, a.seq_lens) == (b.query_lens, b.seq_lens)
        assert_matches_reference(unpack_step(a, fast.rows.table, apply_writes=False), batch)
        all_sampled = all(s.sample for s in seqs)
        sampled = [rng.randrange(1000) for _ in seqs] if all_sampled else None
        fast.sampled = (step, torch.tensor(sampled)) if all_sampled else None
    assert sum(p is not None for p in carried) > 150  # most steps were carried over


def test_a_step_sends_only_new_table_entries():
    """Steady decoding writes one entry per sequence that starts a block, whatever the
    context length; a new sequence sends its whole table once."""
    packer = new_packer(width=300)
    seqs = [ScheduledSeq(i, [7], 1000 + i, list(range(300 * i, 300 * i + 251)), True, PARAMS) for i in range(4)]
    first = packer.pack(ScheduledBatch(seqs))
    assert first.sizes.num_table_writes == 4 * 251
    for _ in range(8):
        for s in seqs:
            s.start_pos += 1
            if s.start_pos % BS == 0:
                s.block_table.append(s.block_table[-1] + 1)
        packed = packer.pack(ScheduledBatch(seqs))
        crossing = sum(s.start_pos % BS == 0 for s in seqs)
        assert packed.sizes.num_table_writes == crossing
        assert_matches_reference(unpack_step(packed, packer.rows.table, apply_writes=False), ScheduledBatch(seqs))


def test_rows_are_reused_after_frees_and_reclaimed_when_frees_went_unreported():
    packer = new_packer(rows=3)
    batch = ScheduledBatch([ScheduledSeq(i, [1], 0, [i], True, PARAMS) for i in range(3)])
    packer.pack(batch)
    assert packer.rows.row_of == {0: 0, 1: 1, 2: 2}
    packer.pack(ScheduledBatch([ScheduledSeq(5, [1], 0, [9], True, PARAMS)], freed_seq_ids=[1]))
    assert packer.rows.row_of == {0: 0, 2: 2, 5: 1}  # the freed row, written afresh
    # frees that never arrived: the rows no sequence of this step holds are taken back
    batch = ScheduledBatch([ScheduledSeq(i, [1], 0, [i], True, PARAMS) for i in (6, 7, 2)])
    assert_matches_reference(unpack_step(packer.pack(batch), packer.rows.table, apply_writes=False), batch)
    assert set(packer.rows.row_of) == {6, 7, 2} and packer.rows.row_of[2] == 2


def test_a_failed_pack_leaves_no_row_half_written():
    packer = new_packer(rows=2, width=4)
    good = ScheduledSeq(0, [1], 0, [3], True, PARAMS)
    too_long = ScheduledSeq(1, [1], 0, list(range(5)), True, PARAMS)  # wider than the table
    try:
        packer.pack(ScheduledBatch([good, too_long]))
    except AssertionError:
        pass
    else:
        raise AssertionError("a table wider than max_model_len was accepted")
    assert packer.rows.row_of == {}  # forgotten: written afresh at the next step
    batch = ScheduledBatch([good])
    assert_matches_reference(unpack_step(packer.pack(batch), packer.rows.table, apply_writes=False), batch)


def test_sections_are_aligned_for_the_kernels():
    packer = new_packer()
    batch = ScheduledBatch([ScheduledSeq(i, [1] * (i + 1), i, [i, i + 8], i % 2 == 0, PARAMS) for i in range(3)])
    packed = packer.pack(batch)
    lay = _layout(packed.sizes)
    assert all(offset % 16 == 0 for offset in lay) and packed.buffer.numel() == lay.total
    inputs = unpack_step(packed, packer.rows.table, apply_writes=False)
    for t in (inputs.input_ids, inputs.positions, inputs.meta.slot_mapping, inputs.meta.query_start_loc,
              inputs.meta.seq_lens):
        assert t.data_ptr() % 64 == packed.buffer.data_ptr() % 64  # views of the one buffer


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_steps_copied_once_from_pinned_memory_match_the_reference():
    packer = StepPacker(BS, torch.zeros(8, 32, dtype=torch.int32), pin_memory=True)
    device_table = torch.zeros(8, 32, dtype=torch.int32, device="cuda")
    work = Workload(3)
    for _ in range(60):
        batch = work.step()
        if not batch.seqs:
            continue
        packed = packer.pack(batch)
        assert packed.buffer.is_pinned()
        inputs = unpack_step(packed, device_table)
        assert inputs.input_ids.is_cuda and inputs.meta.block_tables.is_cuda
        assert_matches_reference(inputs, batch)
    assert torch.equal(device_table.cpu(), packer.rows.table)
