"""vLLM's vllm.v1 module paths that ported scripts import (vllm.v1.metrics.reader,
vllm.v1.engine.async_llm, vllm.v1.engine.llm_engine)."""
