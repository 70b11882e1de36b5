"""nanokv: a small, fast LLM inference engine built around a paged KV cache.

vLLM's top-level names work here (LLMEngine, AsyncLLMEngine and AsyncEngineArgs are the
same objects as nanokv's LLMEngine, AsyncLLM and EngineArgs); a vLLM name nanokv does not
support (LoRA, pooling, beam search) raises an error that says so."""

import importlib

from nanokv.cpu_threads import prepare_runtime

prepare_runtime()  # before anything imports torch: OpenMP reads its wait setting once, when loaded

from nanokv.inputs import PromptType, TextPrompt, TokensPrompt
from nanokv.outputs import CompletionOutput, RequestOutput
from nanokv.sampling_params import RequestOutputKind, SamplingParams
from nanokv.unsupported import missing

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestOutputKind",
           "TextPrompt", "TokensPrompt", "PromptType", "EngineArgs", "AsyncEngineArgs", "LLMEngine",
           "AsyncLLMEngine"]
__version__ = "0.1.0"

# Imported on first use: LLM pulls in torch, and the torch-free engine stays torch-free.
_LAZY = {
    "LLM": ("nanokv.llm", "LLM"),
    "AsyncLLM": ("nanokv.async_llm", "AsyncLLM"),
    "AsyncLLMEngine": ("nanokv.async_llm", "AsyncLLM"),
    "LLMEngine": ("nanokv.llm_engine", "LLMEngine"),
    "EngineArgs": ("nanokv.engine.arg_utils", "EngineArgs"),
    "AsyncEngineArgs": ("nanokv.engine.arg_utils", "EngineArgs"),
}


def __getattr__(name):
    if name in _LAZY:
        module, attribute = _LAZY[name]
        return getattr(importlib.import_module(module), attribute)
    raise missing(__name__, name)
