"""vLLM's vllm.v1 module paths that ported scripts import (vllm.v1.metrics.reader)."""
