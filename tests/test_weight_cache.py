"""The weight cache (nanokv/weight_cache.py): a second load of a model maps the packed weights
the first one cached, read-only, and gives token for token the same greedy output; a changed
file, dtype or format is a new entry; a damaged entry is built again; a cache that cannot be
written is skipped; two processes building one entry at once both load correctly."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch

import nanokv.loader as loader
from nanokv import LLM, SamplingParams, kernels
from nanokv.kernels import build
from nanokv.layers.linear import _Matmul

from .conftest import random_prompts

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(max_model_len=128, kv_cache_memory_bytes=16 << 20)
PROMPTS = random_prompts([3, 17, 40], 200)


@pytest.fixture
def root(tmp_path, monkeypatch):
    """NANOKV_CACHE_DIR -> a fresh root; its kernels and GGUF config folders are the
    current root's (nothing compiled or derived again)."""
    root = tmp_path / "cache"
    root.mkdir()
    if kernels.available():
        (root / "kernels").symlink_to(build.cache_dir())
    build.cache_root().joinpath("gguf").mkdir(parents=True, exist_ok=True)
    (root / "gguf").symlink_to(build.cache_root() / "gguf")
    monkeypatch.setenv("NANOKV_CACHE_DIR", str(root))
    return root


@pytest.fixture
def loads(monkeypatch):
    """Counts the loads that read the checkpoint (a cache hit reads none)."""
    calls = []
    load_weights = loader.load_weights

    def counted(model, model_dir):
        calls.append(model_dir)
        return load_weights(model, model_dir)

    monkeypatch.setattr(loader, "load_weights", counted)
    return calls


def _greedy(model, **kwargs) -> list[list[int]]:
    llm = LLM(model, **SMALL, **kwargs)
    try:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                              use_tqdm=False)]
    finally:
        llm.close()


def _entries(root) -> list:
    folder = root / "weights"
    return sorted(folder.glob("*.weights")) if folder.is_dir() else []


def _mappings(llm) -> set[tuple[str, str]]:
    """(permissions, path) of the file mappings the model's packed weights lie in."""
    spans = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                spans.append((lo, hi, parts[1], parts[5]))
    found = set()
    for m in llm.llm_engine.runner.model.modules():
        if isinstance(m, _Matmul):
            addr = m.packed.data.data_ptr()
            found |= {(perm, path) for lo, hi, perm, path in spans if lo <= addr < hi}
    return found


def test_a_hit_maps_the_entry_and_gives_the_same_tokens(checkpoint, root, loads):
    model = checkpoint("qwen3-tiny")
    cold = _greedy(model)
    assert loads == [model] and len(_entries(root)) == 1  # under NANOKV_CACHE_DIR
    llm = LLM(model, **SMALL)
    try:
        assert loads == [model]  # the checkpoint was not read again
        if kernels.available():  # every packed weight lies in the entry, mapped read-only and shared
            assert _mappings(llm) == {("r--s", str(_entries(root)[0]))}
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        warm = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                              use_tqdm=False)]
    finally:
        llm.close()
    assert warm == cold


def test_a_changed_file_is_a_new_entry(checkpoint, root, loads, tmp_path):
    model = shutil.copytree(checkpoint("qwen3-tiny"), tmp_path / "model")
    first = _greedy(model)
    other = checkpoint("qwen3-tiny", seed=1)
    weights = os.path.join(model, "model.safetensors")
    st = os.stat(weights)
    with open(weights, "r+b") as f:  # rewritten in place: the same size, the mtime set back
        f.write(open(os.path.join(other, "model.safetensors"), "rb").read())
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.path.getsize(weights) == st.st_size
    second = _greedy(model)
    assert len(loads) == 2 and len(_entries(root)) == 2
    assert second != first
    assert second == _greedy(other)  # the new weights, not the cached old ones


@pytest.mark.skipif(not kernels.available(), reason="no C compiler: CPU kernels not built")
@pytest.mark.parametrize("kwargs", [dict(dtype="bfloat16"), dict(quantization="int8")])
def test_another_dtype_or_format_is_a_new_entry(checkpoint, root, loads, kwargs, monkeypatch):
    model = checkpoint("qwen3-tiny")
    _greedy(model)
    formatted = _greedy(model, **kwargs)
    assert len(loads) == 2 and len(_entries(root)) == 2
    assert _greedy(model, **kwargs) == formatted and len(loads) == 2  # its own entry, hit
    monkeypatch.setenv("NANOKV_WEIGHT_CACHE", "0")
    assert _greedy(model, **kwargs) == formatted  # as a load without the cache


@pytest.mark.parametrize("damage", ["truncate", "flip", "header"])
def test_a_damaged_entry_is_built_again(checkpoint, root, loads, damage, caplog):
    model = checkpoint("qwen3-tiny")
    cold = _greedy(model)
    (entry,) = _entries(root)
    data = bytearray(entry.read_bytes())
    if damage == "truncate":
        data = data[:len(data) - 100]
    elif damage == "flip":
        data[len(data) - 5000] ^= 0x10  # one bit of one weight
    else:
        data[20] ^= 0xFF  # inside the header's JSON
    entry.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="nanokv"):
        assert _greedy(model) == cold
    assert len(loads) == 2 and "building it again" in caplog.text
    assert _greedy(model) == cold and len(loads) == 2  # the rebuilt entry is whole: a hit


def test_a_cache_that_cannot_be_written_is_skipped(checkpoint, root, loads, caplog):
    model = checkpoint("qwen3-tiny")
    (root / "weights").write_text("a file where the folder goes")  # mkdir fails, as on a read-only root
    with caplog.at_level(logging.INFO, logger="nanokv"):
        first = _greedy(model)
    assert "not caching the packed weights" in caplog.text
    assert _greedy(model) == first and len(loads) == 2


def test_switched_off_writes_nothing(checkpoint, root, loads, monkeypatch):
    monkeypatch.setenv("NANOKV_WEIGHT_CACHE", "0")
    _greedy(checkpoint("qwen3-tiny"))
    assert _entries(root) == []


_BUILDER = """
import json, sys
from nanokv import LLM, SamplingParams
llm = LLM(sys.argv[1], max_model_len=128, kv_cache_memory_bytes=16 << 20)
prompts = [{"prompt_token_ids": p} for p in json.loads(sys.argv[2])]
out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
print(json.dumps([o.outputs[0].token_ids for o in out]))
"""


def test_two_processes_building_at_once(checkpoint, root, loads):
    model = checkpoint("llama3-tiny")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", _BUILDER, model, json.dumps(PROMPTS)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert len(_entries(root)) == 1
    assert outs[0] == outs[1] == _greedy(model)
    assert loads == []  # this process found the entry they left whole


def test_smollm2_warm_equals_cold(smollm2_path, root, loads):
    cold = _greedy(smollm2_path)
    warm = _greedy(smollm2_path)
    assert len(loads) == 1 and len(_entries(root)) == 1
    assert warm == cold


def test_a_hit_on_the_torch_path(checkpoint, root, loads, monkeypatch):
    """Without the C kernels the cache holds the converted parameters, read in place by torch."""
    monkeypatch.setenv("NANOKV_CPU_KERNELS", "0")
    model = checkpoint("llama3-tiny")
    cold = _greedy(model)
    assert _greedy(model) == cold and len(loads) == 1 and len(_entries(root)) == 1


_WARM_IMPORTS = """
import sys
from nanokv import LLM
LLM(sys.argv[1], max_model_len=128, kv_cache_memory_bytes=16 << 20)
heavy = ["transformers.models.llama.configuration_llama", "transformers.models.auto.tokenization_auto",
         "torch.distributed.tensor"]
print([m for m in heavy if m in sys.modules])
"""


def test_a_warm_gguf_load_skips_transformers_model_classes(smollm2_path, root):
    """A GGUF whose config, tokenizer and weights are cached loads without transformers'
    config class for the architecture or AutoTokenizer (each pulls in seconds of imports)."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    runs = [subprocess.run([sys.executable, "-c", _WARM_IMPORTS, smollm2_path], env=env, capture_output=True,
                           text=True, timeout=300) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
    assert runs[1].stdout.strip().splitlines()[-1] == "[]"


def test_old_entries_of_the_model_are_pruned(checkpoint, root, loads):
    from nanokv.weight_cache import KEEP_ENTRIES, STALE_TEMP_S

    model = checkpoint("qwen3-tiny")
    base = os.path.basename(os.path.realpath(model))
    folder = root / "weights"
    folder.mkdir()
    old = [folder / f"{base}-{i:016x}.weights" for i in range(KEEP_ENTRIES)]  # written at times 1, 2, ..
    for i, p in enumerate(old):
        p.write_bytes(b"an older entry")
        os.utime(p, (i + 1, i + 1))
    crashed, writing = folder / f".{old[0].name}-abc123", folder / f".{old[1].name}-def456"
    for p in (crashed, writing):
        p.write_bytes(b"a temporary file")
    os.utime(crashed, (1, 1))  # its writer is long gone; the other one's may still be writing
    others = [folder / "notes.txt", folder / f"other-{0:016x}.weights"]  # not this model's entries
    for p in others:
        p.write_bytes(b"not ours to remove")
    _greedy(model)
    (new,) = set(folder.glob(f"{base}-*.weights")) - set(old)
    kept = sorted(folder.glob(f"{base}-*.weights"))
    assert len(kept) == KEEP_ENTRIES and new in kept and old[0] not in kept  # the oldest went
    assert not crashed.exists() and writing.exists() and STALE_TEMP_S > 60
    assert all(p.exists() for p in others)


def test_the_conversion_runs_on_one_thread_and_gives_the_count_back(checkpoint, root, monkeypatch):
    """A cache miss converts the weights on one torch thread (torch's idle OpenMP workers
    took the cores from it on a busy machine); the process' thread count is restored after."""
    seen = []
    load_weights = loader.load_weights

    def counted(model, model_dir):
        seen.append(torch.get_num_threads())
        return load_weights(model, model_dir)

    monkeypatch.setattr(loader, "load_weights", counted)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(checkpoint("qwen3-tiny"), **SMALL)
        llm.close()
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
