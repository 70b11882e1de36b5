"""CTranslate2 as a CPU peer: the float32 model converted to int8 with its transformers
converter, run through Generator.generate_batch in static batches (best batch size wins)."""

from __future__ import annotations

import os
import time

import torch

from benchmarks.measure import Result, peak_gib, reset_peak
from benchmarks.workloads import Request


def _batches(reqs: list[Request], bs: int) -> list[list[Request]]:
    order = sorted(range(len(reqs)), key=lambda i: len(reqs[i].prompt))
    return [[reqs[i] for i in order[b:b + bs]] for b in range(0, len(order), bs)]


def run_ct2(model_dir: str, reqs: list[Request], scratch: str, batch_sizes: list[int],
            sampling: dict | None = None) -> Result:
    """CTranslate2 (pip install ctranslate2) on int8 weights converted from the float32 model
    directory with its transformers converter. generate_batch has one length per batch:
    like HF generate, static batches sorted by prompt length, each run to its longest
    request (credited with the tokens asked for); the best batch size wins."""
    import ctranslate2
    from transformers import AutoTokenizer

    out = os.path.join(scratch, "ct2-int8")
    if not os.path.isdir(out):
        ctranslate2.converters.TransformersConverter(model_dir).convert(out, quantization="int8")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    generator = ctranslate2.Generator(out, device="cpu", compute_type="int8", intra_threads=torch.get_num_threads())
    opts = (dict(sampling_topk=0, sampling_temperature=sampling["temperature"], sampling_topp=sampling["top_p"])
            if sampling else dict(sampling_topk=1))
    best, tried = None, {}
    for bs in batch_sizes:
        reset_peak(torch.device("cpu"))
        start = time.perf_counter()
        for batch in _batches(reqs, bs):
            longest = max(r.max_tokens for r in batch)
            generator.generate_batch([tokenizer.convert_ids_to_tokens(r.prompt) for r in batch], max_length=longest,
                                     min_length=longest, include_prompt_in_result=False, **opts)
        res = Result("CTranslate2 int8", sum(r.max_tokens for r in reqs), time.perf_counter() - start,
                     peak_gib(torch.device("cpu")), note=f"batch {bs} (best of {', '.join(map(str, batch_sizes))})")
        tried[bs] = round(res.tok_per_s, 1)
        if best is None or res.seconds < best.seconds:
            best = res
    best.extra["tried"] = tried
    return best
