"""Property-based tests of the scheduler and block manager on random workloads.

Arrivals over time, shared prefixes, aborts, tiny pools that force preemption, any block
size and token budget. After every step: no block leaked or double-freed, ref counts
equal the number of block tables holding each block, every prefix-cache entry points at a
block that really holds those tokens; in the end every request finishes and greedy
outputs equal the unconstrained run's.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanokv.engine.block_manager import BlockManager
from nanokv.engine.scheduler import Scheduler, SchedulerConfig
from nanokv.engine.sequence import Sequence, SequenceStatus
from nanokv.sampling_params import SamplingParams

from .fake_runner import FakeRunner, reference_generate


@st.composite
def workloads(draw):
    block_size = draw(st.integers(1, 8))
    max_model_len = draw(st.integers(8, 64))
    min_blocks = -(-max_model_len // block_size)
    num_blocks = draw(st.integers(min_blocks, min_blocks * 3))
    prefixes = draw(st.lists(st.lists(st.integers(0, 96), min_size=1, max_size=24), min_size=1, max_size=3))
    requests = []
    for _ in range(draw(st.integers(1, 14))):
        prefix = draw(st.sampled_from(prefixes + [[]]))
        suffix = draw(st.lists(st.integers(0, 96), min_size=0 if prefix else 1, max_size=20))
        prompt = (prefix + suffix)[:max_model_len - 1]
        requests.append(dict(
            prompt=prompt,
            max_tokens=draw(st.integers(1, 30)),
            arrival=draw(st.integers(0, 12)),
            abort_at=draw(st.one_of(st.none(), st.integers(0, 30))),
        ))
    return dict(
        block_size=block_size, num_blocks=num_blocks, max_model_len=max_model_len,
        max_num_seqs=draw(st.integers(1, 8)), budget=draw(st.integers(1, 64)),
        prefix_caching=draw(st.booleans()), requests=requests,
    )


def check_invariants(sched: Scheduler, runner: FakeRunner) -> None:
    bm = sched.block_manager
    holders = Counter(b for seq in sched.running for b in seq.block_table)
    for block in bm.blocks:
        assert block.ref_count == holders.get(block.block_id, 0), block
        assert (block.ref_count == 0) == (block.block_id in bm.free_queue), block
    assert bm.num_free_cached == sum(1 for b in bm.free_queue if bm.blocks[b].block_hash is not None)
    for h, block_id in bm.cached.items():
        block = bm.blocks[block_id]
        assert block.block_hash == h
        assert runner.cache[block_id] == list(block.token_ids)  # really holds those tokens
    for seq in sched.running:
        assert len(seq.block_table) == -(-seq.num_computed_tokens // bm.block_size)
        assert len(set(seq.block_table)) == len(seq.block_table)
    for seq in sched.waiting:
        assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert len(sched.running) <= sched.config.max_num_seqs
    kv = sched.kv_stats()
    assert kv.free_blocks == sum(1 for b in bm.blocks if b.ref_count == 0)
    assert {b for s in sched.running for b in s.block_table} == {b.block_id for b in bm.blocks if b.ref_count > 0}
    bs = bm.block_size
    slots = {(s.block_table[p // bs], p % bs) for s in sched.running for p in range(s.num_computed_tokens)}
    assert kv.stored_tokens == len(slots)
    assert 0 <= kv.fragmentation_tokens < max(len(sched.running), 1) * bm.block_size
    assert kv.prefix_hit_tokens <= kv.prefix_query_tokens


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_invariants_and_outputs(w):
    bm = BlockManager(w["num_blocks"], w["block_size"], w["prefix_caching"])
    sched = Scheduler(SchedulerConfig(w["max_num_seqs"], w["budget"]), bm)
    runner = FakeRunner(w["num_blocks"], w["block_size"])
    seqs = []
    for i, r in enumerate(w["requests"]):
        max_tokens = min(r["max_tokens"], w["max_model_len"] - len(r["prompt"]))
        seqs.append(Sequence(str(i), r["prompt"], SamplingParams(temperature=0, max_tokens=r["max_tokens"]),
                             max_tokens))
    step = 0
    while step <= 12 or sched.has_unfinished():
        for seq, r in zip(seqs, w["requests"]):
            if r["arrival"] == step:
                sched.add(seq)
            if r["abort_at"] == step and r["arrival"] <= step:
                sched.abort(seq)
        batch = sched.schedule()
        assert batch.num_tokens <= w["budget"] and len(batch.seqs) <= w["max_num_seqs"]
        if sched.has_unfinished():
            assert batch.seqs, "no progress with requests pending"
        sched.update(batch, runner.execute(batch))
        check_invariants(sched, runner)
        step += 1
        assert step < 5000
    assert bm.num_free_blocks == bm.num_blocks and bm.in_flight == {}
    for seq, r in zip(seqs, w["requests"]):
        assert seq.status is SequenceStatus.FINISHED
        if seq.finish_reason != "abort":
            assert seq.finish_reason == "length"
            assert seq.output_token_ids == reference_generate(r["prompt"], seq.max_tokens)


def _step_view(batch):
    return ([(s.token_ids, s.start_pos, list(s.block_table), s.sample, s.num_generated, s.num_prompt_tokens,
              s.seed, list(s.all_token_ids)) for s in batch.seqs], batch.num_tokens, len(batch.freed_seq_ids))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.lists(st.integers(0, 96), max_size=3), st.lists(st.integers(0, 96), max_size=2),
       st.integers(0, 3))
def test_decode_fast_path_schedules_exactly_like_the_general_loop(w, eos, stop_ids, min_tokens):
    """The pure-decode step (every running sequence one token) gives the same batches,
    block ids, finishes and outputs as the general loop, through preemption, aborts,
    prefix hits, EOS, stop token ids and min_tokens."""
    runs = []
    for fast in (True, False):
        bm = BlockManager(w["num_blocks"], w["block_size"], w["prefix_caching"])
        sched = Scheduler(SchedulerConfig(w["max_num_seqs"], w["budget"]), bm, eos)
        sched.decode_fast_path = fast
        runner = FakeRunner(w["num_blocks"], w["block_size"])
        seqs = []
        for i, r in enumerate(w["requests"]):
            max_tokens = min(r["max_tokens"], w["max_model_len"] - len(r["prompt"]))
            params = SamplingParams(temperature=0, max_tokens=r["max_tokens"], stop_token_ids=stop_ids,
                                    min_tokens=min(min_tokens, r["max_tokens"]), ignore_eos=i % 3 == 0, seed=i)
            seqs.append(Sequence(str(i), r["prompt"], params, max_tokens))
        steps, step = [], 0
        while step <= 12 or sched.has_unfinished():
            for seq, r in zip(seqs, w["requests"]):
                if r["arrival"] == step:
                    sched.add(seq)
                if r["abort_at"] == step and r["arrival"] <= step:
                    sched.abort(seq)
            batch = sched.schedule()
            view = _step_view(batch)
            finished = sched.update(batch, runner.execute(batch))
            check_invariants(sched, runner)
            steps.append((view, [seqs.index(s) for s in finished], sched.num_preemptions,
                          bm.peak_used_blocks, list(bm.free_queue), dict(bm.cached)))
            step += 1
            assert step < 5000
        runs.append((steps, [(s.token_ids, s.finish_reason, s.stop_reason) for s in seqs]))
    assert runs[0] == runs[1]
