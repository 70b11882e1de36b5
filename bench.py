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
import sys
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
    # decode-heavy long contexts, where each step's KV read dominates: long prompts, outputs a
    # third of them (so that decode, not prefill, is most of the time), all wanted at once, in
    # a fixed KV budget (kv_cache_memory_bytes, 1 GiB: SmolLM2's float32 pool holds ~23k tokens
    # of the ~52k the 24 sequences need, ~10 at a time; int8 ~88k: all of them)
    "long": dict(num_requests=24, prompt=(1024, 2048), output=(512, 768), kv_cache_memory_bytes=1 << 30),
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


# ---- nanokv's weight formats and vector widths, CPU peers --------------------------------

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
        missing = [b for b in ("llama-server",) if llamacpp_binary(b) is None]
        if missing or gguf_file is None:
            why = (f"no {', '.join(missing)} (build llama.cpp; LLAMA_CPP_BIN names its bin directory)" if missing
                   else "needs a GGUF model (--model smollm2 or a .gguf file)")
            results.append(Result("llama.cpp q8_0", 0, float("nan"), float("nan"), note=why))
        else:
            results.append(run_llamacpp(gguf_file, reqs, args.scratch, min(args.max_num_seqs, len(reqs)), sampling))
    return results


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


# ---- microbenchmarks (--micro) ----------------------------------------------------------
# Each section measures, prints its own table and returns what --json prints under its
# name; MICRO_SECTIONS (below) lists them in the order --micro runs them.

def micro_host_time(device: torch.device, num_seqs: int = 256, context_lens: tuple[int, ...] = (40, 1000),
                    steps: int = 32, warmup: int = 5, quiet: bool = False) -> dict:
    """Host time per decode step, phase by phase, with num_seqs sequences decoding at each
    context length: the scheduler's schedule(), the runner's input preparation (prepare)
    and its attention plan (the backend's prepare), sampling (greedy, the model's vocab)
    and the engine's update (scheduler and output processor). No forward runs: what is
    left is what the host spends around it. Medians over `steps` decode steps, and the mean
    step (32 steps: two rounds of 16, in each of which every sequence starts a block once,
    whether they start them in the same step, as at short contexts, or spread out)."""
    import statistics

    from nanokv import SamplingParams
    from nanokv.config import EngineArgs
    from nanokv.llm_engine import LLMEngine
    from nanokv.testing.tiny import cached_tiny_checkpoint

    budget, block_size = 4096, 16

    def new_tokens(ctx: int) -> int:  # sequences prefilled early decode while the others prefill
        return -(-num_seqs * ctx // budget) + warmup + steps + 4

    longest = max(ctx + new_tokens(ctx) for ctx in context_lens)
    model_dir = cached_tiny_checkpoint("qwen3-tiny", max_position_embeddings=max(2048, longest))
    rows = []
    for ctx in context_lens:
        blocks = num_seqs * -(-(ctx + new_tokens(ctx)) // block_size)
        config = EngineArgs(model=model_dir, device=str(device), max_model_len=longest, max_num_seqs=num_seqs,
                            max_num_batched_tokens=budget, num_kvcache_blocks=blocks,
                            kvcache_block_size=block_size, enforce_eager=True).create_engine_config()
        engine = LLMEngine(config)
        runner, sched = engine.runner, engine.scheduler
        vocab = config.hf_config.vocab_size
        rng = random.Random(ctx)
        for _ in range(num_seqs):
            prompt = [rng.randrange(4, min(vocab, 1024)) for _ in range(ctx)]
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=new_tokens(ctx), ignore_eos=True))
        logits = torch.randn(num_seqs, vocab, device=device)
        phases = {k: [] for k in ("schedule", "prepare", "plan", "sample", "update")}
        decode_steps = 0
        while decode_steps < warmup + steps:
            t0 = time.perf_counter()
            batch = sched.schedule()
            t1 = time.perf_counter()
            inputs = runner.prepare(batch)
            t2 = time.perf_counter()
            runner.backend.prepare(inputs.meta, runner.block_size)
            t3 = time.perf_counter()
            rows_n = 0 if inputs.logits_rows is None else inputs.logits_rows.shape[0]
            out = runner.sample(logits[:rows_n] if rows_n else None, batch)
            t4 = time.perf_counter()
            engine._apply(batch, out, {})
            t5 = time.perf_counter()
            if len(batch.seqs) == num_seqs and all(len(s.token_ids) == 1 for s in batch.seqs):
                decode_steps += 1
                if decode_steps > warmup:
                    for key, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                        phases[key].append(1000 * dt)
        row = dict(context=ctx, num_seqs=num_seqs, backend=config.attention_backend, vocab=vocab,
                   **{f"{k}_ms": round(statistics.median(v), 3) for k, v in phases.items()})
        row["total_ms"] = round(sum(row[f"{k}_ms"] for k in phases), 3)
        row["mean_step_ms"] = round(statistics.mean(map(sum, zip(*phases.values()))), 3)
        rows.append(row)
        engine.close()
        del engine, runner, sched
    result = dict(section="host time per decode step", device=str(device), threads=torch.get_num_threads(),
                  rows=rows)
    if not quiet:
        print(f"host time per decode step, {num_seqs} sequences decoding, median of {steps} steps "
              f"(no forward; {device}, {torch.get_num_threads()} threads, backend {rows[0]['backend']}, "
              f"greedy over vocab {rows[0]['vocab']})\n")
        print("| context | schedule | prepare | attention plan | sample | update | total (ms) | mean step (ms) |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['context']} | {r['schedule_ms']:.3f} | {r['prepare_ms']:.3f} | {r['plan_ms']:.3f} | "
                  f"{r['sample_ms']:.3f} | {r['update_ms']:.3f} | {r['total_ms']:.3f} | {r['mean_step_ms']:.3f} |")
    return result


# ---- micro: the sampler ----------------------------------------------------------------

# (column, SamplingParams fields): each mode adds to the one before, greedy aside
MICRO_SAMPLER_MODES = [
    ("greedy", dict(temperature=0)),
    ("temperature", dict(temperature=0.8)),
    ("+ top_p", dict(temperature=0.8, top_p=0.95)),
    ("+ seeds", dict(temperature=0.8, top_p=0.95, seed=True)),
    ("+ top_k", dict(temperature=0.8, top_p=0.95, seed=True, top_k=50)),
    ("+ penalties", dict(temperature=0.8, top_p=0.95, seed=True, top_k=50, repetition_penalty=1.1,
                         presence_penalty=0.3, frequency_penalty=0.3)),
    ("+ logprobs", dict(temperature=0.8, top_p=0.95, seed=True, top_k=50, repetition_penalty=1.1,
                        presence_penalty=0.3, frequency_penalty=0.3, logprobs=5)),
]


def model_logits(model_dir: str, device: torch.device, num_rows: int) -> torch.Tensor:
    """num_rows next-token logits [num_rows, vocab] the model produced while nanokv sampled
    the chat workload (temperature 0.8, top_p 0.95): a model's real distributions."""
    from nanokv import LLM, SamplingParams

    llm = LLM(model_dir, device=str(device), max_model_len=512)
    reqs = make_workload(workload_spec("chat", num_requests=32), 1000, tokenizer=llm.get_tokenizer())
    runner, rows = llm.llm_engine.runner, []
    real = runner.sample

    def sample(logits, batch):
        if logits is not None:
            rows.append(logits.float().cpu())
        return real(logits, batch)

    runner.sample = sample
    params = [SamplingParams(**SAMPLING, seed=r.seed, max_tokens=-(-num_rows // len(reqs)), ignore_eos=True)
              for r in reqs]
    llm.generate([r.prompt for r in reqs], params, use_tqdm=False)
    return torch.cat(rows)[:num_rows]


def fit_vocab(logits: torch.Tensor, vocab: int, seed: int = 0) -> torch.Tensor:
    """Rows of logits resized to vocab: cut to the first ids, or widened with extra tokens
    whose logits are drawn from the row's own lower 95% (a larger vocabulary adds rare
    tokens), the columns then shuffled."""
    if logits.shape[1] >= vocab:
        return logits[:, :vocab].contiguous()
    g = torch.Generator().manual_seed(seed)
    low = logits.sort(dim=1).values[:, :int(0.95 * logits.shape[1])]
    extra = low.gather(1, torch.randint(0, low.shape[1], (len(logits), vocab - logits.shape[1]), generator=g))
    return torch.cat([logits, extra], dim=1)[:, torch.randperm(vocab, generator=g)].contiguous()


def micro_batch(params: dict, num_rows: int, vocab: int, first_id: int, rng: random.Random):
    """One decode step of num_rows sequences (a 200-token prompt, 50 tokens generated)."""
    from nanokv import SamplingParams
    from nanokv.engine.types import ScheduledBatch, ScheduledSeq

    batch = ScheduledBatch()
    for i in range(num_rows):
        seeded = dict(params, seed=first_id + i if params.get("seed") else None)
        tokens = [rng.randrange(vocab) for _ in range(250)]
        batch.seqs.append(ScheduledSeq(first_id + i, tokens[-1:], 249, [], True, SamplingParams(**seeded),
                                       seed=seeded["seed"], num_generated=50, all_token_ids=tokens,
                                       num_prompt_tokens=200))
        batch.num_tokens += 1
    return batch


def micro_sampler(model_dir: str, label: str, device: torch.device, vocabs: list[int], num_rows: int = 256,
                  repeats: int = 3) -> list[dict]:
    """ModelRunner.sample per step (settings to tensors, sampling, tokens to the host) at
    num_rows rows for each mode of MICRO_SAMPLER_MODES, on random normal logits and on the
    model's own (fit_vocab), for each vocabulary size; on the CPU with one thread. The
    modes alternate within a round; each keeps its fastest of `repeats` rounds after a
    warm-up (wall clock, and this thread's CPU time, which other processes on the machine
    disturb less); each step is one token later than the one before (seeds and penalty
    counts move on)."""
    from nanokv import LLM
    from nanokv.testing.tiny import cached_tiny_checkpoint

    real = model_logits(model_dir, device, num_rows)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    rng = random.Random(0)
    names = [name for name, _ in MICRO_SAMPLER_MODES]
    reports = []
    try:
        for vocab in vocabs:
            llm = LLM(cached_tiny_checkpoint("qwen3-tiny", vocab_size=vocab), device=str(device), max_model_len=256,
                      max_num_seqs=num_rows, num_kvcache_blocks=16)
            runner = llm.llm_engine.runner
            kinds = {"random normal": torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(0)),
                     label: fit_vocab(real, vocab)}
            for kind, logits in kinds.items():
                logits = logits.to(device)
                batches = [micro_batch(params, num_rows, vocab, (m + 1) << 20, rng)
                           for m, (_, params) in enumerate(MICRO_SAMPLER_MODES)]
                wall, cpu = [[] for _ in batches], [[] for _ in batches]
                for _ in range(repeats + 1):
                    for i, batch in enumerate(batches):
                        step_logits = logits.clone()  # penalties and masks write into the logits
                        sync(device)
                        start, start_cpu = time.perf_counter(), time.thread_time()
                        runner.sample(step_logits, batch)
                        wall[i].append(time.perf_counter() - start)
                        cpu[i].append(time.thread_time() - start_cpu)
                        for seq in batch.seqs:  # the next step: one more generated token
                            seq.all_token_ids.append(rng.randrange(vocab))
                            seq.num_generated += 1
                best, best_cpu = [min(t[1:]) for t in wall], [min(t[1:]) for t in cpu]
                reports.append(dict(
                    vocab=vocab, logits=kind, rows=num_rows, runs=repeats, threads=torch.get_num_threads(),
                    ms_per_step={n: round(1000 * b, 2) for n, b in zip(names, best)},
                    vs_greedy={n: round(b / best[0], 2) for n, b in zip(names, best)},
                    cpu_ms_per_step={n: round(1000 * b, 2) for n, b in zip(names, best_cpu)},
                    cpu_vs_greedy={n: round(b / best_cpu[0], 2) for n, b in zip(names, best_cpu)},
                    all_ms={n: [round(1000 * x, 1) for x in t[1:]] for n, t in zip(names, wall)}))
            del llm, runner
    finally:
        torch.set_num_threads(threads)
    return reports


def print_micro_sampler(reports: list[dict]) -> None:
    names = [name for name, _ in MICRO_SAMPLER_MODES]
    added, before = [], {}
    for name, params in MICRO_SAMPLER_MODES[1:]:
        new = {k: v for k, v in params.items() if before.get(k) != v}
        added.append(f"{name}: " + ", ".join(f"{k} {'per request' if v is True else v}" for k, v in new.items()))
        before = params
    first = reports[0]
    print(f"sampler: ModelRunner.sample per step at {first['rows']} rows (200-token prompts, 50+ tokens "
          f"generated), {first['threads']} thread(s), fastest of {first['runs']} rounds, wall ms (x greedy) "
          f"and CPU ms (x greedy); each mode adds to the one before ({'; '.join(added)})\n")
    print("| vocab | logits | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for r in reports:
        cells = [f"{r['ms_per_step'][n]:.1f} ({r['vs_greedy'][n]:.2f}x), {r['cpu_ms_per_step'][n]:.1f} "
                 f"({r['cpu_vs_greedy'][n]:.2f}x)" for n in names]
        print(f"| {r['vocab']:,} | {r['logits']} | " + " | ".join(cells) + " |")


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
    variants = nanokv_variants(args) if "nanokv" in engines else []
    kv_budget = args.kv_cache_memory_bytes or spec.get("kv_cache_memory_bytes")
    if kv_budget:  # one byte budget for every variant: their pools' token capacities compare
        variants = [Variant(v.label, v.engine_kwargs + (("kv_cache_memory_bytes", kv_budget),), v.width)
                    for v in variants]
    others: dict[Variant, Result] = {}  # the variants after the first
    if variants:
        nano = run_variant(variants[0], model_dir, reqs, device, args, sampling)
        results.append(nano)
        if not rate:
            # the machine's rate is measured now, before the other engines: transformers'
            # continuous batching leaves memory and threads behind that would skew it
            rate.append(machine_rate(dims, dtype, device))
        for v in variants[1:]:
            others[v] = run_variant(v, model_dir, reqs, device, args, sampling)
            results.append(others[v])
    if "hf" in engines:
        hf = run_hf_generate(hf_model(), reqs, device, sizes, sampling)
        results.append(hf)
    # Shared machines drift over minutes: further rounds alternate nanokv and HF generate's
    # best batch size, and each keeps its fastest run.
    for _ in range(args.repeats - 1):
        if nano is not None:
            keep_faster(nano, run_variant(variants[0], model_dir, reqs, device, args, sampling))
            for v, r in others.items():
                keep_faster(r, run_variant(v, model_dir, reqs, device, args, sampling))
        if hf is not None:
            keep_faster(hf, run_hf_generate(hf_model(), reqs, device, [hf.extra["batch_size"]], sampling))
    for r in (nano, hf, *others.values()):
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
    if device.type == "cpu":
        results += run_cpu_peers(engines, model_dir, reqs, args, sizes, sampling)

    base = next((r for r in results if r.engine == "HF generate"), None)
    prompt_lens = list(spec["prompt"]) if "prompt" in spec else [min(len(r.prompt) for r in reqs),
                                                                 max(len(r.prompt) for r in reqs)]
    report = dict(workload=name, num_requests=len(reqs), prompt_lens=prompt_lens,
                  output_lens=list(spec["output"]), sampling=sampling or "greedy", model=args.label,
                  device=torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads",
                  dtype=str(dtype).replace("torch.", ""), torch=torch.__version__, kv_cache_memory_bytes=kv_budget,
                  results=[])
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
    cuda = not report["device"].startswith("CPU")
    measured = "peak allocated" if cuda else "peak RSS"
    print(f"| engine | output tokens | seconds | tok/s | vs HF generate | {measured} (GiB) | of it, KV pool: "
          "allocated / used at peak (GiB) | note |")
    print("|---|---|---|---|---|---|---|---|")
    for row in report["results"]:
        ratio = f"{row['ratio_to_hf_generate']:.2f}x" if row["ratio_to_hf_generate"] else "-"
        tps = f"{row['tok_per_s']:,.0f}" if row["tok_per_s"] else "-"
        pool = f"{row['kv_pool_gib']:.3g} / {row['kv_used_peak_gib']:.3g}" if "kv_pool_gib" in row else "-"
        print(f"| {row['engine']} | {row['output_tokens']:,} | {row['seconds']:.1f} | {tps} | {ratio} | "
              f"{row['peak_memory_gib']:.2f} | {pool} | {row['note']} |")
    print(f"\n{measured}: " + ("torch's peak allocated device memory" if cuda else "the process's peak resident "
                                "memory (VmHWM)") + " during the run. nanokv allocates its KV pool up front "
          "(gpu_memory_utilization or kv_cache_memory_bytes), so its peak holds the whole pool, used or not; "
          "HF's cache grows with its batch and is inside its peak.")
    budget = report.get("kv_cache_memory_bytes")
    for row in report["results"]:
        if "kv_capacity_tokens" in row:
            print(f"\n{row['engine']}: KV {row['kv_cache_dtype']}, {row['kv_bytes_per_token']:,} bytes per token: "
                  f"the pool holds {row['kv_capacity_tokens']:,} tokens"
                  + (f" in {budget / 2**30:.3g} GiB" if budget else "")
                  + f"; peak {row['peak_running_seqs']} concurrent sequences, "
                  f"{row['kv']['num_preemptions']} preemptions")
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


def micro_host_time_section(args, model_dir: str, device: torch.device, quiet: bool) -> dict:
    return micro_host_time(device, quiet=quiet)


def micro_sampler_section(args, model_dir: str, device: torch.device, quiet: bool) -> list[dict]:
    vocabs = [int(v) for v in args.micro_vocabs.split(",") if v]
    reports = micro_sampler(model_dir, args.label, device, vocabs, repeats=args.micro_repeats)
    if not quiet:
        print_micro_sampler(reports)
    return reports


# --micro's sections in the order it runs them: each measures, prints its own table unless
# quiet, and returns what --json prints under its name
MICRO_SECTIONS = {"host_time": micro_host_time_section, "sampler": micro_sampler_section}


def run_micro(args, model_dir: str, device: torch.device) -> None:
    """--micro: every section of MICRO_SECTIONS, one after the other (or one JSON object)."""
    results = {}
    names = [n for n in args.micro_sections.split(",") if n]
    for i, name in enumerate(names):
        section = MICRO_SECTIONS[name]
        if i and not args.json:
            print()
        results[name] = section(args, model_dir, device, quiet=args.json)
    if args.json:
        print(json.dumps(results, indent=2, default=str))


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
    args = p.parse_args()
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
    try:
        specs = [workload_spec(w, args.num_requests, args.prompt_lens, args.output_lens) for w in names]
        nanokv_variants(args)
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
