"""bench.py --startup: how long an engine takes to be ready, and its peak memory getting there.

- nanokv `LLM(model)` (default settings) in a fresh Python process, cold (an empty temporary
  NANOKV_CACHE_DIR: the C kernels are compiled, the GGUF's config, tokenizer and packed
  weights derived and cached, as on a first ever run) and then warm (`--repeats` more
  processes on that cache); each reports its import and load seconds and its peak RSS
  (ru_maxrss).
- `nanokv serve` on the warm cache: seconds from the process' start until GET /health
  answers 200, and its peak RSS (ru_maxrss, read from its exit status).
- llama.cpp's `llama-server` on the GGUF itself (when --llama-server or a local build or
  PATH gives one, and the model is a GGUF): the same two numbers.

Every process is bounded in time, runs on 127.0.0.1 and is stopped at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 600.0  # seconds any one start may take (a cold start compiles the C kernels)

# run in the child: import seconds, LLM(...) seconds, peak RSS bytes (one JSON line)
_LOAD = r"""
import json, resource, sys, time
start = time.perf_counter()
from nanokv import LLM
imported = time.perf_counter()
llm = LLM(sys.argv[1])
loaded = time.perf_counter()
print(json.dumps({"import_seconds": imported - start, "load_seconds": loaded - imported,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def child_env(cache_dir: str | None) -> dict:
    """The environment of a benchmarked child: this tree's nanokv, `cache_dir` as its cache
    root (None: the one the user's environment names)."""
    env = dict(os.environ) if cache_dir is None else dict(os.environ, NANOKV_CACHE_DIR=cache_dir)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))  # this tree's nanokv
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def load_once(model: str, cache_dir: str, timeout: float = TIMEOUT) -> dict:
    """One `LLM(model)` in a new process: its import/load seconds, the process' whole wall
    time (interpreter start and exit included) and its peak RSS."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _LOAD, model], env=child_env(cache_dir), capture_output=True,
                          text=True, timeout=timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"LLM({model!r}) failed in a new process:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_seconds"] = wall
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_ready(cmd: list[str], port: int, env: dict | None = None, log_path: str | None = None,
                timeout: float = TIMEOUT) -> dict:
    """Start a server, time it until GET /health answers 200, stop it (SIGTERM, then
    SIGKILL after 30 s) and read its peak RSS from its exit status (os.wait4)."""
    import urllib.error
    import urllib.request

    log = open(log_path or os.devnull, "wb")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    ready = None
    try:
        deadline = start + timeout
        while time.perf_counter() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        ready = time.perf_counter() - start
                        break
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.05)
    finally:
        rusage = _stop(proc)
        log.close()
    if ready is None:
        raise RuntimeError(f"{os.path.basename(cmd[0])} did not answer /health within {timeout:.0f} s"
                           + (f" (log: {log_path})" if log_path else ""))
    return {"ready_seconds": ready, "peak_rss_bytes": rusage.ru_maxrss * 1024 if rusage else None}


def _stop(proc: subprocess.Popen):
    """Stop the server's process group; the server's own resource usage (None when it
    was reaped elsewhere)."""
    for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                pid, status, rusage = os.wait4(proc.pid, os.WNOHANG)
            except ChildProcessError:
                return None
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                return rusage
            time.sleep(0.05)
    return None


def nanokv_serve_command(model: str, port: int) -> list[str]:
    return [sys.executable, "-m", "nanokv", "serve", model, "--host", "127.0.0.1", "--port", str(port),
            "--uvicorn-log-level", "warning"]


def llama_server_command(binary: str, gguf: str, port: int) -> list[str]:
    return [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "--no-webui"]


def model_gguf(model: str) -> str | None:
    """The GGUF file a model name or path stands for (llama.cpp loads only those)."""
    from nanokv.gguf import find_gguf, resolve_model

    try:
        return find_gguf(resolve_model(model))
    except ValueError:
        return None


def run_startup(model: str, label: str, warm_runs: int = 1, llama_server: str | None = None,
                timeout: float = TIMEOUT) -> dict:
    """Every measurement of the module docstring: a JSON-ready dict."""
    from benchmarks.peers.llamacpp import llamacpp_binary

    report = {"model": label, "nanokv": {}}
    with tempfile.TemporaryDirectory(prefix="nanokv-startup-") as scratch:
        cache = os.path.join(scratch, "cache")
        os.mkdir(cache)
        nk = report["nanokv"]
        nk["cold"] = load_once(model, cache, timeout)
        nk["warm"] = [load_once(model, cache, timeout) for _ in range(max(1, warm_runs))]
        port = free_port()
        nk["serve"] = serve_ready(nanokv_serve_command(model, port), port, child_env(cache),
                                  os.path.join(scratch, "nanokv-serve.log"), timeout)
        report["llama.cpp"] = llama_cpp_startup(llama_server or llamacpp_binary("llama-server"),
                                                model_gguf(model), scratch, timeout)
    return report


def llama_cpp_startup(binary: str | None, gguf: str | None, log_dir: str, timeout: float = TIMEOUT) -> dict:
    """{"serve": llama-server's ready seconds and peak RSS}, or {"missing": why not}."""
    if binary is None:
        return {"missing": "no llama-server (give --llama-server, or build llama.cpp)"}
    if gguf is None:
        return {"missing": "llama-server loads GGUF files: give --model a .gguf or smollm2"}
    port = free_port()
    return {"serve": serve_ready(llama_server_command(binary, gguf, port), port,
                                 log_path=os.path.join(log_dir, "llama-server.log"), timeout=timeout)}


def _gb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f} GB"


def print_startup(report: dict) -> None:
    nk = report["nanokv"]
    best = min(nk["warm"], key=lambda r: r["load_seconds"])
    rows = [("nanokv", "LLM() cold (empty cache)", nk["cold"]), ("nanokv", "LLM() warm", best)]
    print(f"Start-up: {report['model']}\n")
    print("| engine | start | import s | load s | process s | peak RSS |")
    print("|---|---|---|---|---|---|")
    for engine, what, r in rows:
        print(f"| {engine} | {what} | {r['import_seconds']:.2f} | {r['load_seconds']:.2f} | "
              f"{r['process_seconds']:.2f} | {_gb(r['peak_rss_bytes'])} |")
    print("\n| engine | server | ready s (until /health) | peak RSS |")
    print("|---|---|---|---|")
    s = nk["serve"]
    print(f"| nanokv | nanokv serve (warm) | {s['ready_seconds']:.2f} | {_gb(s['peak_rss_bytes'])} |")
    llama = report["llama.cpp"]
    if "serve" in llama:
        s = llama["serve"]
        print(f"| llama.cpp | llama-server | {s['ready_seconds']:.2f} | {_gb(s['peak_rss_bytes'])} |")
    else:
        print(f"| llama.cpp | {llama['missing']} | - | - |")
    if len(nk["warm"]) > 1:
        loads = ", ".join(f"{r['load_seconds']:.2f}" for r in nk["warm"])
        print(f"\nwarm loads: {loads} s (the fastest above)")


def main(args) -> None:
    """bench.py --startup with bench.py's parsed arguments (--model or --shape, --repeats,
    --llama-server, --json)."""
    model, label = model_and_label(args)
    emit(run_startup(model, label, args.repeats, args.llama_server), args, print_startup)


def model_and_label(args) -> tuple[str, str]:
    """The model a --startup / --latency run loads (--model, or --shape's random weights) and its name."""
    if args.shape:
        from nanokv.testing.tiny import cached_tiny_checkpoint

        return cached_tiny_checkpoint(args.shape), f"random {args.shape}"
    return args.model, args.model


def emit(report: dict, args, print_table) -> None:
    """A --startup / --latency report: JSON with --json, else its tables; with --busy N said."""
    report["busy"] = args.busy  # CPU-bound processes beside every engine
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print_table(report)
    if args.busy:
        print(f"\n{args.busy} CPU-bound processes ran beside every engine (--busy {args.busy})")
