"""vLLM's vllm.v1.engine.async_llm path (its async_llm_streaming example imports AsyncLLM
from here): nanokv's AsyncLLM."""

from nanokv.async_llm import AsyncLLM

__all__ = ["AsyncLLM"]
