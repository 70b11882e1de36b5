"""Files are checked before they are trusted: a GGUF's tensor layout as llama.cpp's loader
checks it, and a model's config (GGUF metadata or config.json) against its tensors and
for values that make NaN, each a ValueError naming the file and the tensor or key, raised
before the model (its layers, rope table, KV pool) is built."""

from __future__ import annotations

import json
import math
import re
import shutil
import struct

import pytest

from nanokv import LLM
from nanokv import gguf as nk_gguf

from .test_gguf import private_gguf_cache, write_gguf, write_synthetic  # noqa: F401 - the fixture is autouse

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed: pip install gguf")
V = gguf.GGUFValueType
SMALL = dict(kv_cache_memory_bytes=64 << 20)


@pytest.fixture
def no_model(monkeypatch):
    """The model must not be built: a check that fails only after it was is too late."""
    import nanokv.runner.model_runner as model_runner

    def build_model(*args, **kwargs):
        raise AssertionError("the model was built before the bad value was refused")

    monkeypatch.setattr(model_runner, "build_model", build_model)


# ---- the tensor layout ------------------------------------------------------------------

def _tensor_field(path: str, name: str, part: int) -> int:
    """The byte offset of one part of a tensor's info in the header: 2 n_dims, 3 dims,
    4 type, 5 offset."""
    (t,) = [t for t in gguf.GGUFReader(path).tensors if t.name == name]
    return int(t.field.offset) + sum(p.nbytes for p in t.field.parts[:part])


def _edit(good: str, bad, edits) -> str:
    data = bytearray(open(good, "rb").read())
    for name, part, index, fmt, value in edits:
        struct.pack_into(fmt, data, _tensor_field(good, name, part) + index * struct.calcsize(fmt), value)
    bad.write_bytes(bytes(data))
    return str(bad)


def _tensor_offsets(path: str) -> dict[str, int]:
    """Each tensor's offset within the data section, as its info gives it."""
    reader = gguf.GGUFReader(path)
    return {t.name: int(t.field.parts[5][0]) for t in reader.tensors}


LAYOUTS = {  # (edits: tensor, part, item, struct format, value), the error after the path
    "unaligned": (lambda o: [("f16", 5, 0, "<Q", o["f16"] + 4)],
                  r"tensor f16 starts at offset \d+ of the data section, expected \d+: .* unaligned or overlapping"),
    "overlapping": (lambda o: [("i8", 5, 0, "<Q", o["f16"])],
                    r"tensor i8 starts at offset \d+ of the data section, expected \d+"),
    "out of order": (lambda o: [("f16", 5, 0, "<Q", o["i8"]), ("i8", 5, 0, "<Q", o["f16"])],
                     r"tensor f16 starts at offset \d+ of the data section, expected \d+"),
    "ragged quantized row": (lambda o: [("q8_0", 3, 0, "<Q", 250)],
                             r"tensor q8_0 is Q8_0 with 250 values per row, not a multiple of its block size 32"),
    "zero dim": (lambda o: [("f32", 3, 1, "<Q", 0)], r"tensor f32 has the dimensions \[5, 0, 2\]"),
    "negative dim": (lambda o: [("f32", 3, 2, "<Q", 2**64 - 2)], r"tensor f32 has the dimensions \[5, 3, \d+\]"),
    "product overflows": (lambda o: [("f32", 3, 0, "<Q", 2**40), ("f32", 3, 1, "<Q", 2**40)],
                          r"tensor f32 has the dimensions .* product at most 9223372036854775807"),
}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_a_bad_tensor_layout_names_the_file_and_the_tensor(tmp_path, case):
    """As llama.cpp's gguf.cpp: each tensor exactly where the ones before it end (aligned),
    at most 4 dims each >= 1 with an int64 product, rows whole blocks, a known type."""
    good = write_synthetic(tmp_path / "good.gguf")
    edits, problem = LAYOUTS[case]
    bad = _edit(good, tmp_path / "bad.gguf", edits(_tensor_offsets(good)))
    with pytest.raises(ValueError, match=f"^{re.escape(bad)}: {problem}"):
        nk_gguf.read_tensors(bad)


def test_more_than_four_dims_are_refused(tmp_path):
    import numpy as np

    path = str(tmp_path / "5d.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("five", np.zeros((1, 2, 1, 2, 2), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=f"^{re.escape(path)}: tensor five has 5 dimensions; GGUF tensors have at "
                                         "most 4"):
        nk_gguf.read_tensors(path)


def _insert_kv(good: str, bad, key: bytes, value: bytes, pad_key: bool = True) -> str:
    """The file with one more metadata item (its value: type and bytes) before the others,
    its key padded with "_" to make the item a multiple of the alignment (32) long, so the
    data section moves with it and the tensors' offsets hold."""
    data = open(good, "rb").read()
    while pad_key and (8 + len(key) + len(value)) % 32:
        key += b"_"
    item = struct.pack("<Q", len(key)) + key + value
    assert len(item) % 32 == 0, len(item)
    (n_kv,) = struct.unpack_from("<Q", data, 16)
    bad.write_bytes(data[:16] + struct.pack("<Q", n_kv + 1) + item + data[24:])
    return str(bad)


def test_deeply_nested_metadata_arrays_are_refused_without_recursion(tmp_path):
    good = write_synthetic(tmp_path / "good.gguf")
    depth = 10_000  # arrays of arrays: far beyond Python's recursion limit
    value = struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * depth + struct.pack("<IQ", 0, 0)
    bad = _insert_kv(good, tmp_path / "deep.gguf", b"test.deep", value)
    with pytest.raises(ValueError, match=f"^{re.escape(bad)}: metadata key test.deep_* nests arrays more than 8 "
                                         "deep"):
        nk_gguf.read_tensors(bad)
    shallow = _insert_kv(good, tmp_path / "shallow.gguf", b"test.nest",
                         struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 2 + struct.pack("<IQ", 0, 1) + b"\0")
    assert [t.name for t in nk_gguf.read_tensors(shallow)] == [t.name for t in nk_gguf.read_tensors(good)]


def test_a_key_given_twice_is_refused(tmp_path):
    good = write_synthetic(tmp_path / "good.gguf")
    bad = _insert_kv(good, tmp_path / "twice.gguf", b"test.string", struct.pack("<IQ", 8, 1) + b"x", pad_key=False)
    with pytest.raises(ValueError, match=f"^{re.escape(bad)}: metadata key test.string appears twice"):
        nk_gguf.read_tensors(bad)


def _header_with(items: list[bytes], n_kv: int | None = None, n_tensors: int = 0) -> bytes:
    """A GGUF header of raw metadata items (a key's length and bytes, its type, its value)."""
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, len(items) if n_kv is None else n_kv) + b"".join(items)


def _item(key: bytes, value_type: int, value: bytes) -> bytes:
    return struct.pack("<Q", len(key)) + key + struct.pack("<I", value_type) + value


LENGTHS_PAST_THE_END = {  # a length or count in one item runs past the end of the file -> the item named
    "string": (_item(b"tokenizer.chat_template", 8, struct.pack("<Q", 2**40)), "metadata key tokenizer.chat_template"),
    "general string": (_item(b"general.name", 8, struct.pack("<Q", 2**63)), "metadata key general.name"),
    "u8 array": (_item(b"test.bytes", 9, struct.pack("<IQ", 0, 2**62)), "metadata key test.bytes"),
    "string array": (_item(b"tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2**62)),
                     "metadata key tokenizer.ggml.tokens"),
    "nested array": (_item(b"test.nested", 9, struct.pack("<IQ", 9, 2**62)), "metadata key test.nested"),
    "key": (struct.pack("<Q", 2**64 - 1) + b"abc", r"metadata item 1 \(after key general.architecture\)"),
}


@pytest.mark.parametrize("case", list(LENGTHS_PAST_THE_END))
def test_a_length_past_the_end_names_the_key(tmp_path, case):
    item, where = LENGTHS_PAST_THE_END[case]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(_header_with([_item(b"general.architecture", 8, struct.pack("<Q", 5) + b"llama"), item]))
    with pytest.raises(ValueError, match=f"^{re.escape(str(bad))}: the GGUF header is truncated in {where} "):
        nk_gguf.read_tensors(str(bad))


@pytest.mark.parametrize("n_kv, n_tensors", [(2**63, 0), (1, 2**63), (2**20, 2**20)])
def test_counts_the_file_cannot_hold_are_refused(tmp_path, n_kv, n_tensors):
    bad = tmp_path / "counts.gguf"
    bad.write_bytes(_header_with([_item(b"general.architecture", 8, struct.pack("<Q", 5) + b"llama")] * 2,
                                 n_kv=n_kv, n_tensors=n_tensors))
    with pytest.raises(ValueError, match=f"^{re.escape(str(bad))}: the header counts {n_kv} metadata keys and "
                                         f"{n_tensors} tensors, more than the file's \\d+ bytes hold"):
        nk_gguf.read_tensors(str(bad))


# ---- the model's metadata, before anything is allocated ---------------------------------

def _model_file(checkpoint, tmp_path, *metadata, shape="qwen2-tiny", arch="qwen2") -> str:
    return write_gguf(checkpoint(shape), str(tmp_path / f"{shape}.gguf"), arch, metadata=metadata)


SIZES = {  # metadata written over the file's (qwen2-tiny: 2 layers, hidden 64, 4 heads of 16, 2 KV heads) -> error
    "block_count 100000": ([("qwen2.block_count", 100000, V.UINT32)],
                           r"qwen2\.block_count \(num_hidden_layers\) is 100000, but the checkpoint has the tensors "
                           r"of 2 layers \(blk\.0 to blk\.1\)"),
    "block_count 1": ([("qwen2.block_count", 1, V.UINT32)],
                      r"qwen2\.block_count \(num_hidden_layers\) is 1, but the checkpoint has the tensors of 2 layers"),
    "key_length 2**20": ([("qwen2.attention.key_length", 2**20, V.UINT32),
                          ("qwen2.attention.value_length", 2**20, V.UINT32)],
                         r"tensor \S+ has the shape .* qwen2\.attention\.key_length \(head_dim\) 1048576"),
    "key_length -32": ([("qwen2.attention.key_length", -32, V.INT32), ("qwen2.attention.value_length", -32, V.INT32)],
                       r"qwen2\.attention\.key_length \(head_dim\) is -32; it must be an int >= 1"),
    "value_length": ([("qwen2.attention.value_length", 32, V.UINT32)],
                     r"qwen2\.attention\.value_length 32 differs from key_length 16"),
    "head_count 0": ([("qwen2.attention.head_count", 0, V.UINT32)],
                     r"qwen2\.attention\.head_count \(num_attention_heads\) is 0; it must be an int >= 1"),
    "head_count 8": ([("qwen2.attention.head_count", 8, V.UINT32)],
                     r"tensor blk\.\d\.attn_\S+ has the shape .*"
                     r"qwen2\.attention\.head_count \(num_attention_heads\) 8"),
    "head_count_kv 3": ([("qwen2.attention.head_count_kv", 3, V.UINT32)],
                        r"qwen2\.attention\.head_count \(num_attention_heads\) 4 is not a multiple of "
                        r"qwen2\.attention\.head_count_kv \(num_key_value_heads\) 3"),
    "embedding_length": ([("qwen2.embedding_length", 2**20, V.UINT32)],
                         r"tensor \S+ has the shape .*qwen2\.embedding_length \(hidden_size\) 1048576"),
    "feed_forward_length": ([("qwen2.feed_forward_length", 2**30, V.UINT32)],
                            r"tensor blk\.0\.ffn_\S+ has the shape .*"
                            r"qwen2\.feed_forward_length \(intermediate_size\) 1073741824"),
    "context_length 0": ([("qwen2.context_length", 0, V.UINT32)],
                         r"qwen2\.context_length \(max_position_embeddings\) is 0"),
}


@pytest.mark.parametrize("case", list(SIZES))
def test_sizes_are_checked_against_the_tensors_before_the_model_is_built(checkpoint, tmp_path, no_model, case):
    metadata, problem = SIZES[case]
    path = _model_file(checkpoint, tmp_path, *metadata)
    with pytest.raises(ValueError, match=f"^{re.escape(path)}: {problem}"):
        LLM(path, **SMALL)


@pytest.mark.parametrize("n", [2**32 - 1, 2**62, 100_000, 3, 0])
def test_the_layer_count_is_checked_before_transformers_reads_it(checkpoint, tmp_path, monkeypatch, n):
    """Qwen2's and Qwen3's configs build layer_types, one entry per layer: 2**32 - 1 layers
    hung in transformers for minutes and took GBs before any check ran."""
    from transformers import AutoConfig

    def from_pretrained(*args, **kwargs):
        raise AssertionError("transformers read a layer count nanokv had not checked")

    path = _model_file(checkpoint, tmp_path, ("qwen2.block_count", n, V.UINT64))
    d = _model_dir(checkpoint, tmp_path, num_hidden_layers=n, layer_types=None)
    monkeypatch.setattr(AutoConfig, "from_pretrained", from_pretrained)
    problem = "it must be an int >= 1" if n == 0 else r"but the checkpoint has the tensors of 2 layers"
    with pytest.raises(ValueError, match=f"^{re.escape(path)}: qwen2\\.block_count \\(num_hidden_layers\\) is {n}"
                                         f"(;|,) {problem}"):
        LLM(path, **SMALL)
    with pytest.raises(ValueError, match=f"^{re.escape(d)}/config.json: num_hidden_layers is {n}(;|,) {problem}"):
        LLM(d, **SMALL)


def test_a_huge_context_length_sizes_nothing_by_itself(checkpoint, tmp_path, monkeypatch):
    """context_length 2**31: the default max_model_len (the model's) is refused before the
    model and its tables are built; a given max_model_len sizes the rope table."""
    import nanokv.runner.model_runner as model_runner
    from nanokv.layers.rotary import RotaryEmbedding

    path = _model_file(checkpoint, tmp_path, ("qwen2.context_length", 2**31, V.UINT32))
    build_model, built = model_runner.build_model, []

    def guarded(model_cls, hf_config, model_dir, dtype, device, max_positions, tp=None, **kwargs):
        assert max_positions <= 4096, f"a model built for {max_positions} positions"  # before it takes 17 GB
        built.append(max_positions)
        return build_model(model_cls, hf_config, model_dir, dtype, device, max_positions, tp, **kwargs)

    monkeypatch.setattr(model_runner, "build_model", guarded)
    with pytest.raises(ValueError, match=r"one max_model_len=2147483648 sequence must fit; raise "
                                         r"kv_cache_memory_bytes or lower max_model_len"):
        LLM(path, **SMALL)
    assert not built
    llm = LLM(path, max_model_len=96, **SMALL)
    assert llm.llm_engine.config.hf_config.max_position_embeddings == 2**31
    (rotary,) = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, RotaryEmbedding)]
    assert rotary.cos.shape[0] == 96 and built == [96]


NAN_MAKERS = {  # GGUF metadata -> the key the error names
    "rms epsilon nan": ([("qwen2.attention.layer_norm_rms_epsilon", math.nan, V.FLOAT32)],
                        r"qwen2\.attention\.layer_norm_rms_epsilon \(rms_norm_eps\) is nan"),
    "rms epsilon negative": ([("qwen2.attention.layer_norm_rms_epsilon", -0.5, V.FLOAT32)],
                             r"qwen2\.attention\.layer_norm_rms_epsilon \(rms_norm_eps\) is -0\.5"),
    "rms epsilon zero": ([("qwen2.attention.layer_norm_rms_epsilon", 0.0, V.FLOAT32)],
                         r"qwen2\.attention\.layer_norm_rms_epsilon \(rms_norm_eps\) is 0\.0"),
    "rope base zero": ([("qwen2.rope.freq_base", 0.0, V.FLOAT32)], r"qwen2\.rope\.freq_base \(rope_theta\) is 0\.0"),
    "rope base nan": ([("qwen2.rope.freq_base", math.nan, V.FLOAT32)], r"qwen2\.rope\.freq_base \(rope_theta\) is nan"),
    "rope base negative": ([("qwen2.rope.freq_base", -10000.0, V.FLOAT32)],
                           r"qwen2\.rope\.freq_base \(rope_theta\) is -10000\.0"),
    "rope base inf": ([("qwen2.rope.freq_base", math.inf, V.FLOAT32)], r"qwen2\.rope\.freq_base \(rope_theta\) is inf"),
    **{f"linear factor {v}": ([("qwen2.rope.scaling.type", "linear", V.STRING),
                               ("qwen2.rope.scaling.factor", v, V.FLOAT32)],
                              rf"qwen2\.rope\.scaling\.factor \(rope scaling factor\) is {re.escape(str(v))}")
       for v in (math.nan, math.inf, 0.0, -2.0)},
    "yarn factor nan": ([("qwen2.rope.scaling.type", "yarn", V.STRING),
                         ("qwen2.rope.scaling.factor", math.nan, V.FLOAT32),
                         ("qwen2.rope.scaling.original_context_length", 256, V.UINT32)],
                        r"qwen2\.rope\.scaling\.factor \(rope scaling factor\) is nan"),
}


@pytest.mark.parametrize("case", list(NAN_MAKERS))
def test_values_that_make_nan_are_refused_naming_the_key(checkpoint, tmp_path, no_model, case):
    metadata, problem = NAN_MAKERS[case]
    path = _model_file(checkpoint, tmp_path, *metadata)
    with pytest.raises(ValueError, match=f"^{re.escape(path)}: {problem}; it must be a finite number > 0"):
        LLM(path, **SMALL)


@pytest.mark.parametrize("eps", [1e300, 1e39])
def test_an_rms_epsilon_beyond_float32_is_refused(checkpoint, tmp_path, no_model, eps):
    """Finite as a float64 (a GGUF FLOAT64 or config.json) but an infinity in the float32
    norms: every hidden state 0, every request token 0."""
    path = _model_file(checkpoint, tmp_path, ("qwen2.attention.layer_norm_rms_epsilon", eps, V.FLOAT64))
    value = re.escape(repr(eps))
    with pytest.raises(ValueError, match=f"^{re.escape(path)}: qwen2\\.attention\\.layer_norm_rms_epsilon "
                                         f"\\(rms_norm_eps\\) is {value}; it must be at most 3\\.40282e\\+38"):
        LLM(path, **SMALL)
    d = _model_dir(checkpoint, tmp_path, rms_norm_eps=eps)
    with pytest.raises(ValueError, match=f"^{re.escape(d)}/config.json: rms_norm_eps is {value}; it must be at most"):
        LLM(d, **SMALL)


def test_an_infinite_rope_freqs_factor_is_refused(checkpoint, tmp_path, no_model):
    """Llama 3.1's scaling comes from the rope_freqs tensor: factors all inf read as a
    linear scaling by inf, refused naming the tensor."""
    import numpy as np

    path = write_gguf(checkpoint("qwen2-tiny"), str(tmp_path / "inf-freqs.gguf"), "qwen2",
                      extra_tensors=[("rope_freqs.weight", np.full(8, np.inf, np.float32))])  # head_dim 16
    with pytest.raises(ValueError, match=f"^{re.escape(path)}: rope_freqs\\.weight \\(factor\\) is inf; it must be a "
                                         "finite number > 0"):
        LLM(path, **SMALL)


# ---- config.json ------------------------------------------------------------------------

def _model_dir(checkpoint, tmp_path, shape="qwen3-tiny", **changes) -> str:
    d = tmp_path / "model"
    shutil.copytree(checkpoint(shape), d)
    config = json.loads((d / "config.json").read_text())
    for key, value in changes.items():
        target = config
        *parents, last = key.split(".")
        for p in parents:
            target = target.setdefault(p, {})
        target[last] = value
    (d / "config.json").write_text(json.dumps(config))  # NaN and Infinity as Python's json writes them
    return str(d)


CONFIG_JSON = {  # config.json keys (dotted: inside a dict) -> the error after "<dir>/config.json: "
    "num_hidden_layers": ({"num_hidden_layers": 100000, "layer_types": None},  # None: one per layer
                          r"num_hidden_layers is 100000, but the checkpoint has the tensors of 2 layers "
                          r"\(model\.layers\.0 to model\.layers\.1\)"),
    "head_dim": ({"head_dim": 2**20},
                 r"tensor model\.layers\.\d\.self_attn\.\S+ has the shape .*head_dim 1048576"),
    "head_dim negative": ({"head_dim": -32}, r"head_dim is -32; it must be an int >= 1"),
    "intermediate_size": ({"intermediate_size": 2**30},
                          r"tensor model\.layers\.0\.mlp\.\S+ has the shape .*intermediate_size 1073741824"),
    "vocab_size": ({"vocab_size": 2**24}, r"tensor model\.embed_tokens\.weight has the shape \[1024, 64\], but "
                                          r"the config gives \[16777216, 64\]"),
    "rms_norm_eps nan": ({"rms_norm_eps": math.nan}, r"rms_norm_eps is nan; it must be a finite number > 0"),
    "rms_norm_eps negative": ({"rms_norm_eps": -1e-6}, r"rms_norm_eps is -1e-06; it must be a finite number > 0"),
    "rope_theta zero": ({"rope_parameters.rope_theta": 0.0}, r"rope_theta is 0\.0; it must be a finite number > 0"),
    "rope_theta nan": ({"rope_parameters.rope_theta": math.nan}, r"rope_theta is nan; it must be a finite number"),
    "factor nan": ({"rope_parameters.rope_type": "linear", "rope_parameters.factor": math.nan},
                   r"rope_parameters\.factor is nan; it must be a finite number > 0"),
    "factor inf": ({"rope_parameters.rope_type": "linear", "rope_parameters.factor": math.inf},
                   r"rope_parameters\.factor is inf; it must be a finite number > 0"),
    "factor zero": ({"rope_parameters.rope_type": "linear", "rope_parameters.factor": 0.0},
                    r"rope_parameters\.factor is 0\.0; it must be a finite number > 0"),
}


@pytest.mark.parametrize("case", list(CONFIG_JSON))
def test_config_json_is_checked_like_gguf_metadata(checkpoint, tmp_path, no_model, case):
    changes, problem = CONFIG_JSON[case]
    d = _model_dir(checkpoint, tmp_path, **changes)
    with pytest.raises(ValueError, match=f"^{re.escape(d)}/config.json: {problem}"):
        LLM(d, **SMALL)
