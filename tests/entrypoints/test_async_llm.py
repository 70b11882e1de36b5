"""AsyncLLM in process: deltas add up to LLM.generate's output, concurrent requests do not
mix, leaving a stream early frees its blocks before the next step, max_waiting bounds the
queue, a failed step fails only what was in the engine and the loop goes on, a dead
engine fails everything and refuses new work. Every engine call runs on one thread."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading

import pytest

from nanokv import LLM, RequestOutputKind, SamplingParams
from nanokv.async_llm import AsyncLLM, QueueFullError
from nanokv.engine.types import EngineDeadError
from nanokv.llm_engine import LLMEngine

PROMPTS = ["Hello there", "The capital of France is", "def f(x):", "Once upon a time"]
GREEDY = SamplingParams(temperature=0, max_tokens=12)


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(model_dir, max_model_len=256)


def make_llm(offline, **kwargs) -> AsyncLLM:
    """An AsyncLLM over a fresh engine (same model and tokenizer as `offline`)."""
    engine = LLMEngine(offline.llm_engine.config, tokenizer=offline.get_tokenizer())
    return AsyncLLM(engine, **kwargs)


async def collect(llm: AsyncLLM, prompt, params) -> tuple[list[str], list[list[int]], list[str]]:
    n = params.n
    texts, ids, reasons = [""] * n, [[] for _ in range(n)], [None] * n
    async for out in llm.generate(prompt, dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)):
        for c in out.outputs:
            texts[c.index] += c.text
            ids[c.index] += c.token_ids
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    return texts, ids, reasons


def test_deltas_equal_offline_generate_and_requests_do_not_mix(offline):
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=12, n=2)
    expected = {p: offline.generate([p], params, use_tqdm=False)[0]
                for p in PROMPTS for params in (GREEDY,)}
    expected_seeded = offline.generate(PROMPTS, seeded, use_tqdm=False)
    llm = make_llm(offline)

    async def main():
        greedy = await asyncio.gather(*(collect(llm, p, GREEDY) for p in PROMPTS))
        sampled = await asyncio.gather(*(collect(llm, p, seeded) for p in PROMPTS))
        snap = await llm.snapshot()
        llm.shutdown()
        return greedy, sampled, snap

    greedy, sampled, snap = run(main())
    for p, (texts, ids, reasons) in zip(PROMPTS, greedy):
        ref = expected[p].outputs[0]
        assert (texts[0], ids[0], reasons[0]) == (ref.text, ref.token_ids, ref.finish_reason)
    for ref, (texts, ids, _) in zip(expected_seeded, sampled):
        assert texts == [c.text for c in ref.outputs] and ids == [c.token_ids for c in ref.outputs]
    assert (snap.num_running, snap.num_waiting, snap.kv.used_blocks) == (0, 0, 0)


def test_every_engine_call_runs_on_the_engine_thread(offline):
    llm = make_llm(offline)
    threads = set()
    for name in ("enqueue", "advance", "abort", "kv_stats"):
        original = getattr(llm.engine, name)

        def spy(*args, _original=original, **kwargs):
            threads.add(threading.current_thread().name)
            return _original(*args, **kwargs)

        setattr(llm.engine, name, spy)

    async def main():
        await collect(llm, PROMPTS[0], GREEDY)
        async with contextlib.aclosing(llm.generate(PROMPTS[1], SamplingParams(max_tokens=50, ignore_eos=True))) as g:
            async for _ in g:
                break  # abort
        await llm.snapshot()
        llm.shutdown()

    run(main())
    assert threads == {"nanokv-engine"}


def test_leaving_a_stream_early_aborts_and_frees_the_blocks(offline):
    llm = make_llm(offline)

    async def main():
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        seen = 0
        async with contextlib.aclosing(llm.generate(PROMPTS[0], long)) as deltas:
            async for out in deltas:
                seen += len(out.outputs[0].token_ids)
                if seen >= 3:
                    break
        busy = await llm.snapshot()  # the abort is applied before the engine's next step
        other = await collect(llm, PROMPTS[1], GREEDY)  # the engine goes on serving
        idle = await llm.snapshot()
        llm.shutdown()
        return busy, other, idle

    busy, other, idle = run(main())
    assert (busy.num_running, busy.num_waiting, busy.kv.used_blocks) == (0, 0, 0)
    assert other[2] == ["length"] or other[2] == ["stop"]
    assert (idle.num_running, idle.kv.used_blocks) == (0, 0)


def test_bad_request_raises_in_the_caller_and_queues_nothing(offline):
    llm = make_llm(offline)

    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            llm.make_request(list(range(4, 300)), GREEDY)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.make_request([5, 10**6], GREEDY)
        snap = await llm.snapshot()
        llm.shutdown()
        return snap

    snap = run(main())
    assert (snap.num_running, snap.num_waiting, snap.kv.prefix_query_tokens) == (0, 0, 0)


def test_max_waiting_bounds_the_queue(offline):
    config = dataclasses.replace(offline.llm_engine.config, max_num_seqs=1)
    engine = LLMEngine(config, tokenizer=offline.get_tokenizer())
    llm = AsyncLLM(engine, max_waiting=2)
    long = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)

    async def main():
        running = llm.add([llm.make_request(PROMPTS[0], long)])
        await running.next_outputs()  # admitted: it runs, and the one seat is taken
        waiting = llm.add([llm.make_request(PROMPTS[1], long)])
        with pytest.raises(ValueError, match="more than the 2"):
            llm.add([llm.make_request(PROMPTS[2], SamplingParams(n=3))])
        with pytest.raises(QueueFullError, match="retry later"):
            llm.add([llm.make_request(PROMPTS[2], SamplingParams(n=2))])
        third = llm.add([llm.make_request(PROMPTS[2], GREEDY)])  # 1 + 1 fits
        snap = await llm.snapshot()
        for stream in (running, waiting, third):
            stream.close()
        after = await llm.snapshot()
        llm.shutdown()
        return snap, after

    snap, after = run(main())
    assert (snap.num_running, snap.num_waiting) == (1, 2)
    assert (after.num_running, after.num_waiting, after.kv.used_blocks) == (0, 0, 0)


def test_a_failed_step_fails_what_ran_and_the_loop_goes_on(offline):
    llm = make_llm(offline)
    advance = llm.engine.advance
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        advance()

    llm.engine.advance = flaky

    async def main():
        stream = llm.add([llm.make_request(p, GREEDY) for p in PROMPTS[:2]])
        outputs = []
        while batch := await stream.next_outputs():
            outputs += batch
        after = await collect(llm, PROMPTS[2], GREEDY)
        snap = await llm.snapshot()
        alive = llm.is_alive
        llm.shutdown()
        return outputs, after, snap, alive

    outputs, after, snap, alive = run(main())
    errors = [o for o in outputs if o.error is not None]
    assert len(errors) == 2 and all("boom" in o.error and o.finished for o in errors)
    ref = offline.generate([PROMPTS[2]], GREEDY, use_tqdm=False)[0].outputs[0]
    assert after[0] == [ref.text] and alive
    assert (snap.num_running, snap.kv.used_blocks) == (0, 0)


def test_a_dead_engine_fails_everything_and_refuses_new_work(offline):
    llm = make_llm(offline)

    def dead():
        raise EngineDeadError("worker 1 died")

    llm.engine.advance = dead

    async def main():
        stream = llm.add([llm.make_request(PROMPTS[0], GREEDY)])
        with pytest.raises(EngineDeadError, match="worker 1 died"):
            await stream.next_outputs()
        for _ in range(100):
            if not llm.is_alive:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(EngineDeadError, match="worker 1 died"):
            llm.make_request(PROMPTS[0], GREEDY)
        snap = await llm.snapshot()  # read directly: nobody steps the engine
        llm.shutdown()
        return snap

    snap = run(main())
    assert not llm.is_alive and "worker 1 died" in llm.dead_reason
    assert snap.kv.used_blocks == 0
