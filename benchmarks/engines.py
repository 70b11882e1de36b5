"""The engines run in bench.py's own process: nanokv (one row per Variant: weights, KV-cache
format, kernel width), Hugging Face generate (padded static batches), transformers'
continuous batching and vLLM. Each takes the same requests and returns a Result."""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

import torch

from benchmarks.measure import Result, peak_gib, reset_peak, sync
from benchmarks.workloads import Request, make_workload


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


def run_nanokv(model_dir: str, reqs: list[Request], device: torch.device, args, sampling: dict | None = None,
               engine_kwargs: dict | None = None) -> Result:
    from nanokv import LLM, SamplingParams

    reset_peak(device)
    kwargs = dict(device=str(device), max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager,
                  **(engine_kwargs or {}))
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
    pool_bytes = sum(t.numel() * t.element_size() for t in (runner.kv_cache, runner.kv_scales) if t is not None)
    block_bytes = pool_bytes / runner.kv_cache.shape[2]  # [layers, 2, blocks, ...]
    # the pool is allocated up front: its whole size is in the peak, what sequences used is not
    extra = dict(kv=asdict(kv), kv_summary=kv.summary(), steps=runner.num_steps,
                 forward_seconds=runner.forward_seconds, backend=llm.llm_engine.config.attention_backend,
                 kv_cache_dtype=llm.llm_engine.config.kv_cache_dtype, kv_pool_gib=round(pool_bytes / 2**30, 4),
                 kv_used_peak_gib=round(kv.peak_used_blocks * block_bytes / 2**30, 4),
                 kv_capacity_tokens=kv.capacity_tokens, kv_bytes_per_token=kv.bytes_per_token,
                 peak_running_seqs=kv.peak_running_seqs)
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


# ---- nanokv's weight formats and vector widths ------------------------------------------

@dataclass(frozen=True)
class Variant:
    """One nanokv configuration of a run: engine arguments and the vector width of its
    kernels (None: the CPU's own; 8 or 16 forced through NANOKV_CPU_WIDTH)."""

    label: str
    engine_kwargs: tuple = ()  # (name, value) pairs
    width: int | None = None


QUANTIZATIONS = {"none": {}, "int8": dict(quantization="int8"),
                 "int8+head": dict(quantization="int8", quantize_lm_head=True)}


def nanokv_variants(args) -> list[Variant]:
    """--dtype x --quantization x --kv-cache-dtype x --cpu-width, in that order (the first one
    is the baseline named "nanokv" when it is float32 with the auto KV cache at the native
    width); int8 keeps float32 activations, so it pairs with float32 only."""
    from nanokv.config import KV_CACHE_DTYPES

    out = []
    for dtype in args.dtype.split(","):
        for quant in args.quantization.split(","):
            if quant not in QUANTIZATIONS:
                raise ValueError(f"--quantization takes {', '.join(QUANTIZATIONS)}; got {quant!r}")
            if quant != "none" and dtype != "float32":
                continue
            for kv in getattr(args, "kv_cache_dtype", "auto").split(","):
                if kv not in KV_CACHE_DTYPES:
                    raise ValueError(f"--kv-cache-dtype takes {', '.join(KV_CACHE_DTYPES)}; got {kv!r}")
                for width in args.cpu_width.split(","):
                    if width not in ("native", "8", "16"):
                        raise ValueError(f"--cpu-width takes native, 8 or 16; got {width!r}")
                    width = None if width == "native" else int(width)
                    name = quant if quant != "none" else {"float32": "", "bfloat16": "bf16"}.get(dtype, dtype)
                    label = " ".join(filter(None, ["nanokv", name, f"kv {kv}" if kv != "auto" else "",
                                                   f"width {width}" if width else ""]))
                    kwargs = dict(QUANTIZATIONS[quant], **({} if dtype == "float32" else dict(dtype=dtype)),
                                  **({} if kv == "auto" else dict(kv_cache_dtype=kv)))
                    out.append(Variant(label, tuple(kwargs.items()), width))
    if not out:
        raise ValueError("no nanokv variant: int8 quantization pairs with --dtype float32")
    return out


def run_variant(variant: Variant, model_dir: str, reqs: list[Request], device: torch.device, args,
                sampling: dict | None = None) -> Result:
    """run_nanokv for one variant: its engine arguments, its kernels' width."""
    saved = os.environ.get("NANOKV_CPU_WIDTH")
    if variant.width is not None:
        os.environ["NANOKV_CPU_WIDTH"] = str(variant.width)
    try:
        res = run_nanokv(model_dir, reqs, device, args, sampling, dict(variant.engine_kwargs))
    finally:
        if saved is None:
            os.environ.pop("NANOKV_CPU_WIDTH", None)
        else:
            os.environ["NANOKV_CPU_WIDTH"] = saved
    res.engine = variant.label
    return res
