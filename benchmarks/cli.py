"""bench.py's command line: its flags, the model every engine loads, and the run they ask
for (`serve` goes to benchmarks/serve.py; --micro, --accuracy, or the workloads side by
side). bench.py passes its docstring, the usage lines --help prints."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

from nanokv.cpu_threads import restore_environ
from nanokv.engine.arg_utils import EngineArgs

from benchmarks.accuracy import print_accuracy, run_accuracy
from benchmarks.busy import busy
from benchmarks.engines import cpu_kv_budget_fraction, load_hf, nanokv_variants
from benchmarks.latency import PREFILL_LENS
from benchmarks.micro import MICRO_SECTIONS, run_micro
from benchmarks.report import print_report, print_side_by_side
from benchmarks.roofline import model_dims
from benchmarks.structured import print_structured, run_structured
from benchmarks.throughput import run_workload
from benchmarks.workloads import WORKLOADS, workload_spec


def resolve_model(args, scratch: str) -> tuple[str, str]:
    """(the directory every engine loads, its label in the report). A GGUF file (or a
    built-in name such as smollm2) is dequantized once into `scratch`."""
    if args.model:
        from nanokv.gguf import find_gguf, resolve_model as resolve_name, save_dequantized

        gguf_file = find_gguf(resolve_name(args.model))
        if gguf_file is None:
            return args.model, args.model
        return save_dequantized(gguf_file, os.path.join(scratch, "model")), f"{args.model} (GGUF, dequantized)"
    from nanokv.testing.tiny import cached_tiny_checkpoint

    dtype = torch.bfloat16 if args.shape in ("qwen3-0.6b", "llama-3.2-1b") else torch.float32
    return cached_tiny_checkpoint(args.shape, dtype=dtype), f"random {args.shape}"


def _say_busy(hogs: list[int], n: int) -> None:
    if hogs:
        print(f"bench.py: {len(hogs)} CPU-bound processes running beside every engine (--busy {n}, "
              f"pids {' '.join(map(str, hogs))})", file=sys.stderr, flush=True)


def main(argv: list[str], description: str | None = None) -> int | None:
    """bench.py with these arguments (sys.argv[1:]); `description` heads --help. Returns the
    exit status of `serve`, else None."""
    if argv[:1] == ["serve"]:  # the serving benchmark: benchmarks/serve.py
        from benchmarks.serve import main as serve_main

        return serve_main(argv[1:])
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="nano" if cuda else "cpu,chat",
                   help=f"one or several (comma-separated) of {', '.join(WORKLOADS)} "
                        "(default: cpu,chat on a CPU, nano on a GPU)")
    p.add_argument("--num-requests", type=int, help="override the workload's number of requests")
    p.add_argument("--prompt-lens", help="override the workload's prompt lengths: LO-HI (uniform) or N")
    p.add_argument("--output-lens", help="override the workload's output lengths: LO-HI (uniform) or N")
    p.add_argument("--model", help="a Hugging Face model directory, a .gguf file or a built-in name "
                                   "(default on a CPU: smollm2, unless --shape is given)")
    p.add_argument("--shape", help="random weights of a known shape instead of a model: qwen3-0.6b (the "
                                   "default on a GPU), llama-3.2-1b, cpu-small")
    p.add_argument("--engines", default="nanokv,hf,hf-cb,vllm",
                   help="comma-separated subset of nanokv, hf, hf-cb, vllm, and the CPU peers ct2 (CTranslate2 "
                        "int8, when installed) and llama.cpp (q8_0 through llama-server, when built)")
    p.add_argument("--dtype", default="float32",
                   help="nanokv's weights, comma-separated for several rows: float32, bfloat16 (the CPU kernels: "
                        "bfloat16 weights, float32 activations)")
    p.add_argument("--quantization", default="none",
                   help="comma-separated: none, int8 (quantization='int8'), int8+head (the LM head too)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="comma-separated KV cache formats, a nanokv row each: auto (the model's dtype), int8, "
                        "fp8 (CUDA); with --accuracy each quantized one is measured against its own weights "
                        "with the auto KV cache")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="nanokv's KV pool budget in bytes (default: the workload's, else the engine's); the "
                        "pool's token capacity and the peak concurrent sequences are reported per row")
    p.add_argument("--cpu-width", default="native",
                   help="comma-separated vector widths of nanokv's CPU kernels: native, 8, 16 (NANOKV_CPU_WIDTH)")
    p.add_argument("--accuracy", action="store_true",
                   help="instead of throughput: perplexity, KL and greedy agreement of every --dtype / "
                        "--quantization variant against float32 weights, with load time and memory")
    p.add_argument("--accuracy-tokens", type=int, default=None,
                   help="score only the first windows of the text holding this many tokens (default: all)")
    p.add_argument("--hf-batch-sizes", default="",
                   help="batch sizes to try for HF generate (default: 8,16,32,64 on CPU; 32,64,128 on GPU)")
    p.add_argument("--hf-cb-memory", type=float, default=None,
                   help="fraction of the free memory HF continuous batching takes for its KV cache (default: "
                        "on a CPU nanokv's default pool, 4 GiB or less; on a GPU transformers' own, 0.8-0.9)")
    p.add_argument("--max-num-seqs", type=int, default=EngineArgs().max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1 if cuda else 2,
                   help="rounds of nanokv and HF generate's best batch size, alternating; each engine "
                        "reports its fastest (default 2 on CPU, 1 on GPU)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables (with "
                                                       "several workloads: {\"workloads\": [one per workload]})")
    p.add_argument("--micro", action="store_true",
                   help="microbenchmarks instead of the workloads, one section each: host time per decode step "
                        "(schedule, prepare, sample, update) and the sampler per mode")
    p.add_argument("--micro-sections", default=",".join(MICRO_SECTIONS),
                   help=f"the --micro sections to run, comma-separated, of {', '.join(MICRO_SECTIONS)}")
    p.add_argument("--micro-vocabs", default="49152,151936",
                   help="vocabulary sizes of the sampler microbenchmark (comma-separated)")
    p.add_argument("--micro-repeats", type=int, default=3,
                   help="timed rounds of each microbenchmark (after one warm-up); each keeps its fastest")
    p.add_argument("--startup", action="store_true",
                   help="instead of the workloads: nanokv's cold and warm LLM(model) load (new processes, "
                        "an empty cache first) and nanokv serve's ready time, each with its peak RSS, and "
                        "llama-server's ready time when one is found (benchmarks/startup.py)")
    p.add_argument("--llama-server", help="--startup: the llama-server binary (default: LLAMA_CPP_BIN, a local "
                                          "build, or PATH)")
    p.add_argument("--busy", type=int, default=0, metavar="N",
                   help="N CPU-bound processes run beside every engine's run, as on a machine whose cores other "
                        "work shares (each stopped when the run ends, and bounded in time)")
    p.add_argument("--latency", action="store_true",
                   help="instead of the workloads: batch-1 decode and long-prompt prefill tokens per second of "
                        "nanokv's weight formats (float32, bfloat16, int8, int8+head unless --dtype / "
                        "--quantization say) and llama.cpp's f32 and q8_0 when built, alternating, --repeats "
                        "rounds (benchmarks/latency.py)")
    p.add_argument("--prefill-lens", default=",".join(map(str, PREFILL_LENS)),
                   help="--latency: the prompt lengths whose prefill is timed (comma-separated)")
    args = p.parse_args(argv)
    restore_environ()  # peers (llama.cpp's OpenMP) run with the user's wait setting, not the one nanokv set
    if args.busy < 0:
        p.error(f"--busy {args.busy}: give 0 or more processes")
    unknown = [n for n in args.micro_sections.split(",") if n and n not in MICRO_SECTIONS]
    if unknown:
        p.error(f"unknown --micro-sections {unknown}; choose from {', '.join(MICRO_SECTIONS)}")
    names = [w for w in args.workload.split(",") if w]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown or not names:
        p.error(f"unknown workload {unknown or args.workload!r}; choose from {', '.join(WORKLOADS)}")
    if args.model and args.shape:
        p.error("give --model or --shape, not both")
    if not args.model and not args.shape:
        args.model, args.shape = (None, "qwen3-0.6b") if cuda else ("smollm2", None)
    if args.startup or args.latency:
        from benchmarks.latency import main as latency_main
        from benchmarks.startup import main as startup_main

        with busy(args.busy) as hogs:
            _say_busy(hogs, args.busy)
            try:
                return (startup_main if args.startup else latency_main)(args)
            except ValueError as e:
                p.error(str(e))
    try:
        specs = [workload_spec(w, args.num_requests, args.prompt_lens, args.output_lens) for w in names]
        nanokv_variants(args)
    except ValueError as e:
        p.error(str(e))

    device = torch.device("cuda" if cuda else "cpu")
    if args.hf_cb_memory is None and not cuda:
        args.hf_cb_memory = cpu_kv_budget_fraction()
    with tempfile.TemporaryDirectory(prefix="nanokv-bench-") as scratch, busy(args.busy) as hogs:
        _say_busy(hogs, args.busy)
        try:
            model_dir, args.label = resolve_model(args, scratch)
        except ValueError as e:  # a model that does not resolve: say how to get it
            p.exit(2, f"bench.py: error: {e}\n")
        from transformers import AutoConfig, AutoTokenizer

        if args.micro:
            run_micro(args, model_dir, device)
            return
        dims = model_dims(AutoConfig.from_pretrained(model_dir))
        tokenizer = AutoTokenizer.from_pretrained(model_dir) if any(s.get("chat") for s in specs) else None
        engines = set(args.engines.split(","))
        sizes = [int(x) for x in args.hf_batch_sizes.split(",") if x] or (
            [8, 16, 32, 64] if device.type == "cpu" else [32, 64, 128])
        loaded = []

        def hf_model():
            if not loaded:
                loaded.append(load_hf(model_dir, device, torch.float32 if device.type == "cpu" else torch.bfloat16))
            return loaded[0]

        args.scratch = scratch  # the CPU peers' converted models
        if args.accuracy:
            report = run_accuracy(model_dir, nanokv_variants(args), args)
            if args.json:
                print(json.dumps(report, indent=2))
            else:
                print_accuracy(report)
            return
        rate: list[float] = []
        reports = []
        for w, spec in zip(names, specs):
            if spec.get("structured"):
                reports.append(run_structured(w, model_dir, args.label, spec, device, args))
            else:
                reports.append(run_workload(w, spec, model_dir, hf_model, tokenizer, dims, device, args, engines,
                                            sizes, rate))
                loaded.clear()  # reloaded for the next workload: nanokv's peak memory stays its own
            reports[-1]["busy"] = args.busy  # CPU-bound processes beside every engine

    if args.json:
        print(json.dumps(reports[0] if len(reports) == 1 else dict(workloads=reports), indent=2, default=str))
        return
    for i, report in enumerate(reports):
        if i:
            print()
        (print_structured if report.get("structured") else print_report)(report)
    if args.busy:
        print(f"\n{args.busy} CPU-bound processes ran beside every engine (--busy {args.busy})")
    others = [r for r in reports if not r.get("structured")]
    if len(others) > 1:
        print_side_by_side(others)
