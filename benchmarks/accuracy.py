"""`bench.py --accuracy`: every nanokv weight / KV-cache variant scored against its
reference (nanokv/testing/accuracy.py does the scoring), with each variant's load time and
memory measured in a fresh process; and the table it prints."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict

import torch

from benchmarks.engines import Variant


def run_accuracy(model_dir: str, variants: list[Variant], args) -> dict:
    """--accuracy: every weight variant against float32 weights, and every KV-cache variant
    against the same weights with the full-precision (auto) KV cache
    (nanokv/testing/accuracy.py): perplexity, mean KL and top-1 agreement on the license
    texts, greedy agreement on 32 chat prompts; and each variant's load time and memory, in
    a fresh process each."""
    from nanokv.testing import accuracy

    reference = accuracy.scoring_engine(model_dir)
    windows = accuracy.corpus_windows(reference.get_tokenizer(), max_tokens=args.accuracy_tokens)
    rows = []
    for v in variants:
        if v.width is not None:
            continue  # widths change no weight: the float32 GEMMs are bit-identical (tests)
        kwargs = dict(v.engine_kwargs)
        row = dict(variant=v.label, engine_kwargs=kwargs, load=measure_load(model_dir, v))
        if kwargs:
            weights = {k: x for k, x in kwargs.items() if k != "kv_cache_dtype"}
            ref = reference
            if "kv_cache_dtype" in kwargs:  # the same weights, full-precision KV
                ref = accuracy.scoring_engine(model_dir, **weights) if weights else reference
                row["reference"] = "the same weights, kv_cache_dtype auto"
            candidate = accuracy.scoring_engine(model_dir, **kwargs)
            row["perplexity"] = asdict(accuracy.compare_perplexity(ref, candidate, windows))
            row["greedy"] = asdict(accuracy.compare_greedy(ref, candidate))
            del candidate, ref
        rows.append(row)
    return dict(model=args.label, corpus=f"{accuracy.CORPUS_DIR}: {', '.join(accuracy.CORPUS_FILES)}",
                window=accuracy.WINDOW, threads=torch.get_num_threads(), variants=rows)


_LOAD_PROBE = """
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[3]))
from nanokv import LLM
def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key))
start = time.perf_counter()
llm = LLM(sys.argv[1], num_kvcache_blocks=16, max_model_len=256, **json.loads(sys.argv[2]))
seconds = time.perf_counter() - start
model = llm.llm_engine.runner.model
packed = {id(m.packed): m.packed.nbytes for m in model.modules() if getattr(m, "packed", None) is not None}
params = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps(dict(load_seconds=seconds, rss_gib=status("VmRSS:") / 2**30, peak_rss_gib=status("VmHWM:") / 2**30,
                      weights_gib=(sum(packed.values()) + params) / 2**30)))
"""


def measure_load(model_dir: str, variant: Variant) -> dict:
    """Load time, RSS after load, peak RSS while loading and the bytes of the weights as
    stored (packed copies once, other parameters), of one variant in a fresh process (a
    16-block KV pool)."""
    import subprocess

    env = dict(os.environ, **({"NANOKV_CPU_WIDTH": str(variant.width)} if variant.width else {}))
    out = subprocess.run([sys.executable, "-c", _LOAD_PROBE, model_dir, json.dumps(dict(variant.engine_kwargs)),
                          str(torch.get_num_threads())], capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        return dict(error=out.stderr.strip().splitlines()[-1][:200] if out.stderr.strip() else "failed")
    return json.loads(out.stdout.strip().splitlines()[-1])


def print_accuracy(report: dict) -> None:
    print(f"accuracy against float32 weights (KV-cache variants: against their weights with the auto KV cache): "
          f"{report['model']}, {report['threads']} threads; text: "
          f"{report['corpus']} (windows of {report['window']} tokens)\n")
    print("| variant | tokens | PPL | dPPL | mean KL | top-1 agree | greedy identical | greedy prefix | "
          "greedy diverged (near-ties) | load s | RSS GiB | peak RSS GiB | weights GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in report["variants"]:
        ppl, greedy, load = row.get("perplexity"), row.get("greedy"), row["load"]
        cells = [row["variant"]]
        if ppl:
            cells += [f"{ppl['tokens']:,}", f"{ppl['ppl']:.3f} (ref {ppl['ppl_reference']:.3f})",
                      f"{ppl['dppl_percent']:+.3f}%", f"{ppl['mean_kl']:.5f}", f"{100 * ppl['top1_agreement']:.1f}%",
                      f"{greedy['identical']}/{greedy['prompts']}", f"{100 * greedy['prefix_fraction']:.1f}%",
                      f"{greedy['prompts'] - greedy['identical']} ({greedy['near_ties']})"]
        else:
            cells += ["-", "reference", "-", "-", "-", "-", "-", "-"]
        cells += ([f"{load['load_seconds']:.1f}", f"{load['rss_gib']:.2f}", f"{load['peak_rss_gib']:.2f}",
                   f"{load['weights_gib']:.3f}"] if "error" not in load else [load["error"], "-", "-", "-"])
        print("| " + " | ".join(cells) + " |")
    for row in report["variants"]:
        for n, i, margin in (row.get("greedy") or {}).get("first_divergences", ()):
            print(f"{row['variant']}: prompt {n} first differs at token {i}; the reference's margin there "
                  f"{margin:.3f} nats" + (" (near-tie)" if margin < accuracy_near_tie() else ""))


def accuracy_near_tie() -> float:
    from nanokv.testing.accuracy import NEAR_TIE_NATS

    return NEAR_TIE_NATS
