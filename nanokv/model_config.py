"""The model's config, checked before anything is built from it.

A config.json or a GGUF header is input like any other: a layer count, a head width or a
context length sizes what the engine allocates (the layers, the rope table, the KV pool),
and an rms epsilon, a rope base or a scaling factor goes into every forward pass. So,
before the model is constructed: every size is an int >= 1; the checkpoint's tensors
(their shapes, read from the file headers) agree with the sizes (one group of tensors per
layer, q/k/v/o widths of heads x head_dim, ...); the float settings are finite and > 0,
and the rope frequencies they give finite. A bad value is a ValueError naming the file and
the key it came from (the GGUF key, or config.json's). Leaf module: torch only, the rope
formulas imported when checked.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

# the sizes every supported architecture has; each an int >= 1
SIZES = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
         "vocab_size")
# rope settings that must be > 0 where present (all must be finite): transformers divides by or takes logs of them
_POSITIVE_ROPE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                  "attention_factor", "partial_rotary_factor")

FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max, without importing torch here

# tensor role -> its shape in torch's order, each dim the product of config sizes
TENSOR_SHAPES = {
    "embed": (("vocab_size",), ("hidden_size",)),
    "lm_head": (("vocab_size",), ("hidden_size",)),
    "norm": (("hidden_size",),),
    "q": (("num_attention_heads", "head_dim"), ("hidden_size",)),
    "q_bias": (("num_attention_heads", "head_dim"),),
    "k": (("num_key_value_heads", "head_dim"), ("hidden_size",)),
    "k_bias": (("num_key_value_heads", "head_dim"),),
    "v": (("num_key_value_heads", "head_dim"), ("hidden_size",)),
    "v_bias": (("num_key_value_heads", "head_dim"),),
    "o": (("hidden_size",), ("num_attention_heads", "head_dim")),
    "o_bias": (("hidden_size",),),
    "q_norm": (("head_dim",),),
    "k_norm": (("head_dim",),),
    "gate": (("intermediate_size",), ("hidden_size",)),
    "gate_bias": (("intermediate_size",),),
    "up": (("intermediate_size",), ("hidden_size",)),
    "up_bias": (("intermediate_size",),),
    "down": (("hidden_size",), ("intermediate_size",)),
    "down_bias": (("hidden_size",),),
    "attn_norm": (("hidden_size",),),
    "ffn_norm": (("hidden_size",),),
}
GLOBAL_ROLES = ("embed", "lm_head", "norm")  # the others are per layer
# role -> the Hugging Face name (per-layer ones after "model.layers.<i>.")
HF_TENSORS = {
    "embed": "model.embed_tokens.weight", "lm_head": "lm_head.weight", "norm": "model.norm.weight",
    **{f"{r}{b}": f"self_attn.{r}_proj.{'bias' if b else 'weight'}" for r in "qkvo" for b in ("", "_bias")},
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    **{f"{r}{b}": f"mlp.{r}_proj.{'bias' if b else 'weight'}" for r in ("gate", "up", "down") for b in ("", "_bias")},
    "attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
}


def model_head_dim(hf_config) -> int:
    """Width of one attention head: the config's head_dim (Qwen3 sets its own), else
    hidden_size / num_attention_heads."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


@dataclass(frozen=True)
class ConfigSource:
    """Where a config and its weights come from: the names its checks give in errors and
    the checkpoint's tensors they compare against."""

    path: str  # the file named in errors: <model>/config.json, or the .gguf
    keys: Mapping[str, str]  # config attribute -> the key the file stores it under (absent: config.json's name)
    layer_prefix: str  # the per-layer tensors' prefix before the layer index: "model.layers." or "blk."
    tensors: Mapping[str, str]  # tensor role (TENSOR_SHAPES) -> its name (per-layer ones after prefix + index + ".")
    shapes: Mapping[str, tuple[int, ...]] | None  # the checkpoint's tensor shapes, torch's order; None: not read

    def key(self, attr: str) -> str:
        return f"{self.keys[attr]} ({attr})" if attr in self.keys else attr

    def fail(self, problem: str):
        raise ValueError(f"{self.path}: {problem}")


def check_number(name: str, value, *, positive: bool = True) -> float:
    """value as a float when it is a finite number (> 0 if positive); else a ValueError
    naming it (`name`: the file and the key)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (positive and value <= 0):
        kind = "a finite number > 0" if positive else "a finite number"
        raise ValueError(f"{name} is {value!r}; it must be {kind} (NaN, an infinity or a non-positive value "
                         "would make every output NaN)")
    return float(value)


def check_sizes(hf_config, source: ConfigSource) -> int:
    """Every size an int >= 1 (head_dim even), the heads a multiple of the KV heads; gives
    the head width."""
    for attr in SIZES + ("head_dim", "max_position_embeddings"):
        value = getattr(hf_config, attr, None)
        if value is None and attr in ("head_dim", "max_position_embeddings"):  # optional: derived elsewhere
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            source.fail(f"{source.key(attr)} is {value!r}; it must be an int >= 1")
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if heads % kv_heads:
        source.fail(f"{source.key('num_attention_heads')} {heads} is not a multiple of "
                    f"{source.key('num_key_value_heads')} {kv_heads}")
    head_dim = model_head_dim(hf_config)
    if head_dim < 1 or head_dim % 2:
        source.fail(f"{source.key('head_dim')} is {head_dim}; rotary embeddings rotate pairs of dimensions, so "
                    "nanokv needs an even head_dim >= 2")
    return head_dim


def check_model_config(hf_config, source: ConfigSource) -> None:
    """All of the module's checks, in the order a bad value would first be used."""
    head_dim = check_sizes(hf_config, source)
    _check_floats(hf_config, source, head_dim)
    if source.shapes is not None:
        _check_layers(hf_config, source)
        _check_shapes(hf_config, source, head_dim)


def _check_floats(hf_config, source: ConfigSource, head_dim: int) -> None:
    from nanokv.layers.rotary import inverse_frequencies, rope_parameters

    eps = getattr(hf_config, "rms_norm_eps", None)
    if eps is not None:
        name = f"{source.path}: {source.key('rms_norm_eps')}"
        if check_number(name, eps) > FLOAT32_MAX:  # added to float32 variances: an infinity there
            raise ValueError(f"{name} is {eps!r}; it must be at most {FLOAT32_MAX:.6g} (float32's largest number): "
                             "the norms compute in float32, where it is an infinity and every output the same")
    params = rope_parameters(hf_config)
    scaling_name = "rope_parameters" if isinstance(getattr(hf_config, "rope_parameters", None), dict) \
        else "rope_scaling"
    for name, value in params.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            key = source.key(name) if name == "rope_theta" or name in source.keys else f"{scaling_name}.{name}"
            check_number(f"{source.path}: {key}", value, positive=name == "rope_theta" or name in _POSITIVE_ROPE)
    if params["rope_type"] == "llama3" and not params.get("high_freq_factor", 0) > params.get("low_freq_factor", 0):
        source.fail(f"llama3 rope scaling's high_freq_factor {params.get('high_freq_factor')} must be above its "
                    f"low_freq_factor {params.get('low_freq_factor')}")
    try:
        inv_freq, scaling = inverse_frequencies(hf_config, head_dim)  # [head_dim / 2]: a few numbers
    except ValueError as e:
        source.fail(str(e))
    except Exception as e:  # noqa: BLE001 - transformers' formulas on incomplete settings (a KeyError, ...)
        source.fail(f"the rope settings {params} cannot be computed: {type(e).__name__}: {e}")
    if not (bool(inv_freq.isfinite().all()) and bool((inv_freq > 0).all()) and math.isfinite(scaling) and scaling > 0):
        source.fail(f"the rope settings {params} give frequencies that are not finite and > 0")


def _layer_index(name: str, prefix: str) -> tuple[int | None, str]:
    """'blk.3.attn_q.weight' -> (3, 'attn_q.weight'); (None, name) for a tensor of no layer."""
    if name.startswith(prefix):
        index, _, rest = name[len(prefix):].partition(".")
        if index.isdigit():
            return int(index), rest
    return None, name


def _check_layers(hf_config, source: ConfigSource) -> None:
    check_layer_count(hf_config.num_hidden_layers, source)


def check_layer_count(n, source: ConfigSource) -> None:
    """One group of tensors per layer, numbered 0 to num_hidden_layers - 1. Also run on the
    raw value before transformers builds its config, which makes a list as long as the
    layer count (Qwen2's and Qwen3's layer_types: 2**32 - 1 layers hang and take GBs)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        source.fail(f"{source.key('num_hidden_layers')} is {n!r}; it must be an int >= 1")
    found = sorted({i for name in source.shapes if (i := _layer_index(name, source.layer_prefix)[0]) is not None})
    contiguous = bool(found) and found[-1] == len(found) - 1  # 0 to the last, each once (no list as long as n)
    if contiguous and len(found) == n:
        return
    p = source.layer_prefix
    if not found:
        have = "no per-layer tensors"
    elif contiguous:
        have = f"the tensors of {len(found)} layers ({p}0 to {p}{found[-1]})"
    else:
        have = f"the tensors of the layers {', '.join(map(str, found[:8]))}{', ...' if len(found) > 8 else ''}"
    source.fail(f"{source.key('num_hidden_layers')} is {n}, but the checkpoint has {have}; the config and the "
                "weights do not belong together")


def _check_shapes(hf_config, source: ConfigSource, head_dim: int) -> None:
    """Each tensor of a known role has the shape the config's sizes give it."""
    sizes = {attr: getattr(hf_config, attr) for attr in SIZES}
    sizes["head_dim"] = head_dim
    roles = {source.tensors[r]: r for r in GLOBAL_ROLES if r in source.tensors}
    layer_roles = {name: r for r, name in source.tensors.items() if r not in GLOBAL_ROLES}
    for name, shape in source.shapes.items():
        index, rest = _layer_index(name, source.layer_prefix)
        role = roles.get(name) if index is None else layer_roles.get(rest)
        if role is None:
            continue
        spec = TENSOR_SHAPES[role]
        expected = tuple(math.prod(sizes[a] for a in dim) for dim in spec)
        if tuple(shape) != expected:
            attrs = dict.fromkeys(a for dim in spec for a in dim)
            given = ", ".join(f"{source.key(a)} {sizes[a]}" for a in attrs)
            source.fail(f"tensor {name} has the shape {list(shape)}, but the config gives {list(expected)} ({given}); "
                        "the config and the weights do not belong together")
