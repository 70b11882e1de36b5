"""Throughput of nanokv against Hugging Face generate, side by side in one run.

    python bench.py                                  # on a CPU: SmolLM2, workloads cpu and chat
    python bench.py --workload nano --shape qwen3-0.6b   # nano-vllm's workload (the GPU default)
    python bench.py --model /path/to/model --workload cpu --json
    python bench.py serve                            # servers under load: benchmarks/serve.py

Every engine runs the same requests (EOS ignored, fixed seeds) in this process and is
credited only with the output tokens each request asked for: HF generate has to run each
padded batch to its longest request, and that is its real cost. Ratios are against HF
generate's best batch size, so drifting machine speed cancels out. Workloads: random
token ids decoded greedily (nano, cpu, tiny), or chat-shaped prompts sampled with
temperature 0.8 and top_p 0.95, one seed per request (chat, chat-tiny). A GGUF model
(such as the built-in smollm2) is dequantized once into a temporary float32 copy that
every engine loads.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch

from nanokv.config import EngineArgs

WORKLOADS = {
    # nano-vllm's published benchmark
    "nano": dict(num_requests=256, prompt=(100, 1024), output=(100, 1024)),
    # sized for a few minutes on 2 CPU cores
    "cpu": dict(num_requests=64, prompt=(16, 256), output=(16, 160)),
    # a quick look (CI smoke runs)
    "tiny": dict(num_requests=8, prompt=(4, 32), output=(4, 16)),
    # chat-shaped and sampled: a shared system prompt and varied user turns rendered with the
    # model's chat template (their lengths come from the text), SAMPLING, one seed per request
    "chat": dict(num_requests=64, output=(16, 160), chat=True),
    "chat-tiny": dict(num_requests=8, output=(4, 16), chat=True),
}
SAMPLING = dict(temperature=0.8, top_p=0.95)  # the chat workloads' sampling

SYSTEM_PROMPT = (
    "You are a friendly and knowledgeable assistant for a public library's help desk. Answer "
    "questions clearly and accurately in plain English, keep answers short unless asked for "
    "detail, use examples where they help, say so when you are unsure, and never make up "
    "facts, titles or quotations. If a question is ambiguous, answer the most likely reading.")
_TASKS = ["Explain {} to a ten-year-old.", "Give me three practical tips about {}.",
          "Write a short poem about {}.", "What are the pros and cons of {}?",
          "Summarize the history of {} in a few sentences.", "How would you teach {} to a beginner?",
          "Write a very short story that involves {}.", "What are common misconceptions about {}?"]
_SUBJECTS = ["photosynthesis", "the French Revolution", "black holes", "sourdough baking",
             "compound interest", "the immune system", "plate tectonics", "jazz improvisation",
             "machine learning", "the water cycle", "chess openings", "renewable energy",
             "the Roman Empire", "sleep", "volcanoes", "public speaking"]


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    seed: int | None = None  # sampled workloads: the request's own seed


@dataclass
class Result:
    engine: str
    output_tokens: int
    seconds: float
    peak_memory_gib: float
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds


def workload_spec(name: str, num_requests: int | None = None, prompt: str | None = None,
                  output: str | None = None) -> dict:
    """WORKLOADS[name], with any of its numbers replaced: lengths as "LO-HI" or "N"."""
    spec = dict(WORKLOADS[name])
    if prompt is not None and spec.get("chat"):
        raise ValueError(f"--prompt-lens does not apply to {name}: its prompts are rendered conversations")
    if num_requests is not None:
        if num_requests < 1:
            raise ValueError(f"--num-requests must be at least 1, got {num_requests}")
        spec["num_requests"] = num_requests
    for key, text in (("prompt", prompt), ("output", output)):
        if text is None:
            continue
        lo, _, hi = text.partition("-")
        try:
            bounds = (int(lo), int(hi or lo))
        except ValueError:
            raise ValueError(f"--{key}-lens takes LO-HI or N (token counts), got {text!r}") from None
        if not 1 <= bounds[0] <= bounds[1]:
            raise ValueError(f"--{key}-lens needs 1 <= LO <= HI, got {text!r}")
        spec[key] = bounds
    return spec


def make_workload(name: str | dict, vocab: int, seed: int = 0, tokenizer=None) -> list[Request]:
    """Requests of a named workload (or a spec from workload_spec): output lengths uniform in
    their range; prompts of token ids uniform in [0, vocab) with lengths uniform in theirs,
    or, for chat workloads, conversations rendered with the tokenizer's chat template."""
    spec = WORKLOADS[name] if isinstance(name, str) else name
    rng = random.Random(seed)
    reqs = []
    for _ in range(spec["num_requests"]):
        if spec.get("chat"):
            prompt = chat_prompt(tokenizer, rng.choice(_TASKS).format(rng.choice(_SUBJECTS)))
            reqs.append(Request(prompt, rng.randint(*spec["output"]), seed=rng.randrange(2**31)))
        else:
            n = rng.randint(*spec["prompt"])
            reqs.append(Request([rng.randrange(vocab) for _ in range(n)], rng.randint(*spec["output"])))
    return reqs


def chat_prompt(tokenizer, user: str) -> list[int]:
    """The shared system prompt and one user turn, as the chat template renders them."""
    conversation = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


# ---- memory -----------------------------------------------------------------------------

def reset_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:  # Linux: reset the process's peak RSS (VmHWM) to its current RSS
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def peak_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def cpu_kv_budget_fraction() -> float | None:
    """nanokv's default CPU KV pool budget (4 GiB, at most half the free RAM) as a fraction of
    the free RAM: HF continuous batching's cache gets the same budget (by default it takes
    most of the RAM, and allocating it takes longer than small workloads run)."""
    from nanokv.runner.kv_cache import _CPU_DEFAULT_BUDGET

    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None
    return min(0.5, _CPU_DEFAULT_BUDGET / free)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- engines ----------------------------------------------------------------------------

def run_nanokv(model_dir: str, reqs: list[Request], device: torch.device, args, sampling: dict | None = None) -> Result:
    from nanokv import LLM, SamplingParams

    reset_peak(device)
    kwargs = dict(device=str(device), max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager)
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    max_len = max(len(r.prompt) + r.max_tokens for r in reqs)
    llm = LLM(model_dir, max_model_len=max(max_len, 64), **kwargs)
    params = [SamplingParams(**(sampling or dict(temperature=0)), seed=r.seed, max_tokens=r.max_tokens,
                             ignore_eos=True) for r in reqs]
    warm = make_workload("tiny", 1000, seed=12345)[:2]  # other tokens: no prefix-cache help
    llm.generate([r.prompt for r in warm], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    runner = llm.llm_engine.runner
    runner.reset_timers()
    sync(device)
    start = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params, use_tqdm=False)
    sync(device)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(r.max_tokens for r in reqs)
    kv = llm.kv_stats()
    extra = dict(kv=asdict(kv), kv_summary=kv.summary(), steps=runner.num_steps,
                 forward_seconds=runner.forward_seconds, backend=llm.llm_engine.config.attention_backend)
    res = Result("nanokv", tokens, seconds, peak_gib(device), extra=extra)
    del llm, outs
    return res


def load_hf(model_dir: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # EOS ignored, like every engine here
    model.generation_config.pad_token_id = 0
    return model


@torch.inference_mode()
def run_hf_generate(model, reqs: list[Request], device: torch.device, batch_sizes: list[int],
                    sampling: dict | None = None) -> Result:
    """Padded static batches, prompts sorted by length; the best batch size wins. Sampled
    workloads sample with one seed per batch (generate has no per-request seeds)."""
    order = sorted(range(len(reqs)), key=lambda i: len(reqs[i].prompt))
    best, tried = None, {}
    for bs in batch_sizes:
        reset_peak(device)
        sync(device)
        start = time.perf_counter()
        for b in range(0, len(order), bs):
            batch = [reqs[i] for i in order[b:b + bs]]
            width = max(len(r.prompt) for r in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, r in enumerate(batch):  # left padding
                ids[row, width - len(r.prompt):] = torch.tensor(r.prompt)
                mask[row, width - len(r.prompt):] = 1
            longest = max(r.max_tokens for r in batch)
            if sampling:
                torch.manual_seed(batch[0].seed)
            model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=longest,
                           min_new_tokens=longest, do_sample=bool(sampling), **(sampling or {}))
        sync(device)
        res = Result("HF generate", sum(r.max_tokens for r in reqs), time.perf_counter() - start,
                     peak_gib(device), note=f"batch {bs} (best of {', '.join(map(str, batch_sizes))})",
                     extra=dict(batch_size=bs))
        tried[bs] = round(res.tok_per_s, 1)
        if best is None or res.seconds < best.seconds:
            best = res
    best.extra["tried"] = tried  # tok/s of every batch size
    return best


@torch.inference_mode()
def run_hf_continuous(model, reqs: list[Request], device: torch.device, sampling: dict | None = None,
                      max_memory_percent: float | None = None) -> Result:
    """transformers' continuous batching manager, each request with its own max_new_tokens
    (sampled workloads: one seed for the run; the manager has no per-request seeds). Its KV
    cache takes max_memory_percent of the free memory (None: transformers' default). Timed
    from the first request to the last result: the cache allocation and warm-up are set-up,
    like nanokv's LLM(...)."""
    import copy

    from transformers import ContinuousBatchingConfig

    config = copy.deepcopy(model.generation_config)
    if sampling:
        config.update(do_sample=True, **sampling)
    cb_config = ContinuousBatchingConfig(max_memory_percent=max_memory_percent,
                                         seed=reqs[0].seed if sampling else None)
    reset_peak(device)
    done = 0
    with model.continuous_batching_context_manager(generation_config=config, continuous_batching_config=cb_config,
                                                   block=True, timeout=5) as manager:
        sync(device)
        start = time.perf_counter()
        for i, r in enumerate(reqs):
            manager.add_request(r.prompt, request_id=str(i), max_new_tokens=r.max_tokens)
        tokens = 0
        while done < len(reqs):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done += 1
                tokens += len(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError("HF continuous batching stopped early")
        sync(device)
        seconds = time.perf_counter() - start
    useful = min(tokens, sum(r.max_tokens for r in reqs))
    return Result("HF continuous batching", useful, seconds, peak_gib(device))


def run_vllm(model_dir: str, reqs: list[Request], device: torch.device) -> Result:
    from vllm import LLM as VLLM, SamplingParams as VParams  # noqa: N811

    reset_peak(device)
    llm = VLLM(model_dir, enforce_eager=False)
    params = [VParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    prompts = [{"prompt_token_ids": r.prompt} for r in reqs]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return Result("vLLM", sum(len(o.outputs[0].token_ids) for o in outs), seconds, peak_gib(device))


# ---- roofline ---------------------------------------------------------------------------

def model_dims(hf_config) -> dict:
    h, layers = hf_config.hidden_size, hf_config.num_hidden_layers
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    d = getattr(hf_config, "head_dim", None) or h // heads
    inter, vocab = hf_config.intermediate_size, hf_config.vocab_size
    past_attention = heads * d * h + 3 * h * inter  # o_proj and the MLP
    per_layer = h * (heads + 2 * kv_heads) * d + past_attention
    return dict(layers=layers, heads=heads, kv_heads=kv_heads, head_dim=d, vocab=vocab, hidden=h,
                linear_params=layers * per_layer, head_params=vocab * h, past_attention_params=past_attention)


def workload_flops(dims: dict, reqs: list[Request], hit_tokens: int = 0) -> float:
    """Matmul FLOPs nanokv must do: every prompt token and every generated token but the
    last goes through the layers, except that of the prompt only the last token needs the
    last layer's o_proj and MLP; attention over its context; the LM head once per
    generated token. Prompt tokens found in the prefix cache (hit_tokens) skip the layers'
    projections."""
    flops = -2.0 * (dims["linear_params"] - dims["past_attention_params"]) * hit_tokens
    attn = 4 * dims["layers"] * dims["heads"] * dims["head_dim"]  # QK^T and PV, per (query, key)
    for r in reqs:
        computed = len(r.prompt) + r.max_tokens - 1
        flops += 2 * dims["linear_params"] * computed
        flops -= 2 * dims["past_attention_params"] * (len(r.prompt) - 1)
        flops += attn * computed * (computed + 1) / 2  # causal: query p sees p + 1 keys
        flops += 2 * dims["head_params"] * r.max_tokens
    return flops


def measured_gemm_rate(dims: dict, dtype: torch.dtype, device: torch.device) -> float:
    """FLOP/s of this machine on a model-shaped GEMM (tokens x hidden @ hidden x 3*hidden)."""
    a = torch.randn(1024, dims["hidden"], dtype=dtype, device=device)
    b = torch.randn(dims["hidden"], 3 * dims["hidden"], dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    sync(device)
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < 1.0:
        a @ b
        reps += 1
    sync(device)
    return reps * 2 * a.shape[0] * b.shape[0] * b.shape[1] / (time.perf_counter() - start)


def measured_copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (read + write)."""
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    sync(device)
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.5:
        y.copy_(x)
        reps += 1
    sync(device)
    return reps * 2 * x.numel() / (time.perf_counter() - start)


def machine_rate(dims: dict, dtype: torch.dtype, device: torch.device) -> float:
    """The roofline's denominator: GEMM FLOP/s on the CPU, copy bytes/s on a GPU."""
    return measured_gemm_rate(dims, dtype, device) if device.type == "cpu" else measured_copy_bandwidth(device)


def roofline(dims: dict, reqs: list[Request], nanokv: Result, dtype: torch.dtype, device: torch.device,
             rate: float) -> dict:
    if device.type == "cpu":
        flops = workload_flops(dims, reqs, nanokv.extra["kv"]["prefix_hit_tokens"])
        floor = flops / rate
        return dict(kind="FLOPs / measured GEMM rate", flops=flops, rate=rate, floor_seconds=floor,
                    percent=100 * floor / nanokv.seconds)
    elem = torch.empty(0, dtype=dtype).element_size()
    weights = (dims["linear_params"] + dims["head_params"]) * elem
    kv_per_token = 2 * dims["layers"] * dims["kv_heads"] * dims["head_dim"] * elem
    steps = nanokv.extra.get("steps", 0)
    kv_read = sum(kv_per_token * (len(r.prompt) + i) for r in reqs for i in range(r.max_tokens))
    total = weights * steps + kv_read
    floor = total / rate
    return dict(kind="HBM bytes (weights per step + KV read) / measured copy bandwidth", bytes=total,
                bandwidth=rate, floor_seconds=floor, percent=100 * floor / nanokv.seconds)


def keep_faster(best: Result, again: Result) -> Result:
    """Repeated runs of one engine: report the fastest, list them all. Peak memory stays the
    first run's (later runs share the process with the other engines' leftovers)."""
    runs = best.extra.setdefault("runs", [round(best.seconds, 2)])
    runs.append(round(again.seconds, 2))
    if again.seconds < best.seconds:
        best.seconds = again.seconds
        for key in ("kv", "kv_summary", "steps", "forward_seconds"):
            if key in again.extra:
                best.extra[key] = again.extra[key]
    return best


# ---- main -------------------------------------------------------------------------------

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


def run_workload(name: str, spec: dict, model_dir: str, hf_model, tokenizer, dims: dict, device: torch.device,
                 args, engines: set, sizes: list[int], rate: list) -> dict:
    """Every engine on one workload; the report of it. `hf_model()` loads the HF model on
    first use (after nanokv's first run, so that run's peak memory is its own); `rate`
    holds the machine's measured rate once the first nanokv run has measured it."""
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    sampling = SAMPLING if spec.get("chat") else None
    reqs = make_workload(spec, min(dims["vocab"], 32000), args.seed, tokenizer)
    results: list[Result] = []
    nano = hf = None
    if "nanokv" in engines:
        nano = run_nanokv(model_dir, reqs, device, args, sampling)
        results.append(nano)
        if not rate:
            # the machine's rate is measured now, before the other engines: transformers'
            # continuous batching leaves memory and threads behind that would skew it
            rate.append(machine_rate(dims, dtype, device))
    if "hf" in engines:
        hf = run_hf_generate(hf_model(), reqs, device, sizes, sampling)
        results.append(hf)
    # Shared machines drift over minutes: further rounds alternate nanokv and HF generate's
    # best batch size, and each keeps its fastest run.
    for _ in range(args.repeats - 1):
        if nano is not None:
            keep_faster(nano, run_nanokv(model_dir, reqs, device, args, sampling))
        if hf is not None:
            keep_faster(hf, run_hf_generate(hf_model(), reqs, device, [hf.extra["batch_size"]], sampling))
    for r in (nano, hf):
        if r is not None and args.repeats > 1:
            r.note = "; ".join(filter(None, [r.note, f"fastest of {args.repeats} runs"]))
    if "hf-cb" in engines:
        try:
            results.append(run_hf_continuous(hf_model(), reqs, device, sampling, args.hf_cb_memory))
        except Exception as e:  # report, do not hide: HF's CB support varies by version/device
            results.append(Result("HF continuous batching", 0, float("nan"), float("nan"),
                                  note=f"failed: {type(e).__name__}: {e}"[:120]))
    if "vllm" in engines and importlib.util.find_spec("vllm") is not None:
        results.append(run_vllm(model_dir, reqs, device))

    base = next((r for r in results if r.engine == "HF generate"), None)
    prompt_lens = list(spec["prompt"]) if "prompt" in spec else [min(len(r.prompt) for r in reqs),
                                                                 max(len(r.prompt) for r in reqs)]
    report = dict(workload=name, num_requests=len(reqs), prompt_lens=prompt_lens,
                  output_lens=list(spec["output"]), sampling=sampling or "greedy", model=args.label,
                  device=torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads",
                  dtype=str(dtype).replace("torch.", ""), torch=torch.__version__, results=[])
    for r in results:
        row = dict(engine=r.engine, output_tokens=r.output_tokens, seconds=round(r.seconds, 2),
                   tok_per_s=round(r.tok_per_s, 1) if r.output_tokens else None,
                   ratio_to_hf_generate=round(r.tok_per_s / base.tok_per_s, 2) if base and r.output_tokens else None,
                   peak_memory_gib=round(r.peak_memory_gib, 2), note=r.note, **r.extra)
        report["results"].append(row)
    if nano is not None:
        report["roofline"] = roofline(dims, reqs, nano, dtype, device, rate[0])
        report["outside_forward_percent"] = 100 * (1 - nano.extra["forward_seconds"] / nano.seconds)
        report["ms_per_step"] = 1000 * nano.seconds / nano.extra["steps"]
    return report


def print_report(report: dict) -> None:
    lens = "prompts {}-{}, outputs {}-{} tokens".format(*report["prompt_lens"], *report["output_lens"])
    sampling = report["sampling"] if report["sampling"] == "greedy" else "sampled ({})".format(
        ", ".join(f"{k} {v}" for k, v in report["sampling"].items()))
    print(f"workload {report['workload']}: {report['num_requests']} requests, {lens}, {sampling}, "
          f"{report['model']}, {report['device']}, {report['dtype']}, torch {report['torch']}\n")
    print("| engine | output tokens | seconds | tok/s | vs HF generate | peak memory (GiB) | note |")
    print("|---|---|---|---|---|---|---|")
    for row in report["results"]:
        ratio = f"{row['ratio_to_hf_generate']:.2f}x" if row["ratio_to_hf_generate"] else "-"
        tps = f"{row['tok_per_s']:,.0f}" if row["tok_per_s"] else "-"
        print(f"| {row['engine']} | {row['output_tokens']:,} | {row['seconds']:.1f} | {tps} | {ratio} | "
              f"{row['peak_memory_gib']:.2f} | {row['note']} |")
    nano = next((row for row in report["results"] if row["engine"] == "nanokv"), None)
    if nano is not None:
        rf = report["roofline"]
        print(f"\nnanokv {nano['kv_summary']}")
        print(f"nanokv steps {nano['steps']} ({report['ms_per_step']:.1f} ms each), backend {nano['backend']}, "
              f"time outside the model forward {report['outside_forward_percent']:.1f}%")
        print(f"roofline ({rf['kind']}): floor {rf['floor_seconds']:.1f} s; nanokv reaches {rf['percent']:.0f}% of it")


def print_side_by_side(reports: list[dict]) -> None:
    """One row per engine, one column group per workload."""
    print("\n| engine | " + " | ".join(f"{r['workload']}: tok/s | vs HF generate" for r in reports) + " |")
    print("|---|" + "---|---|" * len(reports))
    engines = list(dict.fromkeys(row["engine"] for r in reports for row in r["results"]))
    for engine in engines:
        cells = []
        for r in reports:
            row = next((x for x in r["results"] if x["engine"] == engine), None)
            ok = row is not None and row["tok_per_s"]
            cells += [f"{row['tok_per_s']:,.0f}" if ok else "-",
                      f"{row['ratio_to_hf_generate']:.2f}x" if ok and row["ratio_to_hf_generate"] else "-"]
        print(f"| {engine} | " + " | ".join(cells) + " |")


def main() -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
                   help="comma-separated subset of nanokv, hf, hf-cb, vllm")
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
    args = p.parse_args()
    names = [w for w in args.workload.split(",") if w]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown or not names:
        p.error(f"unknown workload {unknown or args.workload!r}; choose from {', '.join(WORKLOADS)}")
    if args.model and args.shape:
        p.error("give --model or --shape, not both")
    if not args.model and not args.shape:
        args.model, args.shape = (None, "qwen3-0.6b") if cuda else ("smollm2", None)
    try:
        specs = [workload_spec(w, args.num_requests, args.prompt_lens, args.output_lens) for w in names]
    except ValueError as e:
        p.error(str(e))

    device = torch.device("cuda" if cuda else "cpu")
    if args.hf_cb_memory is None and not cuda:
        args.hf_cb_memory = cpu_kv_budget_fraction()
    with tempfile.TemporaryDirectory(prefix="nanokv-bench-") as scratch:
        try:
            model_dir, args.label = resolve_model(args, scratch)
        except ValueError as e:  # a model that does not resolve: say how to get it
            p.exit(2, f"bench.py: error: {e}\n")
        from transformers import AutoConfig, AutoTokenizer

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

        rate: list[float] = []
        reports = []
        for w, spec in zip(names, specs):
            reports.append(run_workload(w, spec, model_dir, hf_model, tokenizer, dims, device, args, engines,
                                        sizes, rate))
            loaded.clear()  # reloaded for the next workload: nanokv's peak memory stays its own

    if args.json:
        print(json.dumps(reports[0] if len(reports) == 1 else dict(workloads=reports), indent=2, default=str))
        return
    for i, report in enumerate(reports):
        if i:
            print()
        print_report(report)
    if len(reports) > 1:
        print_side_by_side(reports)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import sys

    if sys.argv[1:2] == ["serve"]:  # the serving benchmark: benchmarks/serve.py
        from benchmarks.serve import main as serve_main

        sys.exit(serve_main(sys.argv[2:]))
    main()
