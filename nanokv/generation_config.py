"""The model's generation defaults, vLLM's way: generation_config.json's sampling fields
become the default of every SamplingParams field a request leaves unset (LLM.generate with
sampling_params=None, the server, `nanokv generate`). EngineArgs.generation_config picks
the source: "auto" (the model directory's file; a .gguf carries none), a directory holding
one, or "vllm" (none: SamplingParams' own defaults)."""

from __future__ import annotations

import json
import os
from typing import Any

from nanokv.sampling_params import SamplingParams

FILE = "generation_config.json"

# generation_config.json field -> SamplingParams field (vLLM's mapping; do_sample is ignored,
# as vLLM does: a temperature given in the file is used as such)
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_generation_config(directory: str) -> dict[str, Any] | None:
    """The directory's generation_config.json as a dict; None when there is no such file."""
    path = os.path.join(directory, FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            generation = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}; fix or remove the file") from None
    if not isinstance(generation, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(generation).__name__}; "
                         "fix or remove the file")
    return generation


def default_sampling_params(model: str, is_gguf: bool, generation_config: Any,
                            overrides: Any = None) -> dict[str, Any]:
    """SamplingParams field -> default, from the source generation_config names, with
    `overrides` (generation config fields) laid over it; only the fields the source sets.
    ValueError for a source that is not there or a value SamplingParams refuses."""
    if not isinstance(generation_config, str):
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory, got {generation_config!r}")
    if generation_config == "vllm":
        where, raw = "override_generation_config", {}
    elif generation_config == "auto":
        where = os.path.join(model, FILE)
        raw = {} if is_gguf or not os.path.isdir(model) else read_generation_config(model) or {}
    else:
        if not os.path.isdir(generation_config):
            raise ValueError(f"generation_config={generation_config!r} is not a directory; give a directory "
                             f"holding {FILE}, 'auto' (the model's) or 'vllm' (none)")
        where, raw = os.path.join(generation_config, FILE), read_generation_config(generation_config)
        if raw is None:
            raise ValueError(f"generation_config={generation_config!r} holds no {FILE}; give a directory "
                             "holding one, 'auto' (the model's) or 'vllm' (none)")
    if overrides is not None:
        if not isinstance(overrides, dict):
            raise ValueError(f"override_generation_config must be a dict of generation config fields, "
                             f"got {overrides!r}")
        raw, where = {**raw, **overrides}, f"{where} and override_generation_config"
    defaults = {name: raw[key] for key, name in FIELDS.items() if raw.get(key) is not None}
    try:
        SamplingParams(**defaults)
    except (ValueError, TypeError) as e:
        raise ValueError(f"the generation config ({where}) holds a bad sampling default: {e}; fix it, or pass "
                         "generation_config='vllm' to ignore it") from None
    return defaults
