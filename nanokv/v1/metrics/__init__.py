"""vLLM's vllm.v1.metrics path: the reader records are nanokv.metrics.reader's."""
