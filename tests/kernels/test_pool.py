"""The C kernels' thread pool (nanokv/kernels/csrc/pool.c): every chunk of a region runs
exactly once on one of the caller's threads, a region never waits for a worker that has not
shown up, nested and concurrent callers run on their own threads, a forked child starts its
own workers, and model outputs are the same bits for any thread count."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from nanokv import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: CPU kernels not built")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def threads():
    """Sets the kernels' thread count of the calling thread (torch's, as the engine does)."""
    before = torch.get_num_threads()

    def use(n: int):
        torch.set_num_threads(n)
        lib = kernels.ffi.lib()
        assert lib.nk_threads() == n
        return lib

    yield use
    torch.set_num_threads(before)
    kernels.ffi.lib()


def run_regions(lib, n, chunk, regions, inner=0, hold=False):
    runs = torch.zeros(n, dtype=torch.int32)
    tids = torch.full((n,), -1, dtype=torch.int32)
    lib.nk_pool_test(n, chunk, regions, runs.data_ptr(), tids.data_ptr(), inner, int(hold))
    return runs, tids


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("n,chunk", [(1, 1), (2, 1), (7, 1), (64, 3), (1000, 1), (5000, 64), (100, 1000)])
def test_every_item_runs_exactly_once_on_one_of_the_threads(threads, count, n, chunk):
    lib = threads(count)
    runs, tids = run_regions(lib, n, chunk, regions=300)
    assert torch.equal(runs, torch.full((n,), 300, dtype=torch.int32))
    assert int(tids.min()) >= 0 and int(tids.max()) < count  # the caller (0) or one of its count - 1 workers
    assert lib.nk_pool_workers() >= count - 1 or count == 1 or n <= chunk


def test_a_region_finishes_while_its_workers_are_kept_away(threads):
    """Workers that never get a core (held back here) do not stall a region: the caller
    runs every chunk itself and returns."""
    lib = threads(4)
    run_regions(lib, 64, 1, regions=10)  # the workers exist
    assert lib.nk_pool_workers() >= 3
    runs, tids = run_regions(lib, 64, 1, regions=200, hold=True)
    assert torch.equal(runs, torch.full((64,), 200, dtype=torch.int32))
    assert torch.equal(tids, torch.zeros(64, dtype=torch.int32))
    runs, tids = run_regions(lib, 4096, 1, regions=50)  # and they come back afterwards
    assert torch.equal(runs, torch.full((4096,), 50, dtype=torch.int32))


def test_a_region_inside_a_region_runs_on_its_thread(threads):
    lib = threads(3)
    runs, tids = run_regions(lib, 200, 1, regions=50, inner=7)
    assert torch.equal(runs, torch.full((200,), 50 * 8, dtype=torch.int32))


def test_two_callers_at_once(threads):
    """Two Python threads calling the kernels at the same time (ctypes lets go of the GIL):
    one gets the pool, the other runs its regions itself; both get every item once."""
    threads(3)
    results, errors = {}, []

    def caller(name):
        try:
            lib = kernels.ffi.lib()  # torch's count (3), told to the kernels for this thread
            results[name] = run_regions(lib, 500, 2, regions=400)
        except Exception as e:  # reported below
            errors.append(e)

    workers = [threading.Thread(target=caller, args=(i,)) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert not errors and len(results) == 2
    for runs, tids in results.values():
        assert torch.equal(runs, torch.full((500,), 400, dtype=torch.int32))
        assert int(tids.max()) < 3


def test_a_forked_child_starts_its_own_workers():
    code = (
        "import os, torch\n"
        "from nanokv import kernels\n"
        "torch.set_num_threads(3)\n"
        "lib = kernels.ffi.lib()\n"
        "def ok(n):\n"
        "    runs = torch.zeros(n, dtype=torch.int32)\n"
        "    tids = torch.zeros(n, dtype=torch.int32)\n"
        "    lib.nk_pool_test(n, 1, 100, runs.data_ptr(), tids.data_ptr(), 0, 0)\n"
        "    return bool((runs == 100).all())\n"
        "assert ok(256) and lib.nk_pool_workers() == 2\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    started = lib.nk_pool_workers()\n"
        "    os._exit(0 if started == 0 and ok(256) and lib.nk_pool_workers() == 2 else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "assert os.waitstatus_to_exitcode(status) == 0, status\n"
        "assert ok(256)\n"
        "print('done')\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr[-3000:]


def test_model_outputs_do_not_depend_on_the_thread_count(model_dir, threads):
    """Whichever thread runs a chunk computes it the same way: a batch of prompts (prefill
    tiles, decodes, the sampler) gives the same tokens, greedy and seeded, on 1 to 5
    threads. (Logprobs are left out: torch's own ops on them sum in an order that follows
    torch's thread count, with OpenMP as well.)"""
    from nanokv import LLM, SamplingParams

    prompts = [[(7 * i + j) % 1000 + 1 for j in range(n)] for i, n in enumerate([1, 9, 40, 77, 130, 3, 3, 64])]
    greedy = SamplingParams(temperature=0, max_tokens=10)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=10)
    llm = LLM(model_dir, max_model_len=256, kvcache_block_size=8, max_num_batched_tokens=128,
              kv_cache_memory_bytes=16 << 20)
    results = []
    for count in (1, 2, 5):
        threads(count)
        outs = llm.generate(prompts, greedy, use_tqdm=False) + llm.generate(prompts, seeded, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in outs])
    assert results[0] == results[1] == results[2]
