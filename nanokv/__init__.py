"""nanokv: a small, fast LLM inference engine built around a paged KV cache."""

from nanokv.llm import LLM
from nanokv.outputs import RequestOutput
from nanokv.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"
