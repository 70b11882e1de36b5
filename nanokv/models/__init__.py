"""Model registry keyed by the `architectures` name in config.json."""

from __future__ import annotations

import importlib

# HF architecture name -> (module, class). Imported on use.
_REGISTRY = {
    "LlamaForCausalLM": ("nanokv.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("nanokv.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("nanokv.models.qwen3", "Qwen3ForCausalLM"),
}

SUPPORTED_ARCHITECTURES = tuple(_REGISTRY)


def resolve_architecture(hf_config) -> str:
    """The first of the config's architectures that nanokv supports; ValueError otherwise."""
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in _REGISTRY:
            return name
    raise ValueError(f"unsupported model architecture {names or '(none in config.json)'}; "
                     f"nanokv supports {', '.join(SUPPORTED_ARCHITECTURES)}")


def get_model_class(architecture: str):
    module, cls = _REGISTRY[architecture]
    return getattr(importlib.import_module(module), cls)
