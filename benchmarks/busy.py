"""bench.py --busy N: N CPU-bound processes running beside the engines, as on a machine
whose cores other work shares. Each is bounded: it stops after BUSY_LIMIT_S, or as soon as
bench.py is gone (its parent changes), and busy() stops them all when the run ends, by
error or Ctrl-C too."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

BUSY_LIMIT_S = 3600  # the longest a hog runs even if nothing stops it

# a plain busy loop; every few milliseconds it checks its clock and that its parent (given: it may
# be gone before the hog starts) is still there
HOG = """
import os, sys, time
parent, end = int(sys.argv[2]), time.monotonic() + float(sys.argv[1])
x = 0
while time.monotonic() < end and os.getppid() == parent:
    for _ in range(100_000):
        x += 1
"""


@contextlib.contextmanager
def busy(n: int, limit_s: float = BUSY_LIMIT_S):
    """Run the body with `n` CPU-bound processes beside it (none for n=0); yields their
    process ids and stops them (terminate, then kill) when the body ends, however it ends."""
    if n < 0:
        raise ValueError(f"--busy {n}: give 0 or more processes")
    hogs: list[subprocess.Popen] = []
    try:
        for _ in range(n):
            hogs.append(subprocess.Popen([sys.executable, "-c", HOG, str(limit_s), str(os.getpid())],
                                         stdin=subprocess.DEVNULL))
        yield [p.pid for p in hogs]
    finally:
        for p in hogs:
            p.terminate()
        for p in hogs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
