"""One LLM called from several threads at once: never a crash, and every call gets exactly
the outputs it gets alone. The threads run in a child process, so that a crash (heap
corruption from two threads stepping one engine) fails the test instead of pytest."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent(r'''
    import os, sys, threading, time
    import torch
    torch.set_num_threads(1)
    from nanokv import LLM, SamplingParams

    model_dir, rounds = sys.argv[1], int(sys.argv[2])
    llm = LLM(model_dir, max_model_len=256, kv_cache_memory_bytes=64 << 20)
    engine = llm.llm_engine
    g = torch.Generator().manual_seed(5)

    def prompts(*lengths):
        return [torch.randint(4, 1024, (n,), generator=g).tolist() for n in lengths]

    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=11, n=2, max_tokens=16, ignore_eos=True)
    stop = SamplingParams(temperature=0, max_tokens=24, stop=["a"], ignore_eos=True)
    shared = prompts(40)[0]  # a prefix two callers share: one computes it, the other may hit

    def tokens(outs):
        return [[(c.finish_reason, c.token_ids) for c in o.outputs] for o in outs]

    def generate(ps, params):
        return lambda: tokens(llm.generate(ps, params, use_tqdm=False))

    def stream(p, params):
        return lambda: "".join(llm.stream(p, params))

    def step_api(ps, params):  # the engine's own step API, from its own thread
        def run():
            ids = [engine.add_request(p, params) for p in ps]
            done = {}
            for _ in range(10_000):
                for out in engine.step():
                    done[out.request_id] = out
                if len(done) == len(ids):
                    break
            return tokens([done[i] for i in ids])
        return run

    calls = [
        generate(prompts(5, 33, 17), greedy),
        generate([shared + p for p in prompts(3, 9)], seeded),
        generate([shared + p for p in prompts(12)] + prompts(7, 2), stop),
        stream(prompts(21)[0], greedy),
        step_api(prompts(8, 14), greedy),
    ]
    alone = [call() for call in calls]
    failures = []
    start = time.monotonic()
    for r in range(rounds):
        if time.monotonic() - start > 240:
            break
        results = [None] * len(calls)
        barrier = threading.Barrier(len(calls), timeout=60)

        def work(i):
            barrier.wait()
            try:
                results[i] = calls[i]()
            except Exception as e:
                results[i] = repr(e)

        threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(calls))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        for t in threads:
            t.join(max(deadline - time.monotonic(), 0))
        if any(t.is_alive() for t in threads):
            print(f"round {r}: a call did not return within 120 s", flush=True)
            os._exit(3)
        failures += [(r, i, results[i]) for i in range(len(calls)) if results[i] != alone[i]]
        if engine.has_unfinished() or engine.kv_stats().used_blocks:
            failures.append((r, "engine not clean"))

    # close() from another thread while one generates: that call raises, nothing crashes
    outcome = []
    def long_generate():
        try:
            outcome.append(len(llm.generate(prompts(30), SamplingParams(temperature=0, max_tokens=200,
                                                                        ignore_eos=True), use_tqdm=False)))
        except RuntimeError as e:
            outcome.append(str(e))
    t = threading.Thread(target=long_generate, daemon=True)
    t.start()
    for _ in range(6000):  # until it holds KV blocks (at most 60 s)
        if llm.kv_stats().used_blocks or not t.is_alive():
            break
        time.sleep(0.01)
    llm.close()
    t.join(120)
    if t.is_alive() or not (outcome == [1] or "closed" in outcome[0]):
        failures.append(("close", outcome))
    try:
        llm.generate("x", greedy, use_tqdm=False)
        failures.append(("generate after close ran",))
    except RuntimeError:
        pass
    for f in failures[:5]:
        print("MISMATCH", repr(f)[:600], flush=True)
    print("rounds", r + 1, "failures", len(failures), flush=True)
    os._exit(1 if failures else 0)
''')


@pytest.mark.slow
def test_threads_calling_one_llm_each_get_their_own_outputs(model_dir):
    """Five threads at once on one LLM, a few rounds: three generate() calls (greedy,
    seeded n=2 sharing a prefix, stop strings), a stream() and the engine's step API; each
    gets what it gets alone. Then close() from another thread while one generates."""
    try:
        child = subprocess.run([sys.executable, "-c", CHILD, model_dir, "6"],
                               capture_output=True, text=True, timeout=400)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the child hung for {e.timeout} s:\n{(e.stdout or b'')[-2000:]!r}")
    tail = (child.stdout + child.stderr)[-3000:]
    assert child.returncode == 0, f"exit {child.returncode}:\n{tail}"


class _HandOffLock:
    """The engine's RLock, running `between` once, the first time its holder lets it go
    entirely after `armed` is set: what another thread waiting on the lock does there."""

    def __init__(self, lock):
        self._lock, self._depth, self.armed, self.between = lock, 0, False, None

    def __enter__(self):
        self._lock.acquire()
        self._depth += 1
        return self

    def __exit__(self, *exc):
        self._depth -= 1
        self._lock.release()
        if self._depth == 0 and self.armed and self.between is not None:
            between, self.between = self.between, None
            between()


def test_an_id_generate_made_is_not_taken_by_another_caller_before_it_is_queued(model_dir):
    """generate() made its requests (ids from the engine's counter) under the lock, let it
    go, and queued them under it again: another thread's add_request with one of those ids
    in between made generate raise "already in use", and its cleanup aborted the other
    thread's request. The ids are made and queued in one hold: the other caller is told the
    id is in use, and generate returns what it returns alone."""
    from nanokv import LLM, SamplingParams

    llm = LLM(model_dir, max_model_len=256, kv_cache_memory_bytes=16 << 20)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    made, other = [], []
    real_make = engine.make_request

    def make(*args, **kwargs):
        req = real_make(*args, **kwargs)
        made.append(req.request_id)
        lock.armed = True
        return req

    def other_thread_adds():
        try:
            other.append(engine.add_request([12, 13, 14], params, request_id=made[-1]))
        except ValueError as e:
            other.append(str(e))

    lock = _HandOffLock(engine.lock)
    lock.between = other_thread_adds
    engine.lock = llm._lock = lock
    engine.make_request = make
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == alone
    assert len(other) == 1 and "already in use" in other[0]
    assert not engine.has_unfinished()


@pytest.mark.parametrize("call", ["generate", "stream"])
def test_a_request_another_caller_aborts_ends_the_call_instead_of_hanging_it(model_dir, call):
    """Another thread's llm_engine.abort() of one of a call's requests: the call raises
    RuntimeError naming it (it waited forever, stepping an idle engine). The abort is made
    right after the call's first step, as a thread waiting on the lock would make it."""
    import threading

    from nanokv import LLM, SamplingParams

    llm = LLM(model_dir, max_model_len=256, kv_cache_memory_bytes=16 << 20)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    made, outcome = [], []
    real_make, real_advance = engine.make_request, engine.advance

    def make(*args, **kwargs):
        req = real_make(*args, **kwargs)
        made.append(req.request_id)
        return req

    def advance():
        real_advance()
        if made and engine.has_request(made[0]):
            engine.abort(made[0])

    engine.make_request, engine.advance = make, advance

    def run():
        try:
            if call == "generate":
                llm.generate([[5, 6, 7, 8], [9, 10, 11]], params, use_tqdm=False)
            else:
                "".join(llm.stream([5, 6, 7, 8], params))
            outcome.append("returned")
        except RuntimeError as e:
            outcome.append(str(e))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    hung = t.is_alive()
    llm.close()  # a hung call's next step then raises: the thread ends
    t.join(60)
    assert not hung, "the call waited for a request another caller aborted"
    assert len(outcome) == 1 and made[0] in outcome[0] and "aborted by another caller" in outcome[0]
    assert not engine.has_unfinished()
