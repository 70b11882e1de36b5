"""vLLM names that nanokv does not have, and the error that says so.

A ported vLLM script that imports or reads one of these gets an error naming what is not
supported and what to use instead, not a bare missing attribute. A leaf: the leaves
(sampling_params, outputs) and the package's __init__ import it.
"""

from __future__ import annotations

import opcode
import sys

LORA = ("LoRA adapters are not supported by nanokv; merge the adapter into the base weights "
        "(e.g. peft's merge_and_unload()) and load the merged model")
POOLING = ("pooling models (embed, encode, classify, score, reward) are not supported by nanokv, which "
           "generates text only; use a text-generation model, or an embedding library for embeddings")
BEAM_SEARCH = ("beam search is not supported by nanokv; use SamplingParams(temperature=0) for greedy "
               "decoding, or n=... samples and pick the best")
MULTIMODAL = "multi-modal inputs are not supported by nanokv; send text or token ids"
SLEEP_MODE = ("sleep mode (sleep / wake_up) is not supported by nanokv; close() frees the KV pool and the "
              "weights, and a new LLM loads them again")

# name -> why; the names vLLM's top-level package and its modules export
NAMES = {
    "LoRARequest": LORA,
    "PoolingParams": POOLING, "PoolingOutput": POOLING, "PoolingRequestOutput": POOLING,
    "EmbeddingOutput": POOLING, "EmbeddingRequestOutput": POOLING, "ClassificationOutput": POOLING,
    "ClassificationRequestOutput": POOLING, "ScoringOutput": POOLING, "ScoringRequestOutput": POOLING,
    "BeamSearchParams": BEAM_SEARCH, "BeamSearchOutput": BEAM_SEARCH, "BeamSearchSequence": BEAM_SEARCH,
    "EmbedsPrompt": "prompt embeddings (EmbedsPrompt) are not supported by nanokv; send text or token ids",
    "ModelRegistry": ("registering out-of-tree models is not supported by nanokv; its architectures are "
                      "listed in nanokv/models/"),
    "initialize_ray_cluster": ("Ray is not used by nanokv; LLM(..., tensor_parallel_size=N) starts its "
                               "own worker processes"),
}


def missing(module: str, name: str) -> Exception:
    """The error for a name `module` lacks, to raise from the module's __getattr__.

    For a vLLM name nanokv does not support, the message says so. Python turns an
    AttributeError raised during `from module import name` into a generic "cannot import
    name", so there it is an ImportError; elsewhere an AttributeError, so that hasattr()
    and getattr(module, name, default) keep working."""
    reason = NAMES.get(name)
    if reason is None:
        return AttributeError(f"module {module!r} has no attribute {name!r}")
    message = f"{name}: {reason}"
    if _importing(3):  # 0: _importing, 1: here, 2: the module's __getattr__, 3: its caller
        return ImportError(message, name=module)
    return AttributeError(message)


_IMPORT_FROM = opcode.opmap["IMPORT_FROM"]


def _importing(depth: int) -> bool:
    """Whether the frame `depth` levels up is executing `from ... import name`."""
    try:
        frame = sys._getframe(depth)
    except ValueError:  # called from outside any Python frame
        return False
    code = frame.f_code.co_code
    return 0 <= frame.f_lasti < len(code) and code[frame.f_lasti] == _IMPORT_FROM
