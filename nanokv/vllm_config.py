"""vLLM's config objects (vllm.config: ModelConfig, CacheConfig, SchedulerConfig,
ParallelConfig, VllmConfig) as small read-only views of an engine's EngineConfig, for the
code a vLLM user ports: `llm.llm_engine.model_config.max_model_len`,
`engine.get_model_config().hf_config`, `engine.vllm_config.cache_config.num_gpu_blocks`.
They hold the fields vLLM scripts commonly read, each with nanokv's real value; nothing
reads them back, so changing one changes nothing (they are frozen)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    model: str  # the resolved path (a built-in name's .gguf file)
    tokenizer: str  # the tokenizer's path: the model's unless EngineArgs.tokenizer was given
    tokenizer_mode: str
    dtype: Any  # torch.dtype of the activations
    seed: int
    max_model_len: int
    max_logprobs: int
    served_model_name: str  # the first served name, else the model path
    hf_config: Any
    architecture: str
    generation_defaults: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def hf_text_config(self):
        return getattr(self.hf_config, "text_config", None) or self.hf_config

    @property
    def architectures(self) -> list[str]:
        return [self.architecture]

    @property
    def runner_type(self) -> str:
        return "generate"  # the only runner nanokv has

    def get_vocab_size(self) -> int:
        return self.hf_text_config.vocab_size

    def get_hidden_size(self) -> int:
        return self.hf_text_config.hidden_size

    def get_num_layers(self, parallel_config=None) -> int:
        return self.hf_text_config.num_hidden_layers

    def get_sliding_window(self) -> None:
        return None  # every supported architecture attends over the whole context

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """The model's generation-config defaults (vLLM's name): what
        LLM.get_default_sampling_params() lays over SamplingParams()."""
        return dict(self.generation_defaults)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_gpu_blocks: int  # blocks in the KV pool (on the CPU too: vLLM's name)
    enable_prefix_caching: bool
    cache_dtype: str
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int | None
    num_cpu_blocks: int = 0  # nothing is swapped to CPU memory
    swap_space: float = 0


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    chunked_prefill_enabled: bool = True  # always on
    policy: str = "fcfs"


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size


@dataclass(frozen=True)
class VllmConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig


def vllm_config_of(config, num_blocks: int) -> VllmConfig:
    """The views of an EngineConfig whose KV pool holds num_blocks blocks."""
    names = config.served_model_name
    model = ModelConfig(
        model=config.model, tokenizer=config.tokenizer or config.model, tokenizer_mode=config.tokenizer_mode,
        dtype=config.dtype, seed=config.seed, max_model_len=config.max_model_len, max_logprobs=config.max_logprobs,
        served_model_name=names[0] if names else config.model, hf_config=config.hf_config,
        architecture=config.architecture, generation_defaults=dict(config.default_sampling_params))
    cache = CacheConfig(
        block_size=config.block_size, num_gpu_blocks=num_blocks, enable_prefix_caching=config.enable_prefix_caching,
        cache_dtype=config.kv_cache_dtype, gpu_memory_utilization=config.gpu_memory_utilization,
        kv_cache_memory_bytes=config.kv_cache_memory_bytes)
    scheduler = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len)
    return VllmConfig(model, cache, scheduler, ParallelConfig(config.tensor_parallel_size))
