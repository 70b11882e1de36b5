"""vLLM's vllm.v1.engine.llm_engine path: nanokv's LLMEngine."""

from nanokv.llm_engine import LLMEngine

__all__ = ["LLMEngine"]
