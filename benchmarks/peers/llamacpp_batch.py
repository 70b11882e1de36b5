"""llama.cpp through its C API's batch decode, the way its own batched examples and its
Python bindings' users drive it: continuous batching in one process, no HTTP. Run as

    python -m benchmarks.peers.llamacpp_batch MODEL.gguf REQUESTS.json --slots 64 --threads 2

with REQUESTS.json a list of {"prompt": [ids], "max_tokens": n, "seed": s}; it prints one
JSON line {"tokens", "seconds", "settings", "peak_rss_gib"}. It needs llama-cpp-python's `llama_cpp`
module (`pip install llama-cpp-python`, or its sources on PYTHONPATH with
LLAMA_CPP_LIB_PATH naming a llama.cpp build's library folder). bench.py runs it in a
subprocess of its own: llama.cpp's OpenMP threads then do not share a process with
torch's.

Settings, from a sweep on SmolLM2 q8_0, the `cpu` workload, 2 cores (tok/s): flash
attention on, a KV buffer per sequence 114; n_ubatch 256: 101, 1024: 106; flash
attention off 95; one KV buffer shared by all sequences (kv_unified, where every
sequence's attention spans the whole buffer) 36 with flash attention off, 94 on.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

N_BATCH = 2048  # tokens per llama_decode call (llama.cpp's default)
N_UBATCH = 512  # tokens per compute graph (llama.cpp's default; the sweep's best)


@dataclass
class Sequence:
    request: int
    pending: list[int]  # tokens still to feed: the prompt's rest, or the last sampled token
    max_tokens: int
    position: int = 0
    produced: int = 0
    row: int = -1  # the batch row whose logits it samples from this step, -1: none
    sampler: object = None


def schedule(active: dict[int, Sequence], n_batch: int) -> list[tuple[int, int, int, bool]]:
    """One llama_decode batch as (token, position, seq id, wants logits) rows: every
    decoding sequence's one token first, then prompt chunks in the room left. A sequence
    whose prompt is not all in gets no logits row this step."""
    rows: list[tuple[int, int, int, bool]] = []
    order = sorted(active, key=lambda s: (len(active[s].pending) > 1, s))
    for s in order:
        seq = active[s]
        take = seq.pending[:n_batch - len(rows)]
        if not take:
            seq.row = -1
            continue
        rows += [(tok, seq.position + j, s, False) for j, tok in enumerate(take)]
        seq.position += len(take)
        del seq.pending[:len(take)]
        seq.row = len(rows) - 1 if not seq.pending else -1
        if seq.row >= 0:
            rows[-1] = rows[-1][:3] + (True,)
    return rows


def generate(backend, requests: list[dict], slots: int, n_batch: int = N_BATCH) -> list[list[int]]:
    """Every request's sampled tokens (exactly max_tokens each, EOS ignored), at most
    `slots` sequences at once, admitted in order as slots free up."""
    waiting = list(range(len(requests)))[::-1]
    free = list(range(slots))[::-1]
    active: dict[int, Sequence] = {}
    outputs: list[list[int]] = [[] for _ in requests]
    while waiting or active:
        while waiting and free:
            i, s = waiting.pop(), free.pop()
            r = requests[i]
            active[s] = Sequence(i, list(r["prompt"]), r["max_tokens"], sampler=backend.new_sampler(r.get("seed")))
        backend.decode(schedule(active, n_batch))
        for s in [s for s in active if active[s].row >= 0]:
            seq = active[s]
            token = backend.sample(seq.sampler, seq.row)
            outputs[seq.request].append(token)
            seq.produced += 1
            if seq.produced == seq.max_tokens:
                backend.release(s, seq.sampler)
                del active[s]
                free.append(s)
            else:
                seq.pending = [token]
    return outputs


class LlamaBackend:
    """The llama_cpp calls generate() needs, on one context with `slots` sequences."""

    def __init__(self, gguf: str, slots: int, n_ctx_per_seq: int, threads: int, sampling: dict | None):
        import llama_cpp as L

        self.L, self.sampling = L, sampling
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(gguf.encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = slots * n_ctx_per_seq, N_BATCH, N_UBATCH, slots
        cp.n_threads = cp.n_threads_batch = threads
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cp.kv_unified = False
        cp.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cp)
        self.memory = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(N_BATCH, 0, 1)

    def new_sampler(self, seed: int | None):
        L = self.L
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        if self.sampling:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(self.sampling["top_p"], 1))
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(self.sampling["temperature"]))
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(seed or 0))
        else:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
        return chain

    def decode(self, rows) -> None:
        b = self.batch
        for n, (token, position, seq, logits) in enumerate(rows):
            b.token[n], b.pos[n], b.n_seq_id[n], b.logits[n] = token, position, 1, logits
            b.seq_id[n][0] = seq
        b.n_tokens = len(rows)
        if self.L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def sample(self, sampler, row: int) -> int:
        return self.L.llama_sampler_sample(sampler, self.ctx, row)

    def release(self, seq: int, sampler) -> None:
        self.L.llama_sampler_free(sampler)
        self.L.llama_memory_seq_rm(self.memory, seq, -1, -1)

    def close(self) -> None:
        self.L.llama_batch_free(self.batch)
        self.L.llama_free(self.ctx)
        self.L.llama_model_free(self.model)


def peak_rss_gib() -> float:
    """This process's peak RSS (VmHWM, which starts afresh at exec; getrusage's ru_maxrss
    would carry the parent's from before the fork)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20  # kB -> GiB
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("requests")
    p.add_argument("--slots", type=int, required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--sampling", default=None, help="JSON {temperature, top_p}; greedy without it")
    args = p.parse_args(argv)
    with open(args.requests) as f:
        requests = json.load(f)
    sampling = json.loads(args.sampling) if args.sampling else None
    longest = max(len(r["prompt"]) + r["max_tokens"] for r in requests)
    backend = LlamaBackend(args.model, args.slots, longest, args.threads, sampling)
    generate(backend, [dict(prompt=requests[0]["prompt"][:4], max_tokens=2)], args.slots)  # warm-up
    start = time.perf_counter()
    outputs = generate(backend, requests, args.slots)
    seconds = time.perf_counter() - start
    backend.close()
    settings = dict(slots=args.slots, threads=args.threads, flash_attn=True, kv_unified=False,
                    n_batch=N_BATCH, n_ubatch=N_UBATCH)
    peak = peak_rss_gib()
    print(json.dumps(dict(tokens=sum(map(len, outputs)), seconds=seconds, settings=settings, peak_rss_gib=peak)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
