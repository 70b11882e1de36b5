"""bench.py --latency: what one interactive user feels, for nanokv's weight formats and for
llama.cpp at the same weight bits, side by side on one machine.

- decode: tokens per second of one sequence generating alone (batch 1, greedy, EOS
  ignored), from a short prompt, its prefill left out: the time of a request generating
  1 + DECODE_TOKENS tokens minus that of the same request generating 1;
- prefill: tokens per second of one long prompt (each of PREFILL_LENS tokens) up to its
  first token.

Every engine runs in a new process per round, rounds alternate the engines, every run is
reported. nanokv runs without prefix caching (the same prompt is timed twice) and with its
default step budget; llama.cpp is `llama-bench` (its own warm-up, `-r 1`, every thread, flash
attention left to its default) on the GGUF requantized to q8_0 and to f32 by `llama-quantize`,
the same weight bits as nanokv's int8 (with the LM head) and float32.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.engines import Variant, nanokv_variants
from benchmarks.startup import child_env, emit, model_and_label, model_gguf

DECODE_TOKENS = 128  # tokens timed at batch 1 (after the first)
DECODE_PROMPT = 32  # prompt tokens before them
PREFILL_LENS = (2048, 8000)  # prompt lengths timed to the first token (8000: within SmolLM2's 8192 positions)
TIMEOUT = 900.0  # seconds one engine's run may take
LATENCY_DTYPES = "float32,bfloat16"  # --latency's variants when --dtype / --quantization are left as they are
LATENCY_QUANTIZATIONS = "none,int8,int8+head"
LLAMA_TYPES = (("q8_0", "Q8_0"), ("f32", "F32"))  # llama.cpp's formats: name, llama-quantize's type

# run in the child: one JSON line {"decode": tok/s, "prefill": {L: tok/s}, "load_seconds": s}
_RUN = r"""
import json, random, sys, time
from nanokv import LLM, SamplingParams
model, kwargs = sys.argv[1], json.loads(sys.argv[2])
decode_tokens, decode_prompt, lens = int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
t0 = time.perf_counter()
llm = LLM(model, max_model_len=max(lens + [decode_prompt + decode_tokens + 1]) + 1, max_num_seqs=1,
          enable_prefix_caching=False, **kwargs)
loaded = time.perf_counter() - t0
vocab = llm.llm_engine.model_config.get_vocab_size()
rng = random.Random(0)
def prompt(n):
    return {"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(n)]}
def timed(p, n):
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate([p], sp, use_tqdm=False)[0]
    if len(out.outputs[0].token_ids) != n:
        raise RuntimeError(f"asked for {n} tokens, got {len(out.outputs[0].token_ids)}")
    return time.perf_counter() - start
timed(prompt(decode_prompt), 8)  # warm-up: first-call costs out of the timings
p = prompt(decode_prompt)
first, whole = timed(p, 1), timed(p, 1 + decode_tokens)
report = {"load_seconds": loaded, "decode": decode_tokens / (whole - first), "prefill": {}}
for n in lens:
    report["prefill"][str(n)] = n / timed(prompt(n), 1)
print(json.dumps(report))
"""


def latency_variants(args) -> list[Variant]:
    """nanokv's variants for --latency: --dtype x --quantization as bench.py takes them, by
    default float32, bfloat16, int8 and int8 with the LM head (LATENCY_*)."""
    if args.dtype == "float32" and args.quantization == "none":  # bench.py's defaults: every format
        args.dtype, args.quantization = LATENCY_DTYPES, LATENCY_QUANTIZATIONS
    return nanokv_variants(args)


def run_nanokv_once(model: str, variant: Variant, lens: list[int], timeout: float = TIMEOUT) -> dict:
    """One round of one nanokv variant in a new process: its decode and prefill rates."""
    env = child_env(None)  # the user's cache: a warm start, as they would run it
    if variant.width is not None:
        env["NANOKV_CPU_WIDTH"] = str(variant.width)
    proc = subprocess.run([sys.executable, "-c", _RUN, model, json.dumps(dict(variant.engine_kwargs)),
                           str(DECODE_TOKENS), str(DECODE_PROMPT), json.dumps(lens)],
                          env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant.label} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def llama_model(gguf: str, kind: str, scratch: str) -> str:
    """The GGUF file requantized to llama-quantize's `kind` (Q8_0, F32) in the scratch folder."""
    from benchmarks.peers.llamacpp import llamacpp_binary

    out = os.path.join(scratch, f"model-{kind.lower()}.gguf")
    if not os.path.isfile(out):
        subprocess.run([llamacpp_binary("llama-quantize"), "--allow-requantize", gguf, out, kind,
                        str(torch.get_num_threads())], check=True, capture_output=True, timeout=TIMEOUT)
    return out


def run_llama_once(binary: str, gguf: str, lens: list[int], timeout: float = TIMEOUT) -> dict:
    """One llama-bench run: decode (tg DECODE_TOKENS from an empty context) and prefill (pp
    of each length) tokens per second."""
    threads = str(torch.get_num_threads())
    cmd = [binary, "-m", gguf, "-t", threads, "-r", "1", "-o", "json", "-n", str(DECODE_TOKENS),
           "-p", ",".join(map(str, lens))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    report = {"decode": None, "prefill": {}}
    for test in json.loads(proc.stdout):
        if test["n_gen"] and not test["n_prompt"]:
            report["decode"] = test["avg_ts"]
        elif test["n_prompt"] and not test["n_gen"]:
            report["prefill"][str(test["n_prompt"])] = test["avg_ts"]
    return report


def run_latency(model: str, label: str, variants: list[Variant], rounds: int, lens: list[int],
                llama_bench: str | None, llama_quantize: str | None) -> dict:
    """Every engine once per round, alternating; {"engines": {name: [one report per round]}}."""
    gguf = model_gguf(model)
    report = {"model": label, "threads": torch.get_num_threads(), "decode_tokens": DECODE_TOKENS,
              "prefill_lens": lens, "rounds": rounds, "engines": {}, "missing": {}}
    with tempfile.TemporaryDirectory(prefix="nanokv-latency-") as scratch:
        engines: list[tuple[str, object]] = [(v.label, v) for v in variants]
        if not llama_bench or not llama_quantize:
            report["missing"]["llama.cpp"] = "no llama-bench / llama-quantize (build llama.cpp, or set LLAMA_CPP_BIN)"
        elif not gguf:
            report["missing"]["llama.cpp"] = "llama.cpp loads GGUF files: give --model a .gguf or smollm2"
        else:
            for name, kind in LLAMA_TYPES:
                engines.append((f"llama.cpp {name}", llama_model(gguf, kind, scratch)))
        for r in range(rounds):
            for name, engine in engines:
                start = time.perf_counter()
                if isinstance(engine, Variant):
                    result = run_nanokv_once(model, engine, lens)
                else:
                    result = run_llama_once(llama_bench, engine, lens)
                report["engines"].setdefault(name, []).append(result)
                print(f"round {r + 1}/{rounds} {name}: decode {result['decode']:.1f} tok/s, prefill "
                      + ", ".join(f"{n}: {v:.0f}" for n, v in result["prefill"].items())
                      + f" tok/s ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    return report


def _cell(values: list[float]) -> str:
    """The median of every round, and the range when there were several."""
    if not values:
        return "-"
    med = statistics.median(values)
    return f"{med:.1f}" if len(values) == 1 else f"{med:.1f} ({min(values):.1f}-{max(values):.1f})"


def print_latency(report: dict) -> None:
    lens = report["prefill_lens"]
    print(f"## Latency: {report['model']}, {report['threads']} threads, median of {report['rounds']} "
          f"alternating rounds (range)\n")
    print("| engine | decode tok/s (batch 1) | " + " | ".join(f"prefill {n} tok/s" for n in lens) + " |")
    print("|---" * (2 + len(lens)) + "|")
    for name, runs in report["engines"].items():
        cells = [_cell([r["decode"] for r in runs if r["decode"] is not None])]
        cells += [_cell([r["prefill"][str(n)] for r in runs if str(n) in r["prefill"]]) for n in lens]
        print(f"| {name} | " + " | ".join(cells) + " |")
    for name, why in report["missing"].items():
        print(f"| {name} | {why} |" + " |" * len(lens))
    pairs = [("nanokv int8+head", "llama.cpp q8_0"), ("nanokv", "llama.cpp f32")]
    ratios = []
    for ours, theirs in pairs:
        if ours in report["engines"] and theirs in report["engines"]:
            a = statistics.median(r["decode"] for r in report["engines"][ours])
            b = statistics.median(r["decode"] for r in report["engines"][theirs])
            ratios.append(f"{ours} / {theirs} {a / b:.2f}x")
    if ratios:
        print("\nbatch-1 decode at the same weight bits: " + ", ".join(ratios))


def main(args) -> None:
    """bench.py --latency with bench.py's parsed arguments (--model or --shape, --repeats,
    --dtype, --quantization, --prefill-lens, --json)."""
    from benchmarks.peers.llamacpp import llamacpp_binary

    model, label = model_and_label(args)
    lens = [int(n) for n in args.prefill_lens.split(",") if n]
    report = run_latency(model, label, latency_variants(args), args.repeats, lens, llamacpp_binary("llama-bench"),
                         llamacpp_binary("llama-quantize"))
    emit(report, args, print_latency)
