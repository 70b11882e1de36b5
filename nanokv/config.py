"""Engine configuration: create_engine_config() resolves the engine arguments (EngineArgs,
nanokv.engine.arg_utils) against the model into an EngineConfig, validated once, which
nothing writes back into."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from nanokv.generation_config import default_sampling_params, read_generation_config
from nanokv.model_config import model_head_dim  # noqa: F401 - where models/ and tests read it

logger = logging.getLogger("nanokv")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


@dataclass(frozen=True)
class EngineConfig:
    """The resolved, validated engine settings (EngineArgs.create_engine_config)."""

    model: str
    hf_config: Any = field(repr=False)
    architecture: str
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_kvcache_blocks: int | None
    kv_cache_memory_bytes: int | None
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    enforce_eager: bool
    seed: int
    eos_token_ids: tuple[int, ...]
    attention_backend: str
    tensor_parallel_size: int
    max_logprobs: int
    head_dim: int  # per attention head, from the model config (model_head_dim)
    # how the CPU kernels pack the projection / LM head weights: None (the weights in dtype),
    # "bfloat16" (dtype bfloat16 on the CPU kernels; dtype is then float32, the activations')
    # or "int8" (quantization); see _resolve_weights
    weight_format: str | None = None
    lm_head_format: str | None = None
    # "auto" (K/V stored in dtype), "int8" or "fp8": quantized pages with a float16 (scale,
    # zero) per (token, KV head) in a parallel tensor (runner/kv_cache.py)
    kv_cache_dtype: str = "auto"
    tokenizer: str | None = None  # a tokenizer directory or .gguf other than the model; None: the model's
    tokenizer_mode: str = "auto"  # "auto" / "hf" (the fast tokenizer) or "slow"
    # SamplingParams field -> the model's default (generation_config.py), for the fields a
    # request leaves unset; empty: SamplingParams' own defaults
    default_sampling_params: dict[str, Any] = field(default_factory=dict)
    disable_log_stats: bool = False  # no KV cache summary lines
    served_model_name: tuple[str, ...] | None = None  # the server's names when its flag gives none


def create_engine_config(args) -> EngineConfig:
    """Resolve 'auto' values and validate every engine argument (an EngineArgs,
    nanokv.engine.arg_utils) against the model: EngineArgs.create_engine_config()."""
    import nanokv.gguf as gguf
    from nanokv.layers.activation import check_activation
    from nanokv.loader import check_checkpoint
    from nanokv.models import resolve_architecture

    _log_no_effect(args)
    _check_vllm_args(args)  # before the model loads: these need no model
    tokenizer = _resolve_tokenizer(args.tokenizer, args.tokenizer_mode)
    model = gguf.resolve_model(args.model)  # a built-in name ("smollm2") -> its file
    _start_kernel_build(args.device)  # on a first start the compiler runs while the config loads
    hf_config = load_hf_config(model)
    is_gguf = gguf.find_gguf(model) is not None
    _check_load_format(args.load_format, model, is_gguf)
    hf_config = _apply_hf_overrides(hf_config, args.hf_overrides)
    architecture = resolve_architecture(hf_config)
    check_activation(hf_config)
    check_checkpoint(model, hf_config)  # sizes and values against the weights, before anything is allocated
    dev = _resolve_device(args.device)
    torch_dtype = _resolve_dtype(args.dtype, hf_config, dev)
    torch_dtype, weight_format, lm_head_format = _resolve_weights(torch_dtype, dev, args.quantization,
                                                                  args.quantize_lm_head)

    derived_max_len = int(getattr(hf_config, "max_position_embeddings", 0) or 0) or 2048
    max_model_len = derived_max_len if args.max_model_len is None else args.max_model_len
    _check_int("max_model_len", max_model_len, 2)
    if max_model_len > derived_max_len:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings "
            f"({derived_max_len}); lower max_model_len")
    _check_int("max_num_seqs", args.max_num_seqs, 1)
    max_num_batched_tokens = args.max_num_batched_tokens
    if max_num_batched_tokens is None:
        max_num_batched_tokens = max(4096, args.max_num_seqs)
    _check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
    _check_int("kvcache_block_size", args.kvcache_block_size, 1)
    if args.num_kvcache_blocks is not None:
        _check_int("num_kvcache_blocks", args.num_kvcache_blocks, 1)
    if args.kv_cache_memory_bytes is not None:
        _check_int("kv_cache_memory_bytes", args.kv_cache_memory_bytes, 1)
    seed = args.seed
    if seed is None:  # vLLM's meaning: not reproducible from run to run
        seed = int.from_bytes(os.urandom(8), "little") >> 1
    _check_int("seed", seed, -(2**63))
    _check_int("max_logprobs", args.max_logprobs, -1)  # -1: no limit (vLLM's meaning)
    _check_bool("enable_prefix_caching", args.enable_prefix_caching)
    _check_bool("enforce_eager", args.enforce_eager)
    if (isinstance(args.gpu_memory_utilization, bool) or not isinstance(args.gpu_memory_utilization, (int, float))
            or not 0 < args.gpu_memory_utilization <= 1):
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {args.gpu_memory_utilization!r}")

    _check_tensor_parallel(args.tensor_parallel_size, hf_config, dev)
    from nanokv.attention import resolve_backend

    head_dim = model_head_dim(hf_config)
    if not isinstance(args.attention_backend, str):
        raise ValueError(f"attention_backend must be a string, got {args.attention_backend!r}")
    backend = resolve_backend(args.attention_backend, dev, args.kvcache_block_size, torch_dtype, head_dim)
    if args.attention_backend == "auto" and backend == "flash_attn" and args.kv_cache_dtype in ("int8", "fp8"):
        backend = "triton"  # flash_attn reads no quantized pages; triton is importable wherever flash_attn is
    kv_cache_dtype = _resolve_kv_cache_dtype(args.kv_cache_dtype, dev, backend)
    defaults = default_sampling_params(model, is_gguf, args.generation_config, args.override_generation_config)
    if defaults:
        logger.info("default sampling parameters from the model's generation config: %s (for the fields a "
                    "request leaves unset; generation_config='vllm' turns this off)", defaults)
    return EngineConfig(
        model=model, hf_config=hf_config, architecture=architecture, dtype=torch_dtype,
        device=dev, max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, block_size=args.kvcache_block_size,
        num_kvcache_blocks=args.num_kvcache_blocks, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=float(args.gpu_memory_utilization),
        enable_prefix_caching=args.enable_prefix_caching, enforce_eager=args.enforce_eager,
        seed=int(seed), eos_token_ids=tuple(_eos_token_ids(model, hf_config)),
        attention_backend=backend, tensor_parallel_size=args.tensor_parallel_size,
        max_logprobs=args.max_logprobs, head_dim=head_dim, weight_format=weight_format,
        lm_head_format=lm_head_format, kv_cache_dtype=kv_cache_dtype, tokenizer=tokenizer,
        tokenizer_mode=args.tokenizer_mode, default_sampling_params=defaults,
        disable_log_stats=args.disable_log_stats, served_model_name=_served_model_name(args.served_model_name),
    )


def _log_no_effect(args) -> None:
    """Once per engine: the arguments given that change nothing here (EngineArgs fields
    marked no_effect, their help says why)."""
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if f.metadata.get("no_effect") and value != f.default:
            logger.info("engine argument %s=%r: %s", f.name, value, f.metadata["help"])


def _check_load_format(load_format, model: str, is_gguf: bool) -> None:
    if load_format == "auto":
        return
    if load_format == "dummy":
        raise ValueError("load_format='dummy' (random weights) is not supported; load a checkpoint (a random one "
                         "for tests: nanokv.testing.tiny) with load_format='auto'")
    if load_format not in ("safetensors", "gguf"):
        raise ValueError(f"load_format={load_format!r} is not supported: nanokv loads safetensors (a Hugging "
                         "Face directory) and GGUF files; use 'auto', 'safetensors' or 'gguf'")
    if (load_format == "gguf") != is_gguf:
        holds = "a GGUF file" if is_gguf else "a Hugging Face (safetensors) directory"
        raise ValueError(f"load_format={load_format!r} but {model} is {holds}; use load_format='auto'")


def _apply_hf_overrides(hf_config, overrides):
    """hf_overrides set on a copy of the config (nested dicts update sub-configs such as
    text_config) before anything reads it: the checks against the weights that follow
    refuse an override the checkpoint does not match."""
    if overrides is None:
        return hf_config
    if not isinstance(overrides, dict):
        raise ValueError(f"hf_overrides must be a dict of config.json fields, got {overrides!r}")
    config = copy.deepcopy(hf_config)

    def update(target, values: dict, where: str) -> None:
        for key, value in values.items():
            if not isinstance(key, str) or not key.isidentifier() or key.startswith("_"):
                raise ValueError(f"{where}: {key!r} is not a config field name")
            current = getattr(target, key, None)
            if isinstance(value, dict) and hasattr(current, "to_dict"):  # a sub-config
                update(current, value, f"{where}.{key}")
            else:
                setattr(target, key, value)

    update(config, overrides, "hf_overrides")
    return config


_POOLING_TASKS = ("embed", "embedding", "pooling", "classify", "score", "reward")


def _check_vllm_args(args) -> None:
    """vLLM's arguments: the values nanokv implements, and a reason for those it refuses."""
    for name in ("task", "runner"):
        value = getattr(args, name)
        if value in _POOLING_TASKS:
            raise ValueError(f"{name}={value!r} is refused: pooling models (embeddings, classification, scores, "
                             f"rewards) are not supported by nanokv, which generates text; use {name}='generate'")
        if value not in ("auto", "generate"):
            raise ValueError(f"unknown {name} {value!r}; use 'auto' or 'generate'")
    if args.enable_chunked_prefill is False:
        raise ValueError("enable_chunked_prefill=False is refused: nanokv always prefills a long prompt in chunks "
                         "of at most max_num_batched_tokens tokens per step; to prefill whole prompts in one step "
                         "set max_num_batched_tokens >= max_model_len")
    if args.enable_chunked_prefill is not None:
        _check_bool("enable_chunked_prefill", args.enable_chunked_prefill)
    for name in ("disable_log_stats", "trust_remote_code"):
        _check_bool(name, getattr(args, name))
    for name in ("swap_space", "cpu_offload_gb"):
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{name} must be a number >= 0 (GiB), got {value!r}")
    if args.cpu_offload_gb > 0:
        raise ValueError(f"cpu_offload_gb={args.cpu_offload_gb!r} is refused: nanokv keeps every weight on the "
                         "device (on the CPU they are in memory already); use cpu_offload_gb=0, device='cpu', "
                         "quantization='int8' or tensor_parallel_size")
    if args.max_seq_len_to_capture is not None:
        _check_int("max_seq_len_to_capture", args.max_seq_len_to_capture, 1)
    if args.compilation_config is not None and (isinstance(args.compilation_config, bool)
                                                or not isinstance(args.compilation_config, (int, dict))):
        raise ValueError(f"compilation_config must be a dict, an int or None, got {args.compilation_config!r}")
    backend = args.distributed_executor_backend
    if backend in ("ray", "external_launcher"):
        why = ("Ray is not supported" if backend == "ray" else
               "data parallelism runs as nanokv generate under torchrun, one engine per process")
        raise ValueError(f"distributed_executor_backend={backend!r} is refused: {why}; tensor_parallel_size > 1 "
                         "runs nanokv's own worker processes ('mp')")
    if backend not in (None, "mp", "uni"):
        raise ValueError(f"unknown distributed_executor_backend {backend!r}; use None, 'mp' or 'uni'")
    if backend == "uni" and args.tensor_parallel_size != 1:
        raise ValueError("distributed_executor_backend='uni' runs one process, but tensor_parallel_size="
                         f"{args.tensor_parallel_size}; use 'mp' or None")


def _resolve_tokenizer(tokenizer, mode) -> str | None:
    """The tokenizer's path (None: the model's), and tokenizer_mode checked; LLMEngine loads
    it and checks its vocabulary against the model's."""
    import nanokv.gguf as gguf

    if mode == "mistral":
        raise ValueError("tokenizer_mode='mistral' (mistral_common's tokenizer) is not supported; use 'auto' "
                         "with a tokenizer directory holding tokenizer.json")
    if mode not in ("auto", "hf", "slow"):
        raise ValueError(f"unknown tokenizer_mode {mode!r}; use 'auto', 'hf' or 'slow'")
    if tokenizer is None:
        return None
    if not isinstance(tokenizer, str):
        raise ValueError(f"tokenizer must be a path, got {tokenizer!r}")
    path = gguf.resolve_model(tokenizer)
    if not os.path.isdir(path) and gguf.find_gguf(path) is None:
        raise ValueError(f"tokenizer {tokenizer!r} is neither a directory nor a .gguf file; give a local "
                         "tokenizer directory (tokenizer.json and the like) or .gguf file")
    if mode == "slow" and gguf.find_gguf(path) is not None:
        raise ValueError("tokenizer_mode='slow' has no meaning for a .gguf tokenizer (transformers reads it as "
                         "a fast one); use tokenizer_mode='auto'")
    return path


def _served_model_name(value) -> tuple[str, ...] | None:
    if value is None:
        return None
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"served_model_name must be a non-empty name or list of names, got {value!r}")
    return tuple(names)


def _check_tensor_parallel(n: int, hf_config, device: torch.device) -> None:
    _check_int("tensor_parallel_size", n, 1)
    if n == 1:
        return
    heads, kv_heads, vocab = hf_config.num_attention_heads, hf_config.num_key_value_heads, hf_config.vocab_size
    if heads % n:
        raise ValueError(f"tensor_parallel_size={n} must divide num_attention_heads={heads}")
    if (kv_heads % n) if kv_heads >= n else (n % kv_heads):
        raise ValueError(f"tensor_parallel_size={n} and num_key_value_heads={kv_heads}: one must divide "
                         "the other (KV heads are split, or replicated when there are fewer than ranks)")
    if vocab % n:
        raise ValueError(f"tensor_parallel_size={n} must divide vocab_size={vocab} (vocab-parallel embedding)")
    if hf_config.intermediate_size % n:
        raise ValueError(f"tensor_parallel_size={n} must divide intermediate_size={hf_config.intermediate_size}")
    if device.type == "cuda" and n > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={n} but only {torch.cuda.device_count()} CUDA devices are visible")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def load_hf_config(model: str):
    """The checkpoint's transformers config; ValueError when `model` is no model directory."""
    import nanokv.gguf as gguf

    if (gguf_file := gguf.find_gguf(model)) is not None:
        return gguf.load_config(gguf_file)
    if not os.path.isdir(model):
        raise ValueError(
            f"model {model!r} is not a directory; nanokv loads local Hugging Face model "
            "directories (config.json + *.safetensors); download the model first")
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"{model!r} has no config.json; point model at a Hugging Face model directory")
    from nanokv.loader import check_layer_count_early

    check_layer_count_early(model)
    from transformers import AutoConfig  # not for a GGUF: load_config avoids transformers' config classes

    try:
        return AutoConfig.from_pretrained(model)
    except Exception as e:  # unknown model_type and the like: report as a user error
        raise ValueError(f"cannot read {model}/config.json: {e}") from e


def _resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {device!r}; use 'auto', 'cpu' or 'cuda'") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available; use device='cpu'")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device!r}; use 'auto', 'cpu' or 'cuda'")
    return dev


def _resolve_dtype(dtype: str | torch.dtype, hf_config, device: torch.device) -> torch.dtype:
    """"auto": float32 on the CPU (exact and fast there); on CUDA the checkpoint's dtype,
    with float32 checkpoints run in bfloat16 (vLLM picks half precision the same way)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use float32, float16 or bfloat16")
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        cfg = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(cfg, str):
            cfg = _DTYPES.get(cfg)
        return cfg if cfg in (torch.float16, torch.bfloat16) else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use 'auto', 'float32', 'float16' or 'bfloat16'")
    return _DTYPES[dtype]


QUANTIZATIONS = ("int8",)
KV_CACHE_DTYPES = ("auto", "int8", "fp8")


def _resolve_kv_cache_dtype(kv_cache_dtype, device: torch.device, backend: str) -> str:
    """'auto', 'int8' or 'fp8', checked against the device and the attention backend."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; use one of {', '.join(KV_CACHE_DTYPES)}")
    if kv_cache_dtype == "fp8" and (device.type != "cuda" or backend != "triton"):
        raise ValueError("kv_cache_dtype='fp8' (e4m3) runs on CUDA with attention_backend='triton' only; "
                         "on the CPU use kv_cache_dtype='int8'")
    if kv_cache_dtype != "auto" and backend == "flash_attn":
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not read by flash_attn; set "
                         "attention_backend='triton' (or kv_cache_dtype='auto')")
    return kv_cache_dtype


def _start_kernel_build(device) -> None:
    """Begin building the C kernels in the background when the engine will run on the CPU
    (ModelRunner's choose_kernels then waits for that build). A bad device or
    NANOKV_CPU_WIDTH is reported later, in its turn."""
    import nanokv.kernels.build as build

    try:
        if _resolve_device(device).type == "cpu":
            build.start_build(build.width())
    except ValueError:
        pass


def _resolve_weights(dtype: torch.dtype, device: torch.device, quantization, quantize_lm_head
                     ) -> tuple[torch.dtype, str | None, str | None]:
    """(activation dtype, weight_format, lm_head_format). On the CPU with the C kernels at
    hand (a compiler; nothing is compiled here), bfloat16 means bfloat16 weights under float32
    activations, accumulation and KV cache; int8 (quantization) means int8 projection weights
    (and LM head, with quantize_lm_head) under float32 activations. Without the kernels
    bfloat16 runs the torch path in bfloat16, and int8 is refused."""
    import nanokv.kernels as kernels

    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; nanokv supports quantization='int8' (CPU) "
                         "or None")
    _check_bool("quantize_lm_head", quantize_lm_head)
    if quantize_lm_head and quantization is None:
        raise ValueError("quantize_lm_head=True applies with quantization='int8'; set both")
    on_kernels = device.type == "cpu" and kernels.can_build()
    if quantization == "int8":
        if device.type != "cpu":
            raise ValueError("quantization='int8' runs on the CPU kernels; use device='cpu', or no quantization")
        if dtype != torch.float32:
            raise ValueError(f"quantization='int8' keeps float32 activations; use dtype='auto' or 'float32' "
                             f"(got {dtype})")
        if not on_kernels:
            raise ValueError("quantization='int8' needs the CPU kernels: a C compiler (cc/gcc on PATH) and "
                             "NANOKV_CPU_KERNELS unset")
        return torch.float32, "int8", "int8" if quantize_lm_head else None
    if dtype == torch.bfloat16 and on_kernels:
        return torch.float32, "bfloat16", "bfloat16"
    return dtype, None, None


def _eos_token_ids(model: str, hf_config) -> list[int]:
    """EOS ids from config.json and generation_config.json, united (Llama 3 instruct lists
    several there). Ids outside the vocabulary can never be generated: they are dropped
    with a warning."""
    ids: list[int] = []

    def add(value) -> None:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and not isinstance(v, bool) and v not in ids:
                ids.append(v)

    add(getattr(hf_config, "eos_token_id", None))
    generation = read_generation_config(model) if os.path.isdir(model) else None
    if generation is not None:
        add(generation.get("eos_token_id"))
    vocab = hf_config.vocab_size
    outside = [i for i in ids if not 0 <= i < vocab]
    if outside:
        logger.warning("%s: EOS token ids %s are outside the vocabulary [0, %d) and are ignored",
                       model, outside, vocab)
    return [i for i in ids if 0 <= i < vocab]
