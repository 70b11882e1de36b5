"""nanokv: a small, fast LLM inference engine built around a paged KV cache."""

from nanokv.outputs import RequestOutput
from nanokv.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"


def __getattr__(name):
    # LLM pulls in torch; import it on first use so the torch-free engine stays torch-free.
    if name == "LLM":
        from nanokv.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from nanokv.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(f"module 'nanokv' has no attribute {name!r}")
