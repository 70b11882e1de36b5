"""vLLM's module path of Logprob (vllm.logprobs): one entry of CompletionOutput.logprobs."""

from nanokv.outputs import Logprob
from nanokv.unsupported import missing

__all__ = ["Logprob"]


def __getattr__(name: str):
    raise missing(__name__, name)
