"""vLLM's nanokv.pooling_params path (vllm.pooling_params.PoolingParams): pooling is not supported."""

from nanokv.unsupported import POOLING

raise ImportError(f"PoolingParams: {POOLING}", name=__name__)
