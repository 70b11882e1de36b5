"""The CPU peers bench.py compares nanokv with, one module each: CTranslate2 (ct2.py) and
llama.cpp (llamacpp.py). run_cpu_peers runs those asked for that are installed."""

from __future__ import annotations

import importlib.util

from benchmarks.measure import Result
from benchmarks.peers.ct2 import run_ct2
from benchmarks.peers.llamacpp import run_llamacpp
from benchmarks.workloads import Request


def run_cpu_peers(engines: set, model_dir: str, reqs: list[Request], args, sizes: list[int],
                  sampling: dict | None) -> list[Result]:
    """The CPU peers asked for that are installed; a row saying why for those that are not."""
    results = []
    if "ct2" in engines:
        if importlib.util.find_spec("ctranslate2") is None:
            results.append(Result("CTranslate2 int8", 0, float("nan"), float("nan"),
                                  note="not installed: pip install ctranslate2"))
        else:
            results.append(run_ct2(model_dir, reqs, args.scratch, sizes, sampling))
    if "llama.cpp" in engines:
        from nanokv.gguf import find_gguf, resolve_model as resolve_name

        gguf_file = find_gguf(resolve_name(args.model)) if args.model else None
        if gguf_file is None:
            results.append(Result("llama.cpp q8_0", 0, float("nan"), float("nan"),
                                  note="needs a GGUF model (--model smollm2 or a .gguf file)"))
        else:
            results.append(run_llamacpp(gguf_file, reqs, args.scratch, min(args.max_num_seqs, len(reqs)), sampling))
    return results
