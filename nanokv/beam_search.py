"""vLLM's nanokv.beam_search path (vllm.beam_search: BeamSearchOutput, ...): beam search is not supported."""

from nanokv.unsupported import BEAM_SEARCH

raise ImportError(BEAM_SEARCH, name=__name__)
