"""The CPU's threads (nanokv/cpu_threads.py): NANOKV_NUM_THREADS sets the count of torch's ops
and the C kernels' pool alike, a bad value is refused naming the variable, and `import nanokv`
makes torch's OpenMP idle threads sleep instead of busy-waiting (checked in subprocesses, since
OpenMP reads its settings once, when the process loads it). The pool itself:
tests/kernels/test_pool.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nanokv import cpu_threads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_NUM_THREADS", cpu_threads.NUM_THREADS_ENV)}
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    return dict(env, **extra)


def run(code: str, **extra: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(**extra), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.parametrize("value,expected", [(None, None), ("", None), ("3", 3), (" 1 ", 1)])
def test_num_threads_reads_the_variable(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(cpu_threads.NUM_THREADS_ENV, raising=False)
    else:
        monkeypatch.setenv(cpu_threads.NUM_THREADS_ENV, value)
    assert cpu_threads.num_threads() == expected


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5", "auto"])
def test_a_bad_thread_count_is_refused_naming_the_variable(monkeypatch, model_dir, value):
    monkeypatch.setenv(cpu_threads.NUM_THREADS_ENV, value)
    with pytest.raises(ValueError, match=f"NANOKV_NUM_THREADS='{value}'.*at least 1"):
        cpu_threads.num_threads()
    from nanokv import LLM

    with pytest.raises(ValueError, match="NANOKV_NUM_THREADS"):  # at engine start, before the model loads
        LLM(model_dir, max_model_len=64, kv_cache_memory_bytes=4 << 20)


def test_num_threads_sets_torch_and_the_kernels(model_dir):
    """A count no machine defaults to (one more than its cores) reaches torch's ops and the
    C kernels' parallel regions once an engine starts."""
    n = (os.cpu_count() or 1) + 1
    out = run(
        "import sys\n"
        "from nanokv import LLM, SamplingParams\n"
        "import torch\n"
        "from nanokv.kernels import ffi\n"
        "before = torch.get_num_threads()\n"
        f"llm = LLM({model_dir!r}, max_model_len=64, kv_cache_memory_bytes=4 << 20)\n"
        "llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)\n"
        "print(before, torch.get_num_threads(), ffi.lib().nk_threads() if ffi.available() else 'none')\n",
        NANOKV_NUM_THREADS=str(n))
    before, torch_threads, kernel_threads = out.stdout.split()
    assert int(before) != n and int(torch_threads) == n
    assert kernel_threads in (str(n), "none")


DISPLAY = ("import nanokv\n"
           "import torch\n"
           "from nanokv.kernels import ffi\n"
           "torch.ones(64, 64) @ torch.ones(64, 64)\n"
           "ffi.available()\n")


def spin_counts(stderr: str) -> list[str]:
    """GOMP_SPINCOUNT of every OpenMP runtime the process loaded (OMP_DISPLAY_ENV prints a
    block per runtime when it starts)."""
    return [line.split("=", 1)[1].strip().strip("'") for line in stderr.splitlines()
            if line.strip().startswith("GOMP_SPINCOUNT")]


def test_import_nanokv_makes_idle_threads_sleep():
    counts = spin_counts(run(DISPLAY, OMP_DISPLAY_ENV="VERBOSE").stderr)
    assert counts and set(counts) == {str(cpu_threads.SPIN_COUNT)}


def test_a_wait_setting_of_the_user_is_kept():
    counts = spin_counts(run(DISPLAY, OMP_DISPLAY_ENV="VERBOSE", GOMP_SPINCOUNT="1234").stderr)
    assert counts and set(counts) == {"1234"}
    counts = spin_counts(run(DISPLAY, OMP_DISPLAY_ENV="VERBOSE", OMP_WAIT_POLICY="ACTIVE").stderr)
    assert counts and str(cpu_threads.SPIN_COUNT) not in counts


def test_torch_imported_first_is_told():
    """torch's OpenMP started before nanokv could set the wait: an engine with several
    threads says so (once); with nanokv imported first it does not."""
    code = ("import logging\n"
            "logging.basicConfig()\n"
            "{first}\n"
            "from nanokv import cpu_threads\n"
            "cpu_threads.configure()\n"
            "cpu_threads.configure()\n")
    late = run(code.format(first="import torch"), NANOKV_NUM_THREADS="2").stderr
    assert late.count("torch was imported before nanokv") == 1 and "GOMP_SPINCOUNT=0" in late
    early = run(code.format(first="import nanokv, torch"), NANOKV_NUM_THREADS="2").stderr
    assert "torch was imported before nanokv" not in early


CHILD_SEES = ("import os, subprocess\n"
              "{first}\n"
              "from nanokv import cpu_threads\n"
              "before = os.environ.get('GOMP_SPINCOUNT', 'unset')\n"
              "cpu_threads.{call}\n"
              "child = subprocess.run(['sh', '-c', 'echo ${{GOMP_SPINCOUNT-unset}}'], capture_output=True, text=True)\n"
              "print(before, child.stdout.strip())\n")


@pytest.mark.parametrize("first,call,user,expected", [
    ("import nanokv, torch", "configure()", None, "0 unset"),  # an engine started: the setting is taken out
    ("import nanokv, torch", "restore_environ()", None, "0 unset"),  # bench.py before its peers
    ("import nanokv", "restore_environ()", None, "0 0"),  # torch not loaded yet: OpenMP has not read it
    ("import nanokv, torch", "configure()", "1234", "1234 1234"),  # the user's own value stays
])
def test_programs_started_later_get_the_users_environment(first, call, user, expected):
    """nanokv's GOMP_SPINCOUNT is for its own process: once torch has loaded OpenMP, programs
    it starts (llama.cpp in bench.py, a user's OpenMP tool) inherit the environment as given."""
    extra = {} if user is None else {"GOMP_SPINCOUNT": user}
    out = run(CHILD_SEES.format(first=first, call=call), **extra)
    assert out.stdout.split() == expected.split()
