"""safetensors checkpoints (single file or sharded) and GGUF files -> model parameters.

Every parameter (and every shard of a fused one) must be filled exactly once; a
missing or unexpected tensor is a ValueError that names it.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os

import torch
from safetensors import safe_open
from torch import nn

from nanokv.cpu_threads import one_thread
from nanokv.gguf import GGUFCheckpoint, config_source, find_gguf
from nanokv.layers.linear import default_weight_loader
from nanokv.model_config import HF_TENSORS, ConfigSource, check_layer_count, check_model_config

# Buffers some checkpoints carry that the model recomputes itself.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def weight_files(model_dir: str) -> list[str]:
    if (gguf_file := find_gguf(model_dir)) is not None:
        return [gguf_file]
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"{index} lists shard files that are missing: {missing}")
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        other = [os.path.basename(p) for p in glob.glob(os.path.join(model_dir, "*.bin"))
                 + glob.glob(os.path.join(model_dir, "*.pt"))]
        hint = f" (found {other}: convert them to safetensors)" if other else ""
        raise ValueError(f"no *.safetensors weights in {model_dir}{hint}")
    return files


def check_checkpoint(model_dir: str, hf_config) -> None:
    """The config's sizes and values, and its sizes against the checkpoint's tensor shapes
    (read from the file headers), before anything is allocated (model_config.py)."""
    if (path := find_gguf(model_dir)) is not None:
        source = config_source(path, hf_config)
    else:
        source = ConfigSource(os.path.join(model_dir, "config.json"), {}, "model.layers.", HF_TENSORS,
                              _safetensors_shapes(model_dir))
    check_model_config(hf_config, source)


def check_layer_count_early(model_dir: str) -> None:
    """config.json's num_hidden_layers against the checkpoint's layers, read raw, before
    transformers builds its config (it makes a list that long: 2**32 - 1 layers hang and
    take GBs). The rest is checked by check_checkpoint; a config.json that cannot be read,
    or weights not named as nanokv's models name them (an architecture it does not run),
    are left to transformers and the later checks to report."""
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return
    if not isinstance(raw, dict) or "num_hidden_layers" not in raw:
        return
    shapes = _safetensors_shapes(model_dir)
    if shapes is not None and any(name.startswith("model.layers.") for name in shapes):
        check_layer_count(raw["num_hidden_layers"], ConfigSource(path, {}, "model.layers.", HF_TENSORS, shapes))


def _safetensors_shapes(model_dir: str) -> dict[str, tuple[int, ...]] | None:
    """{tensor name: shape} of the directory's safetensors files, from their headers; None
    without weights (the loader reports that)."""
    try:
        files = weight_files(model_dir)
    except ValueError:
        return None
    shapes = {}
    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
        except Exception as e:  # a truncated or corrupt header: name the file
            raise ValueError(f"cannot read {path}: {type(e).__name__}: {e}; the file is truncated or corrupt, "
                             "download or convert it again") from e
    return shapes


def load_weights(model: nn.Module, model_dir: str) -> None:
    params = dict(model.named_parameters())  # tied weights appear once
    for name, p in params.items():
        p.nanokv_name = name
    expected = {(name, shard) for name, p in params.items() for shard in getattr(p, "shard_ids", (None,))}
    tied = getattr(model.config, "tie_word_embeddings", False)
    packed = getattr(model, "packed_modules", {})
    loaded: set[tuple[str, str | None]] = set()
    unexpected: list[str] = []
    for path in weight_files(model_dir):
        try:
            _load_file(path, model, model_dir, params, expected, tied, packed, loaded, unexpected)
        except ValueError:
            raise
        except Exception as e:  # a truncated or corrupt file: name it
            raise ValueError(f"cannot read {path}: {type(e).__name__}: {e}; the file is truncated or "
                             "corrupt, download or convert it again") from e
    if unexpected:
        raise ValueError(f"unexpected tensors in {model_dir} for {type(model).__name__}: "
                         f"{sorted(unexpected)[:20]}")
    missing = sorted(_ckpt_name(name, shard) for name, shard in expected - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir} is missing tensors: {missing[:20]}")


def _load_file(path: str, model: nn.Module, model_dir: str, params, expected, tied: bool, packed, loaded,
               unexpected) -> None:
    """Fill the parameters one checkpoint file holds."""
    with _open_checkpoint(path, model, expected) as f:
        for ckpt_name in f.keys():
            if ckpt_name.endswith(_IGNORED_SUFFIXES) or (tied and ckpt_name == "lm_head.weight"):
                continue
            name, shard = _map_name(ckpt_name, packed)
            param = params.get(name)
            if param is None or (name, shard) not in expected:
                unexpected.append(ckpt_name)
                continue
            if (name, shard) in loaded:
                raise ValueError(f"checkpoint tensor {ckpt_name} appears twice in {model_dir}")
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, f.get_slice(ckpt_name), shard)  # lazy: a rank reads its part only
            loaded.add((name, shard))


def _open_checkpoint(path: str, model: nn.Module, expected):
    """safe_open, or a GGUF file behind the same keys() / get_slice() (nanokv/gguf.py)."""
    if path.endswith(".gguf"):
        return GGUFCheckpoint(path, model.config, [_ckpt_name(name, shard) for name, shard in expected])
    return safe_open(path, framework="pt", device="cpu")


def _map_name(ckpt_name: str, packed: dict[str, str]) -> tuple[str, str | None]:
    """'...self_attn.k_proj.weight' -> ('...self_attn.qkv_proj.weight', 'k_proj')."""
    parts = ckpt_name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            parts[i] = packed[part]
            return ".".join(parts), part
    return ckpt_name, None


def _ckpt_name(name: str, shard: str | None) -> str:
    if shard is None:
        return name
    parts = name.split(".")
    return ".".join(shard if i == len(parts) - 2 else p for i, p in enumerate(parts))


@torch.no_grad()
def build_model(model_cls, hf_config, model_dir: str, dtype: torch.dtype, device: torch.device,
                max_positions: int, tp=None, kernels=None) -> nn.Module:
    """Instantiate on the target device and dtype (no random init), then load weights
    (this rank's shard of them). The layers are on torch; with `kernels` (a KernelChoice,
    layers/custom_op.py) they are switched to the C kernels where those apply, from the
    weight cache when it holds this model (nanokv/weight_cache.py: mapped, nothing
    converted or packed), else converted and packed here and then cached."""
    from nanokv import weight_cache
    from nanokv.distributed import TP

    tp = tp or TP()
    entry = None if kernels is None else weight_cache.entry_for(
        model_dir, weight_files(model_dir), hf_config, dtype, device, tp.size, kernels)
    if entry is not None:
        model = _instantiate(model_cls, hf_config, dtype, device, max_positions, tp)
        if weight_cache.restore(entry, model, kernels):
            return model.eval()
    model = _instantiate(model_cls, hf_config, dtype, device, max_positions, tp)
    # on the CPU on one thread: the copies are memory-bound and gain little from a second,
    # while on a busy machine a waiting worker took the core from the thread doing the work
    # (SmolLM2 on a loaded 2-core machine: 2.0-2.4 s on one thread, 3.7-4.6 s on two)
    with one_thread() if device.type == "cpu" else contextlib.nullcontext():
        load_weights(model, model_dir)
        model = model.to(device).eval()
        if kernels is not None:
            kernels.apply(model)
    if entry is not None:
        weight_cache.store(entry, model)
    return model


def _instantiate(model_cls, hf_config, dtype: torch.dtype, device: torch.device, max_positions: int, tp):
    """The model with uninitialised weights (torch.empty: no pages touched until loaded)."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return model_cls(hf_config, max_positions, tp)
    finally:
        torch.set_default_dtype(default_dtype)
