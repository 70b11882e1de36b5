"""Scheduler: continuous batching, budgets, chunked prefill, preemption, prefix hits.

Driven by FakeRunner, which keeps tokens in the paged slots and reads them back, so a
wrong block table changes the output just as it would with a real KV cache.
"""

from collections import Counter

from nanokv.engine.block_manager import BlockManager
from nanokv.engine.scheduler import Scheduler, SchedulerConfig
from nanokv.engine.sequence import Sequence, SequenceStatus
from nanokv.engine.types import ScheduledBatch, StepOutput, TokenLogprobs
from nanokv.sampling_params import SamplingParams

from .fake_runner import FakeRunner, reference_generate


def make_engine(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, prefix_caching=True, eos=()):
    bm = BlockManager(num_blocks, block_size, prefix_caching)
    sched = Scheduler(SchedulerConfig(max_num_seqs, budget), bm, eos)
    return sched, FakeRunner(num_blocks, block_size)


def add(sched, prompt, max_tokens, **kw):
    seq = Sequence(str(len(sched.waiting) + len(sched.running)), list(prompt),
                   SamplingParams(temperature=0, max_tokens=max_tokens, **kw), max_tokens)
    sched.add(seq)
    return seq


def check_invariants(sched):
    bm = sched.block_manager
    holders = Counter(b for seq in sched.running for b in seq.block_table)
    for block in bm.blocks:
        assert block.ref_count == holders.get(block.block_id, 0), block
        assert (block.ref_count == 0) == (block.block_id in bm.free_queue), block
    for h, block_id in bm.cached.items():
        assert bm.blocks[block_id].block_hash == h
    for seq in sched.waiting:
        assert seq.block_table == [] and seq.num_computed_tokens == 0
    for seq in sched.running:
        assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens


def run(sched, runner, max_steps=10_000):
    batches = []
    while sched.has_unfinished():
        batch = sched.schedule()
        batches.append(batch)
        sched.update(batch, runner.execute(batch))
        check_invariants(sched)
        assert len(batches) < max_steps
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # nothing leaked
    return batches


def test_continuous_batching_matches_reference_and_respects_limits():
    sched, runner = make_engine(max_num_seqs=3, budget=16)
    prompts = [[i + 1] * (3 + 5 * i) for i in range(7)]
    seqs = [add(sched, p, max_tokens=4 + i) for i, p in enumerate(prompts)]
    batches = run(sched, runner)
    for seq, p in zip(seqs, prompts):
        assert seq.output_token_ids == reference_generate(p, seq.max_tokens)
        assert seq.finish_reason == "length" and seq.status is SequenceStatus.FINISHED
    assert all(len(b.seqs) <= 3 and b.num_tokens <= 16 for b in batches)
    assert max(len(b.seqs) for b in batches) == 3


def test_long_prompt_is_chunked_and_decodes_go_first():
    sched, runner = make_engine(budget=8)
    short = add(sched, [1, 2], max_tokens=10)
    sched.update(b := sched.schedule(), runner.execute(b))  # short prefilled, now decoding
    long = add(sched, list(range(3, 33)), max_tokens=2)  # 30 tokens: 4 chunks of <= 8
    chunks = []
    while long.status is not SequenceStatus.FINISHED:
        batch = sched.schedule()
        if not short.is_finished:
            assert batch.seqs[0].seq_id == short.seq_id and len(batch.seqs[0].token_ids) == 1
        chunks += [len(s.token_ids) for s in batch.seqs if s.seq_id == long.seq_id]
        sched.update(batch, runner.execute(batch))
    assert chunks == [7, 7, 7, 7, 2, 1]  # 30 prompt tokens beside one decode, then a decode
    assert long.output_token_ids == reference_generate(list(range(3, 33)), 2)
    run(sched, runner)
    assert short.output_token_ids == reference_generate([1, 2], 10)


def test_preemption_under_a_tiny_pool_recomputes_correctly():
    sched, runner = make_engine(num_blocks=16, block_size=4, max_num_seqs=8, budget=64)
    prompts = [[(7 * i + j) % 50 for j in range(10 + 3 * i)] for i in range(6)]
    seqs = [add(sched, p, max_tokens=20) for p in prompts]
    run(sched, runner)
    assert sched.num_preemptions > 0
    for seq, p in zip(seqs, prompts):
        assert seq.output_token_ids == reference_generate(p, 20)


def test_newest_request_preempts_itself_without_crashing():
    # Pool of 4 blocks x 4 tokens. A (older) holds 3 blocks; B (newest) fills its only
    # block and needs a second one while A still runs: B must preempt itself, not A.
    sched, runner = make_engine(num_blocks=4, block_size=4, budget=64)
    a = add(sched, list(range(1, 10)), max_tokens=6)  # grows to 15 tokens: 4 blocks at the end
    b = add(sched, [40, 41, 42], max_tokens=6)
    preempted_b = False
    while sched.has_unfinished():
        batch = sched.schedule()
        if b.status is SequenceStatus.WAITING and b.output_token_ids and not preempted_b:
            preempted_b = True
            assert a.status is SequenceStatus.RUNNING
        sched.update(batch, runner.execute(batch))
        check_invariants(sched)
    assert preempted_b and sched.num_preemptions >= 1
    assert a.output_token_ids == reference_generate(list(range(1, 10)), 6)
    assert b.output_token_ids == reference_generate([40, 41, 42], 6)


def test_lone_request_filling_the_pool_finishes():
    sched, runner = make_engine(num_blocks=4, block_size=4)
    seq = add(sched, [1, 2, 3], max_tokens=13)  # exactly max_model_len tokens in the end
    run(sched, runner)
    assert seq.num_tokens == 16 and seq.finish_reason == "length"
    assert sched.num_preemptions == 0


def test_fully_cached_prompt_recomputes_only_its_last_token():
    sched, runner = make_engine(block_size=4)
    prompt = list(range(1, 9))  # two full blocks
    first = add(sched, prompt, max_tokens=3)
    run(sched, runner)
    again = add(sched, prompt, max_tokens=3)
    batch = sched.schedule()
    (item,) = batch.seqs
    assert item.start_pos == 7 and item.token_ids == [8] and item.sample
    assert again.num_cached_tokens == 7
    assert item.block_table[:2] == first_blocks(sched, prompt)
    sched.update(batch, runner.execute(batch))
    run(sched, runner)
    assert again.output_token_ids == first.output_token_ids == reference_generate(prompt, 3)
    assert sched.block_manager.hit_tokens == 7


def first_blocks(sched, prompt):
    bm = sched.block_manager
    probe = Sequence("probe", prompt, SamplingParams(), 1)
    return bm.find_cached_prefix(probe)


def test_shared_prefix_hits_after_first_request_finishes():
    sched, runner = make_engine(block_size=4)
    prefix = list(range(1, 13))  # three blocks
    a = add(sched, prefix + [20, 21], max_tokens=2)
    run(sched, runner)
    b = add(sched, prefix + [30], max_tokens=2)
    run(sched, runner)
    assert b.num_cached_tokens == 12
    assert b.output_token_ids == reference_generate(prefix + [30], 2)
    assert a.output_token_ids == reference_generate(prefix + [20, 21], 2)


def test_eos_and_stop_tokens_finish_and_free_in_the_same_step():
    sched, runner = make_engine(eos=[reference_generate([5, 6, 7], 1)[0]])
    seq = add(sched, [5, 6, 7], max_tokens=10)
    batch = sched.schedule()
    finished = sched.update(batch, runner.execute(batch))
    assert finished == [seq] and seq.finish_reason == "stop" and seq.stop_reason is None
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks

    ignoring = add(sched, [5, 6, 7], max_tokens=3, ignore_eos=True)
    run(sched, runner)
    assert ignoring.finish_reason == "length" and len(ignoring.output_token_ids) == 3

    target = reference_generate([5, 6, 7], 3)[2]
    stopped = add(sched, [5, 6, 7], max_tokens=10, ignore_eos=True, stop_token_ids=[target])
    run(sched, runner)
    assert stopped.finish_reason == "stop" and stopped.stop_reason == target
    assert stopped.output_token_ids[-1] == target


def test_abort_frees_blocks_at_once():
    sched, runner = make_engine()
    a = add(sched, list(range(1, 20)), max_tokens=30)
    b = add(sched, [3, 4, 5], max_tokens=5)
    batch = sched.schedule()
    sched.update(batch, runner.execute(batch))
    used = sched.block_manager.num_blocks - sched.block_manager.num_free_blocks
    sched.abort(a)
    assert a.finish_reason == "abort" and a.block_table == []
    assert sched.block_manager.num_blocks - sched.block_manager.num_free_blocks == used - 5
    run(sched, runner)
    assert b.output_token_ids == reference_generate([3, 4, 5], 5)


def test_prefix_caching_off_gives_same_outputs():
    outs = []
    for caching in (True, False):
        sched, runner = make_engine(num_blocks=20, prefix_caching=caching)
        prompts = [list(range(1, 13)) + [i] for i in range(5)]
        seqs = [add(sched, p, max_tokens=6) for p in prompts]
        run(sched, runner)
        outs.append([s.output_token_ids for s in seqs])
        if not caching:
            assert sched.block_manager.hit_tokens == 0 and sched.block_manager.cached == {}
    assert outs[0] == outs[1]


def test_blocks_filled_while_decoding_are_cached():
    sched, runner = make_engine(block_size=4)
    a = add(sched, [1, 2, 3, 4, 5, 6], max_tokens=5)  # blocks fill at 8 tokens while decoding
    run(sched, runner)
    b = add(sched, a.token_ids[:10], max_tokens=2)
    run(sched, runner)
    assert b.num_cached_tokens == 8


def test_requests_sharing_a_new_prefix_compute_it_once():
    sched, runner = make_engine(num_blocks=400, block_size=16, max_num_seqs=16, budget=4096)
    prefix = [(5 * i) % 89 + 1 for i in range(512)]
    prompts = [prefix + [90 + i] * (i + 1) for i in range(8)]
    seqs = [add(sched, p, max_tokens=4) for p in prompts]
    run(sched, runner)
    bm = sched.block_manager
    assert bm.hit_tokens == 7 * 512
    assert runner.computed_tokens == 512 + sum(i + 1 for i in range(8)) + 8 * 3
    assert bm.in_flight == {}
    for seq, p in zip(seqs, prompts):
        assert seq.output_token_ids == reference_generate(p, 4)


def test_freed_seq_ids_reach_the_runner_once_per_free():
    """Every free (finish, preemption) is listed in exactly one later batch that holds
    sequences, before the sequence is scheduled again; a sequence that was never freed
    is never listed."""
    sched, runner = make_engine(num_blocks=16, block_size=4, max_num_seqs=8, budget=64)
    seqs = [add(sched, [(5 * i + j) % 50 for j in range(10 + 3 * i)], max_tokens=20) for i in range(6)]
    listed, frees = Counter(), Counter()
    original_free = sched.block_manager.free

    def counting_free(seq):
        frees[seq.seq_id] += 1
        original_free(seq)

    sched.block_manager.free = counting_free
    while sched.has_unfinished():
        batch = sched.schedule()
        assert batch.seqs or not batch.freed_seq_ids
        listed.update(batch.freed_seq_ids)
        for item in batch.seqs:  # scheduled again only after its free was reported
            assert listed[item.seq_id] == frees[item.seq_id]
        sched.update(batch, runner.execute(batch))
    batch = sched.schedule()  # nothing left to run: the last frees wait for a batch with sequences
    assert not batch.seqs and not batch.freed_seq_ids
    add(sched, [1, 2, 3], max_tokens=1)
    listed.update(sched.schedule().freed_seq_ids)
    assert sched.num_preemptions > 0
    assert listed == frees and set(listed) == {s.seq_id for s in seqs}
    assert sum(listed.values()) == len(seqs) + sched.num_preemptions


def test_aborted_and_stopped_sequences_are_listed_as_freed():
    sched, runner = make_engine()
    a = add(sched, list(range(1, 20)), max_tokens=30)
    b = add(sched, [3, 4, 5], max_tokens=30)
    c = add(sched, [6, 7], max_tokens=30)
    batch = sched.schedule()
    assert batch.freed_seq_ids == []
    sched.update(batch, runner.execute(batch))
    sched.abort(a)
    sched.stop(b, "a stop string")
    batch = sched.schedule()
    assert [s.seq_id for s in batch.seqs] == [c.seq_id] and batch.freed_seq_ids == [a.seq_id, b.seq_id]
    sched.update(batch, runner.execute(batch))
    assert sched.schedule().freed_seq_ids == []


def test_freed_seq_ids_hand_over_every_finish_abort_and_preemption_once():
    """The runner drops per-sequence state by these ids: each finish, abort and preemption
    reaches it exactly once, on the next batch that has sequences."""
    sched, runner = make_engine(num_blocks=16, block_size=4, max_num_seqs=8, budget=64)
    seqs = [add(sched, [(7 * i + j) % 50 for j in range(10 + 3 * i)], max_tokens=20) for i in range(6)]
    expected, handed = Counter(), Counter()
    step = 0
    while sched.has_unfinished():
        before = {s.seq_id for s in sched.running}
        batch = sched.schedule()
        expected.update(s.seq_id for s in seqs if s.seq_id in before and s.status is SequenceStatus.WAITING)
        handed.update(batch.freed_seq_ids)
        assert batch.seqs or not batch.freed_seq_ids
        expected.update(s.seq_id for s in sched.update(batch, runner.execute(batch)))
        step += 1
        if step == 3 and not seqs[5].is_finished:
            sched.abort(seqs[5])
            expected[seqs[5].seq_id] += 1
    assert sched.num_preemptions > 0 and handed != expected  # the last finishes are still held
    assert sched.schedule().freed_seq_ids == []  # an empty batch never reaches the runner
    add(sched, [1, 2, 3], max_tokens=1)
    handed.update(sched.schedule().freed_seq_ids)  # the next batch that runs carries them
    assert handed == expected


def test_decode_batches_continue_the_one_before_until_the_running_set_changes():
    """ScheduledBatch.continues: a decode step of exactly the last batch's sequences, in
    order, one token on; numbered one after it. A finish, an abort, an admission or a stop
    string's stop breaks the run for one batch."""
    sched, runner = make_engine(num_blocks=64, block_size=4, budget=64)
    seqs = [add(sched, [i + 1] * (3 + i), max_tokens=20 + 3 * i) for i in range(3)]
    flags, last = [], None

    def step():
        nonlocal last
        batch = sched.schedule()
        assert batch.index == (0 if last is None else last.index + 1)
        if batch.continues:  # the last batch's sequences, in order, one token on
            assert [s.seq_id for s in batch.seqs] == last_ids
            assert [s.start_pos for s in batch.seqs] == [p + 1 for p in last_starts]
            assert all(s.token_ids == [seq.token_ids[-1]] for s, seq in zip(batch.seqs, sched.running))
        flags.append(batch.continues)
        last = batch
        seen = ([s.seq_id for s in batch.seqs], [s.start_pos for s in batch.seqs])
        sched.update(batch, runner.execute(batch))
        return seen

    for _ in range(4):
        last_ids, last_starts = step()
    assert flags == [False, False, True, True]  # the prefill, the first decode, then continuing
    sched.abort(seqs[2])
    last_ids, last_starts = step()
    last_ids, last_starts = step()
    assert flags[-2:] == [False, True]
    late = add(sched, [9] * 5, max_tokens=12)
    last_ids, last_starts = step()  # the admission
    last_ids, last_starts = step()  # its first decode beside the others
    last_ids, last_starts = step()
    assert flags[-3:] == [False, False, True]
    sched.stop(seqs[1], "stop string")
    last_ids, last_starts = step()
    last_ids, last_starts = step()
    assert flags[-2:] == [False, True]
    while sched.has_unfinished():  # late finishes: the step after it does not continue
        running = len(sched.running)
        last_ids, last_starts = step()
        if len(sched.running) < running and sched.running:
            last_ids, last_starts = step()
            assert not flags[-1]
    assert late.finish_reason == "length" and seqs[0].output_token_ids == reference_generate(
        seqs[0].token_ids[:seqs[0].num_prompt_tokens], 20)


class ScoringRunner(FakeRunner):
    """FakeRunner that also answers prompt logprobs: the logprob of position p's entry is p."""

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        out = super().execute(batch)
        scored = {s.seq_id: [TokenLogprobs(float(p), 1, [], []) for p in s.prompt_positions()]
                  for s in batch.seqs if s.prompt_logprobs is not None}
        out.prompt_logprobs = scored or None
        return out


def test_prompt_scoring_skips_the_prefix_cache_and_scores_each_position_once_across_preemption():
    sched, _ = make_engine(budget=8)
    runner = ScoringRunner(64, 4)
    prompt = list(range(10, 40))
    add(sched, prompt, 2)
    run(sched, runner)  # the prompt's blocks are now cached
    seq = add(sched, prompt, 3, prompt_logprobs=1, n=2)
    sibling = Sequence("x", prompt, seq.params, 3, index=1)  # a second sample does not score
    sched.add(sibling)
    batch = sched.schedule()
    sched.update(batch, runner.execute(batch))
    assert seq.num_cached_tokens == 0 and 0 < len(seq.prompt_logprobs) < len(prompt) - 1
    assert sibling.prompt_logprobs is None
    sched.running.remove(seq)  # preempted halfway through its prompt: recomputed from the start
    sched._preempt(seq)
    run(sched, runner)
    assert [lp.logprob for lp in seq.prompt_logprobs] == list(range(len(prompt) - 1))
    assert seq.output_token_ids == reference_generate(prompt, 3)
