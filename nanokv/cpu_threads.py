"""The CPU's threads: how many (NANOKV_NUM_THREADS) and how they wait between parallel regions.

The C kernels run their parallel regions on their own pool (kernels/csrc/pool.c: idle
workers spin briefly, then sleep, and a region never waits for a worker the machine has
not scheduled); torch's ops run theirs on OpenMP (GNU libgomp), whose idle threads
busy-wait for the next region by default for GOMP_SPINCOUNT rounds (300,000, several
milliseconds): through the Python work of each step and through the kernels' regions, so
on a machine whose cores are shared they take the cores from the threads with work (CPU
time per token grew 3-50x). So `import nanokv` sets GOMP_SPINCOUNT to SPIN_COUNT (an idle
OpenMP thread sleeps at once: torch's ops are a small part of a step on the kernels' path,
and a wake-up per op of theirs cost less than a spin that competes with the kernels' threads,
measured in docs/benchmarks.md) unless the user set it or OMP_WAIT_POLICY: libgomp reads
them once, when it is loaded (by `import torch`), so this must happen before torch is
imported; an engine started after torch was imported first says so once (see configure).

This module imports no torch: `import nanokv` stays light.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

logger = logging.getLogger("nanokv")

NUM_THREADS_ENV = "NANOKV_NUM_THREADS"  # threads of torch's ops and the C kernels; unset: one per core
SPIN_COUNT = 0  # GOMP_SPINCOUNT nanokv sets: rounds a thread with no work spins before it sleeps
WAIT_ENV = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")  # the user's own wait setting, left as it is

_runtime_started_first = False  # torch (its OpenMP runtime) was imported before nanokv set the wait
_warned = False


_ours: str | None = None  # the GOMP_SPINCOUNT value nanokv put into os.environ, until it takes it out


def prepare_runtime() -> None:
    """Called by `import nanokv` before anything imports torch: the wait setting for
    OpenMP (see the module's doc). A user's GOMP_SPINCOUNT or OMP_WAIT_POLICY wins."""
    global _runtime_started_first, _ours
    if any(name in os.environ for name in WAIT_ENV):
        return
    os.environ["GOMP_SPINCOUNT"] = _ours = str(SPIN_COUNT)
    _runtime_started_first = "torch" in sys.modules


def restore_environ() -> None:
    """Take nanokv's GOMP_SPINCOUNT back out of os.environ once torch is imported (libgomp
    has read it then), so that the programs this process starts (an OpenMP program such as
    llama.cpp, whose threads sleeping between regions would slow it down) inherit the
    environment the user gave. Called when an engine starts (configure) and by bench.py
    before it starts peers; a value someone else set since is left alone."""
    global _ours
    if _ours is None or "torch" not in sys.modules:
        return
    if os.environ.get("GOMP_SPINCOUNT") == _ours:
        del os.environ["GOMP_SPINCOUNT"]
    _ours = None


def num_threads() -> int | None:
    """NANOKV_NUM_THREADS as a count (read on every call); None when unset or empty (torch's
    default: one thread per core it may run on)."""
    value = os.environ.get(NUM_THREADS_ENV, "").strip()
    if not value:
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{NUM_THREADS_ENV}={value!r}: give a whole number of threads, at least 1 "
                         f"(such as {NUM_THREADS_ENV}=2), or unset it for one per core")
    return n


def configure(share: int = 1) -> int:
    """Apply NANOKV_NUM_THREADS to torch (the C kernels' pool follows torch's count: kernels/ffi.py)
    and return the count; `share` processes (tensor-parallel ranks) split the cores, each
    taking its part. ValueError for a bad NANOKV_NUM_THREADS."""
    import torch

    global _warned
    restore_environ()
    n = num_threads() or torch.get_num_threads()
    n = max(1, n // share) if share > 1 else n
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    if _runtime_started_first and n > 1 and not _warned:  # one thread: no pool to spin
        _warned = True
        logger.warning("torch was imported before nanokv, so its OpenMP threads busy-wait between parallel regions "
                       "(libgomp's default), which slows nanokv on a machine whose cores are busy: import nanokv "
                       "before torch, or set GOMP_SPINCOUNT=%d in the environment", SPIN_COUNT)
    return n


@contextlib.contextmanager
def one_thread():
    """torch's CPU ops, and the C kernels (which follow torch's count), on one thread inside
    the block; the count is process-wide, so it is given back after. For work where a second
    thread gains little and, on a busy machine, waits for a descheduled one: a greedy step
    over a small vocabulary, memory-bound weight conversion, timing one core."""
    import torch

    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
