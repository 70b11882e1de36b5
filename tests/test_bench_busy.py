"""bench.py --busy N: N CPU-bound processes run beside the engines and are always stopped
(when the run ends, fails or is interrupted, and on their own when bench.py is gone)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
try:
    from benchmarks.busy import HOG, busy  # noqa: E402
finally:
    sys.path.remove(ROOT)


def is_hog(pid: int) -> bool:
    """pid is a live (not a zombie) hog process: its command line holds the hog's code."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return HOG.encode() in f.read()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def wait_gone(pids: list[int], limit_s: float = 60) -> list[int]:
    """The pids still running hogs after waiting (bounded) for them to end."""
    deadline = time.monotonic() + limit_s
    while any(is_hog(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if is_hog(p)]


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        utime, stime = f.read().rsplit(")", 1)[1].split()[11:13]
    return (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")


def test_hogs_run_and_are_stopped_when_the_body_fails():
    with pytest.raises(KeyboardInterrupt):
        with busy(2) as pids:
            assert len(pids) == 2 and all(is_hog(p) for p in pids)
            deadline = time.monotonic() + 60  # each burns CPU (bounded wait for the first tick)
            while min(cpu_seconds(p) for p in pids) == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert min(cpu_seconds(p) for p in pids) > 0
            raise KeyboardInterrupt  # Ctrl-C in the middle of a run
    assert not any(is_hog(p) for p in pids)  # stopped and reaped on the way out
    with busy(0) as none:
        assert none == []


def test_hogs_end_by_themselves():
    """Bounded in time, and gone with bench.py even when it is killed (no cleanup ran)."""
    with busy(1, limit_s=0.5) as pids:
        assert wait_gone(pids) == []
    parent = subprocess.Popen([sys.executable, "-c",
                               "import os, sys\n"
                               f"sys.path.insert(0, {ROOT!r})\n"
                               "from benchmarks.busy import busy\n"
                               "with busy(2) as pids:\n"
                               "    print(*pids, flush=True)\n"
                               "    os.kill(os.getpid(), 9)\n"], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in parent.stdout.readline().split()]
    parent.wait(timeout=60)
    parent.stdout.close()
    assert parent.returncode == -signal.SIGKILL and len(pids) == 2
    assert wait_gone(pids) == []


@pytest.mark.slow
def test_bench_busy_reports_and_leaves_no_process(model_dir):
    out = subprocess.run([sys.executable, "bench.py", "--workload", "tiny", "--model", model_dir, "--engines",
                          "nanokv", "--repeats", "1", "--busy", "2", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["busy"] == 2
    said = re.search(r"2 CPU-bound processes running beside every engine \(--busy 2, pids (\d+) (\d+)\)",
                     out.stderr)
    assert said, out.stderr[-2000:]
    assert not any(is_hog(int(p)) for p in said.groups())
    bad = subprocess.run([sys.executable, "bench.py", "--busy", "-1"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert bad.returncode == 2 and "--busy -1: give 0 or more processes" in bad.stderr


@pytest.mark.slow  # engines in new processes
@pytest.mark.parametrize("mode", [["--startup"], ["--latency", "--quantization", "none", "--prefill-lens", "40"]])
def test_startup_and_latency_run_beside_the_hogs_too(model_dir, mode):
    env = dict(os.environ, NANOKV_CPU_KERNELS="0") if mode[0] == "--startup" else None  # no compile: short
    out = subprocess.run([sys.executable, "bench.py", *mode, "--model", model_dir, "--repeats", "1", "--busy", "1",
                          "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["busy"] == 1
    said = re.search(r"1 CPU-bound processes running beside every engine \(--busy 1, pids (\d+)\)", out.stderr)
    assert said, out.stderr[-2000:]
    assert not is_hog(int(said.group(1)))
