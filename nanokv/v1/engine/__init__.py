"""vLLM's vllm.v1.engine path: its engines are nanokv's (async_llm, llm_engine)."""
