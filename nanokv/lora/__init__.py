"""vLLM's nanokv.lora path (vllm.lora.request.LoRARequest): LoRA is not supported."""

from nanokv.unsupported import LORA

raise ImportError(LORA, name=__name__)
