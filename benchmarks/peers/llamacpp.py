"""llama.cpp as a CPU peer: its binaries (LLAMA_CPP_BIN, a local build, or PATH), the
GGUF model requantized to q8_0 (llama-quantize, or write_q8_0_gguf when that is not built),
and run_llamacpp, which drives llama-server with one slot per concurrent request."""

from __future__ import annotations

import json
import os
import time

import torch

from benchmarks.measure import Result, reset_peak
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


def run_llamacpp(gguf_file: str, reqs: list[Request], scratch: str, parallel: int,
                 sampling: dict | None = None) -> Result:
    """llama.cpp's llama-server with `parallel` slots (continuous batching, as nanokv does) on
    the model requantized to q8_0 (llama-quantize when built, else write_q8_0_gguf); every
    request posted at once (token ids in, EOS ignored), timed from the first request to the
    last reply."""
    import concurrent.futures
    import socket
    import subprocess
    import urllib.request

    q8 = os.path.join(scratch, "model-q8_0.gguf")
    threads = str(torch.get_num_threads())
    if not os.path.isfile(q8):
        if llamacpp_binary("llama-quantize") is not None:
            subprocess.run([llamacpp_binary("llama-quantize"), "--allow-requantize", gguf_file, q8, "Q8_0", threads],
                           check=True, capture_output=True)
        else:
            write_q8_0_gguf(gguf_file, q8)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = parallel * max(len(r.prompt) + r.max_tokens for r in reqs)
    server = subprocess.Popen([llamacpp_binary("llama-server"), "-m", q8, "-t", threads, "-c", str(ctx),
                               "-np", str(parallel), "--host", "127.0.0.1", "--port", str(port)],
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
        reset_peak(torch.device("cpu"))
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
            tokens = sum(pool.map(post, reqs))
        seconds = time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(timeout=30)
    return Result("llama.cpp q8_0", min(tokens, sum(r.max_tokens for r in reqs)), seconds, float("nan"),
                  note=f"llama-server, {parallel} slots (peak memory: its own process)")
