"""llama.cpp as a CPU peer: its binaries (LLAMA_CPP_BIN, a local build, or PATH), the
GGUF model requantized to q8_0 (llama-quantize, or write_q8_0_gguf when that is not built),
and run_llamacpp, which runs it both ways its users run many requests (llama-server's
slots; the C API's batch decode, llamacpp_batch.py) and keeps the faster."""

from __future__ import annotations

import json
import os
import time

import torch

from benchmarks.measure import Result
from benchmarks.workloads import Request


LLAMA_CPP_DIRS = ("/work/llamacpp/build/bin",)  # where a local llama.cpp build may have put its binaries


def llamacpp_binary(name: str) -> str | None:
    """A llama.cpp binary: $LLAMA_CPP_BIN/<name>, a local build's, or one on PATH."""
    import shutil

    for d in filter(None, [os.environ.get("LLAMA_CPP_BIN"), *LLAMA_CPP_DIRS]):
        if os.access(os.path.join(d, name), os.X_OK):
            return os.path.join(d, name)
    return shutil.which(name)


def write_q8_0_gguf(src: str, dst: str) -> None:
    """The GGUF file with every 2-D tensor requantized to q8_0 by the gguf package's
    quantizer (1-D ones, the norms, stay float32) and its metadata copied: what
    `llama-quantize --allow-requantize src dst Q8_0` writes, for when that tool is not built."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # the writer adds these itself
        kind = field.types[0]
        value = int(gguf.LlamaFileType.MOSTLY_Q8_0) if field.name == "general.file_type" else field.contents()
        writer.add_key_value(field.name, value, kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        w = np.asarray(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if w.ndim == 2 and w.shape[-1] % 32 == 0:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(t.name, gguf.quants.quantize(w, q8), raw_dtype=q8)
        else:
            writer.add_tensor(t.name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def q8_0_model(gguf_file: str, scratch: str) -> str:
    """The model requantized to q8_0 in the scratch folder (once per run)."""
    import subprocess

    q8 = os.path.join(scratch, "model-q8_0.gguf")
    if not os.path.isfile(q8):
        if llamacpp_binary("llama-quantize") is not None:
            subprocess.run([llamacpp_binary("llama-quantize"), "--allow-requantize", gguf_file, q8, "Q8_0",
                            str(torch.get_num_threads())], check=True, capture_output=True)
        else:
            write_q8_0_gguf(gguf_file, q8)
    return q8


def run_server(q8: str, reqs: list[Request], parallel: int, sampling: dict | None = None) -> Result:
    """llama-server with `parallel` slots (continuous batching, as nanokv does), set up the
    way its docs advise for throughput on a CPU: flash attention on, a KV buffer per slot
    (not one shared buffer every slot's attention spans), no prompt cache, every thread
    for both prompt and generation; every request posted at once (token ids in, EOS
    ignored), timed from the first request to the last reply."""
    import concurrent.futures
    import socket
    import subprocess
    import urllib.request

    from benchmarks.peers.llamacpp_batch import N_BATCH, N_UBATCH

    threads = str(torch.get_num_threads())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = parallel * max(len(r.prompt) + r.max_tokens for r in reqs)
    server = subprocess.Popen([llamacpp_binary("llama-server"), "-m", q8, "-t", threads, "-tb", threads,
                               "-c", str(ctx), "-np", str(parallel), "-fa", "on", "--no-kv-unified",
                               "-b", str(N_BATCH), "-ub", str(N_UBATCH), "--cache-ram", "0",
                               "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    raise RuntimeError("llama-server did not start") from None
                time.sleep(0.5)

        def post(r: Request) -> int:
            body = dict(prompt=r.prompt, n_predict=r.max_tokens, ignore_eos=True, cache_prompt=False,
                        **(dict(temperature=sampling["temperature"], top_p=sampling["top_p"], seed=r.seed)
                           if sampling else dict(temperature=0, top_k=1)))
            req = urllib.request.Request(url + "/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=3600) as resp:
                return int(json.load(resp)["tokens_predicted"])

        post(Request(reqs[0].prompt[:4], 2))  # warm-up
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
            tokens = sum(pool.map(post, reqs))
        seconds = time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(timeout=30)
    return Result("llama.cpp q8_0", min(tokens, sum(r.max_tokens for r in reqs)), seconds, float("nan"),
                  note=f"llama-server, {parallel} slots, flash attention, {threads} threads")


def batch_api_available() -> bool:
    """llama-cpp-python's low-level module imports (in a subprocess, as it will run)."""
    import subprocess
    import sys

    probe = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True)
    return probe.returncode == 0


def run_batch_api(q8: str, reqs: list[Request], scratch: str, parallel: int, sampling: dict | None = None) -> Result:
    """llama.cpp's batch decode through its C API (benchmarks/peers/llamacpp_batch.py), in a
    subprocess; its peak RSS is that process's."""
    import subprocess
    import sys

    path = os.path.join(scratch, "llamacpp-requests.json")
    with open(path, "w") as f:
        json.dump([dict(prompt=r.prompt, max_tokens=r.max_tokens, seed=r.seed) for r in reqs], f)
    cmd = [sys.executable, "-m", "benchmarks.peers.llamacpp_batch", q8, path, "--slots", str(parallel),
           "--threads", str(torch.get_num_threads())]
    if sampling:
        cmd += ["--sampling", json.dumps(sampling)]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp batch decode failed: {done.stderr[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return Result("llama.cpp q8_0", min(out["tokens"], sum(r.max_tokens for r in reqs)), out["seconds"],
                  out["peak_rss_gib"], note=f"C API batch decode, {parallel} sequences, flash attention, "
                                            f"{out['settings']['threads']} threads (peak RSS: its own process)")


def run_llamacpp(gguf_file: str, reqs: list[Request], scratch: str, parallel: int,
                 sampling: dict | None = None) -> Result:
    """llama.cpp both ways its users run many requests, the faster reported (the other's
    tok/s in its note and in --json): llama-server's slots, and the C API's batch decode
    (when llama-cpp-python's module imports), each on the model requantized to q8_0."""
    q8 = q8_0_model(gguf_file, scratch)
    ways = []
    if llamacpp_binary("llama-server") is not None:
        ways.append(("llama-server", run_server(q8, reqs, parallel, sampling)))
    if batch_api_available():
        ways.append(("batch API", run_batch_api(q8, reqs, scratch, parallel, sampling)))
    if not ways:
        return Result("llama.cpp q8_0", 0, float("nan"), float("nan"),
                      note="no llama-server and no llama_cpp module (build llama.cpp, or pip install "
                           "llama-cpp-python)")
    best = min((r for _, r in ways), key=lambda r: r.seconds)
    best.extra["ways"] = {name: round(r.tok_per_s, 1) for name, r in ways}
    others = [f"{name} {r.tok_per_s:.0f} tok/s" for name, r in ways if r is not best]
    if others:
        best.note += f"; faster than {', '.join(others)}"
    return best
