"""EngineConfig: every engine setting, validated once, never written back into."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


@dataclass(frozen=True)
class EngineConfig:
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
    tensor_parallel_size: int = 1

    @classmethod
    def create(
        cls,
        model: str,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        kvcache_block_size: int = 16,
        num_kvcache_blocks: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        enable_prefix_caching: bool = True,
        enforce_eager: bool = False,
        seed: int = 0,
        attention_backend: str = "auto",
        tensor_parallel_size: int = 1,
    ) -> "EngineConfig":
        from nanokv.gguf import resolve_model
        from nanokv.models import resolve_architecture

        model = resolve_model(model)  # a built-in name ("smollm2") -> its file
        hf_config = load_hf_config(model)
        architecture = resolve_architecture(hf_config)
        dev = _resolve_device(device)
        torch_dtype = _resolve_dtype(dtype, hf_config, dev)

        derived_max_len = int(getattr(hf_config, "max_position_embeddings", 0) or 0) or 2048
        if max_model_len is None:
            max_model_len = derived_max_len
        _check_int("max_model_len", max_model_len, 2)
        if max_model_len > derived_max_len:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings "
                f"({derived_max_len}); lower max_model_len")
        _check_int("max_num_seqs", max_num_seqs, 1)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(4096, max_num_seqs)
        _check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
        _check_int("kvcache_block_size", kvcache_block_size, 1)
        if num_kvcache_blocks is not None:
            _check_int("num_kvcache_blocks", num_kvcache_blocks, 1)
        if kv_cache_memory_bytes is not None:
            _check_int("kv_cache_memory_bytes", kv_cache_memory_bytes, 1)
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")

        _check_tensor_parallel(tensor_parallel_size, hf_config, dev)
        from nanokv.attention import resolve_backend

        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        backend = resolve_backend(attention_backend, dev, kvcache_block_size, torch_dtype, head_dim)
        return cls(
            model=model, hf_config=hf_config, architecture=architecture, dtype=torch_dtype,
            device=dev, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, block_size=kvcache_block_size,
            num_kvcache_blocks=num_kvcache_blocks, kv_cache_memory_bytes=kv_cache_memory_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=bool(enable_prefix_caching), enforce_eager=bool(enforce_eager),
            seed=int(seed), eos_token_ids=tuple(_eos_token_ids(model, hf_config)),
            attention_backend=backend, tensor_parallel_size=tensor_parallel_size,
        )


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


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def load_hf_config(model: str):
    """The checkpoint's transformers config; ValueError when `model` is no model directory."""
    from transformers import AutoConfig

    from nanokv import gguf

    if (gguf_file := gguf.find_gguf(model)) is not None:
        return gguf.load_config(gguf_file)
    if not os.path.isdir(model):
        raise ValueError(
            f"model {model!r} is not a directory; nanokv loads local Hugging Face model "
            "directories (config.json + *.safetensors); download the model first")
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"{model!r} has no config.json; point model at a Hugging Face model directory")
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


def _eos_token_ids(model: str, hf_config) -> list[int]:
    """EOS ids from config.json and generation_config.json, united (Llama 3 instruct lists
    several there)."""
    ids: list[int] = []

    def add(value) -> None:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)

    add(getattr(hf_config, "eos_token_id", None))
    path = os.path.join(model, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            add(json.load(f).get("eos_token_id"))
    return ids
