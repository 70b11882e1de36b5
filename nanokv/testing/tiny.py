"""Tiny random-weight Hugging Face checkpoints for tests, examples and benchmarks.

Everything is built locally (no hub access): a small byte-level BPE tokenizer is
trained on text shipped with Python, and a model with random (but deliberately
"spiky") weights is written with transformers' ``save_pretrained``, so the
directory looks like a real checkpoint: ``config.json``, ``model.safetensors``
(or shards + ``model.safetensors.index.json``), ``generation_config.json`` and
the tokenizer files.

Public API::

    train_tiny_tokenizer(vocab_size=1024) -> PreTrainedTokenizerFast
    SHAPES: dict[str, dict]            # {"architecture": ..., "config": {...}}
    build_tiny_checkpoint(out_dir, shape="qwen3-tiny", *, seed=0, dtype=torch.float32,
                          max_shard_size=None, **config_overrides) -> str
    cached_tiny_checkpoint(shape="qwen3-tiny", cache_dir=None, **kw) -> str
    make_config(shape="qwen3-tiny", **config_overrides) -> PretrainedConfig
    rope_info(config) -> (rope_theta, rope_scaling_or_None)

Shapes use the *generic* rope keys ``rope_theta`` / ``rope_scaling`` (4.x
style).  They are converted to ``rope_parameters`` when the installed
transformers (5.x) wants that, and the constructed config is checked to really
carry the intended values.
"""

from __future__ import annotations

import ast
import codecs
import copy
import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import transformers

__all__ = [
    "SHAPES",
    "SPECIAL_TOKENS",
    "EOS_TOKEN_ID",
    "GENERATION_EOS_TOKEN_IDS",
    "train_tiny_tokenizer",
    "make_config",
    "rope_info",
    "build_tiny_checkpoint",
    "cached_tiny_checkpoint",
]

# Bump when the on-disk output of build_tiny_checkpoint changes (invalidates caches).
FORMAT_VERSION = 1

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
EOS_TOKEN_ID = 0  # <|endoftext|>: eos (config.json) and pad
# generation_config.json eos: a list, so engines must take the union with config eos.
# 3 is an ordinary byte token, chosen on purpose (it is not a special token).
GENERATION_EOS_TOKEN_IDS = [0, 3]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# --------------------------------------------------------------------------- shapes

_LLAMA3_TINY_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}
_LLAMA32_1B_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

SHAPES: dict[str, dict] = {
    "qwen3-tiny": {
        "architecture": "Qwen3ForCausalLM",
        "config": dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,  # != 64/4 on purpose
            vocab_size=1024, max_position_embeddings=1024, rope_theta=10000.0,
            rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=None,
        ),
    },
    "qwen2-tiny": {
        "architecture": "Qwen2ForCausalLM",
        "config": dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1024, max_position_embeddings=1024, rope_theta=10000.0,
            rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
        ),
    },
    "llama3-tiny": {
        "architecture": "LlamaForCausalLM",
        "config": dict(
            hidden_size=64, intermediate_size=160, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2,  # GQA group 4, head_dim 8
            vocab_size=1024, max_position_embeddings=2048, rope_theta=500000.0,
            rope_scaling=_LLAMA3_TINY_ROPE, rms_norm_eps=1e-5,
            tie_word_embeddings=False, bos_token_id=0,
        ),
    },
    # ~18.5M parameters (tied; embedding 8192*384 = 3.1M), a Qwen3 for CPU benchmarks.
    "cpu-small": {
        "architecture": "Qwen3ForCausalLM",
        "config": dict(
            hidden_size=384, intermediate_size=1152, num_hidden_layers=8,
            num_attention_heads=8, num_key_value_heads=4, head_dim=64,
            vocab_size=8192, max_position_embeddings=4096, rope_theta=10000.0,
            rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=None,
        ),
    },
    "qwen3-0.6b": {
        "architecture": "Qwen3ForCausalLM",
        "config": dict(
            hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128,
            vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
            rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=None,
        ),
    },
    "llama-3.2-1b": {
        "architecture": "LlamaForCausalLM",
        "config": dict(
            hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, head_dim=64,
            vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
            rope_scaling=_LLAMA32_1B_ROPE, rms_norm_eps=1e-5,
            tie_word_embeddings=True, bos_token_id=0,
        ),
    },
}

# --------------------------------------------------------------------------- tokenizer

_CORPUS_MODULES = (
    "textwrap", "json", "collections", "functools", "itertools", "os", "string",
    "re", "random", "heapq", "bisect", "contextlib", "dataclasses", "enum",
    "pathlib", "argparse", "copy", "pprint", "shutil", "tempfile", "difflib",
    "fractions", "decimal", "statistics", "operator", "base64", "abc", "typing",
)


def _zen_of_python() -> str:
    """The Zen of Python, read from the `this` module source (importing it prints)."""
    spec = importlib.util.find_spec("this")
    if spec is None or not spec.origin or not os.path.exists(spec.origin):
        return ""
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "s" for t in node.targets
        ):
            return codecs.decode(ast.literal_eval(node.value), "rot13")
    return ""


def _training_corpus() -> list[str]:
    """Deterministic training text: the Zen of Python + stdlib docstrings."""
    with warnings.catch_warnings():  # e.g. typing.io/typing.re warn on attribute access
        warnings.simplefilter("ignore")
        return _collect_corpus()


def _collect_corpus() -> list[str]:
    texts = [_zen_of_python()]
    for name in _CORPUS_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:  # pragma: no cover
            continue
        texts.append(inspect.getdoc(mod) or "")
        for attr in sorted(vars(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr, None)
            if inspect.isclass(obj) or inspect.isroutine(obj):
                doc = obj.__doc__
                if isinstance(doc, str) and doc.strip():
                    texts.append(f"{name}.{attr}: {inspect.cleandoc(doc)}")
    return [t for t in texts if t]


# Qwen2/Qwen3's pre-tokenizer regex. The tiny tokenizer uses the exact Qwen pipeline
# (NFC + this split + ByteLevel) because transformers 5.x's AutoTokenizer rebuilds that
# pipeline (Qwen2Tokenizer) for model_type "qwen2", ignoring tokenizer.json's pre-tokenizer;
# with the same pipeline everywhere every loader tokenizes identically.
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)


@functools.lru_cache(maxsize=None)
def _trained_tokenizer_json(vocab_size: int) -> str:
    """Train the BPE once per (process, vocab_size); returns the tokenizer JSON."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size must be >= {len(SPECIAL_TOKENS) + 256}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    assert tok.token_to_id(SPECIAL_TOKENS[0]) == 0
    assert tok.get_vocab_size(with_added_tokens=True) <= vocab_size
    return tok.to_str()


def train_tiny_tokenizer(vocab_size: int = 1024) -> transformers.PreTrainedTokenizerFast:
    """Byte-level BPE (len <= vocab_size) with ChatML chat template.

    Same pipeline as Qwen2/Qwen3 (NFC normaliser, Qwen split regex, ByteLevel; ByteLevel
    decoder), so any NFC-normalised text round-trips through encode/decode.

    Training is cached per process; every call returns a *fresh*
    ``PreTrainedTokenizerFast`` so callers may mutate it freely.
    Special tokens: ``<|endoftext|>`` (0, eos + pad), ``<|im_start|>`` (1), ``<|im_end|>`` (2).
    """
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(_trained_tokenizer_json(int(vocab_size)))
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=SPECIAL_TOKENS[0],
        pad_token=SPECIAL_TOKENS[0],
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    assert len(tok) <= vocab_size, (len(tok), vocab_size)
    return tok


# --------------------------------------------------------------------------- config


def _config_class(architecture: str):
    name = architecture.replace("ForCausalLM", "Config")
    return getattr(transformers, name)


def _accepts_rope_parameters(cls) -> bool:
    if dataclasses.is_dataclass(cls) and any(f.name == "rope_parameters" for f in dataclasses.fields(cls)):
        return True
    try:
        return "rope_parameters" in inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


def rope_info(config) -> tuple[float, dict | None]:
    """(rope_theta, rope scaling dict or None) from a config object of either transformers 4.x or 5.x.

    5.x keeps both in ``config.rope_parameters`` (``{"rope_type", "rope_theta", ...}``);
    4.x has ``config.rope_theta`` and ``config.rope_scaling``. The returned scaling dict
    excludes ``rope_theta`` and is None for plain ("default") rope.
    """
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict) and "rope_theta" in rp:
        theta = float(rp["rope_theta"])
        scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
    else:
        theta = float(getattr(config, "rope_theta"))
        scaling = dict(getattr(config, "rope_scaling", None) or {})
    rtype = scaling.get("rope_type", scaling.get("type", "default"))
    if rtype == "default" and set(scaling) <= {"rope_type", "type"}:
        return theta, None
    return theta, scaling


def make_config(shape: str = "qwen3-tiny", **config_overrides):
    """HF config for ``SHAPES[shape]`` with overrides; generic ``rope_theta``/``rope_scaling``
    keys are translated for the installed transformers and verified after construction."""
    if shape not in SHAPES:
        raise KeyError(f"unknown shape {shape!r}; known: {sorted(SHAPES)}")
    spec = SHAPES[shape]
    cls = _config_class(spec["architecture"])
    kw: dict[str, Any] = copy.deepcopy(spec["config"])
    kw.update(copy.deepcopy(config_overrides))
    kw.setdefault("eos_token_id", EOS_TOKEN_ID)
    kw.setdefault("pad_token_id", EOS_TOKEN_ID)

    # Normalise rope settings to (theta, scaling).
    rp = kw.pop("rope_parameters", None)
    theta = kw.pop("rope_theta", None)
    scaling = kw.pop("rope_scaling", None)
    if rp:
        rp = dict(rp)
        theta = rp.pop("rope_theta", theta)
        if rp.get("rope_type", rp.get("type", "default")) != "default" or set(rp) - {"rope_type", "type"}:
            scaling = rp
    theta = float(theta if theta is not None else 10000.0)
    scaling = dict(scaling) if scaling else None
    if scaling is not None and "rope_type" not in scaling and "type" in scaling:
        scaling["rope_type"] = scaling.pop("type")

    if _accepts_rope_parameters(cls):  # transformers >= 5
        kw["rope_parameters"] = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    else:  # transformers 4.x
        kw["rope_theta"] = theta
        kw["rope_scaling"] = scaling
    config = cls(**kw)
    config.architectures = [spec["architecture"]]

    got_theta, got_scaling = rope_info(config)
    want = {k: v for k, v in (scaling or {}).items()}
    ok = math.isclose(got_theta, theta) and (
        (not want and got_scaling is None)
        or (got_scaling is not None and all(got_scaling.get(k) == v for k, v in want.items()))
    )
    if not ok:
        raise RuntimeError(
            f"rope settings did not round-trip into {cls.__name__}: wanted theta={theta} scaling={scaling}, "
            f"got theta={got_theta} scaling={got_scaling}"
        )
    for key in ("head_dim", "num_key_value_heads", "tie_word_embeddings", "vocab_size"):
        if key in kw and kw[key] is not None and getattr(config, key, kw[key]) != kw[key]:
            raise RuntimeError(f"{cls.__name__}.{key}={getattr(config, key)!r}, wanted {kw[key]!r}")
    return config


# --------------------------------------------------------------------------- weights


def _no_init_weights():
    """transformers' context that skips the (slow, discarded) default init; nullcontext if absent."""
    for modname in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            mod = importlib.import_module(modname)
        except ImportError:  # pragma: no cover
            continue
        fn = getattr(mod, "no_init_weights", None)
        if fn is not None:
            try:
                return fn()
            except TypeError:  # pragma: no cover - old signature no_init_weights(_enable=True)
                return fn(True)
    import contextlib

    return contextlib.nullcontext()


# Init gains (see _init_weights), tuned by sweeping greedy decodes of the tiny shapes:
# with these, 30-token greedy continuations of random prompts have ~27/30 distinct tokens,
# <3% immediate repeats, top-1 logit margin median ~0.6 and > 1e-3 in >99.5% of steps.
_EMBED_GAIN = 3.0  # embedding std = gain / sqrt(hidden), equal row norms (=> tied logits std ~3)
_EMBED_UNIT_ROWS = True  # no high-norm "hub" tokens that win every argmax of a tied model
_LM_HEAD_GAIN = 3.0  # untied lm_head std = gain / sqrt(hidden) (=> logits std ~3)
_LINEAR_GAIN = 1.0  # linear weights std = gain / sqrt(fan_in)
_OUT_GAIN = 8.0  # extra factor for o_proj / down_proj: residual >> embedding, so a tied
#                  model's input token is not fed back as the next argmax (no A A A ... loops)
_Q_GAIN = 3.0  # sharper attention (q_proj, or Qwen3 q_norm weight): context-dependent outputs
_PAD_ROW_GAIN = 0.1  # embedding / lm_head rows of ids >= len(tokenizer) (model vocab > tokenizer
#                      vocab, like real Qwen3): rarely predicted, so outputs stay decodable


@torch.no_grad()
def _init_weights(model: torch.nn.Module, seed: int, n_tokens: int | None = None) -> None:
    """Re-initialise all parameters so a random model has context-dependent, well-separated logits.

    HF's default init (std 0.02) gives near-identical logits and degenerate greedy output.
    Here: linear weights ~ N(0, 1/fan_in) (x8 for o_proj/down_proj, x3 for q_proj);
    embeddings: rows of rms 3/sqrt(hidden); untied lm_head ~ N(0, 9/hidden);
    RMSNorm weights ~ 1 + 0.1 N(0,1) (x3 for Qwen3 q_norm); biases ~ N(0, 0.01).
    Embedding/lm_head rows for ids >= ``n_tokens`` (tokenizer length) are scaled by 0.1.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in model.named_parameters():  # shared (tied) parameters appear once
        # in-place normal_ with an explicit generator: fast (~1.5 s / 250M values) and deterministic
        if p.ndim == 1 and name.endswith("bias"):
            p.normal_(0.0, 0.1, generator=gen)
        elif p.ndim == 1:  # RMSNorm weights (input/post-attn/final norm, q_norm/k_norm)
            p.normal_(1.0, 0.1, generator=gen)
            if "q_norm" in name:  # Qwen3: attention sharpness is set here, not by q_proj
                p.mul_(_Q_GAIN)
        elif "embed" in name or "lm_head" in name:  # (vocab, hidden)
            hidden = p.shape[-1]
            p.normal_(0.0, 1.0, generator=gen)
            if "embed" in name:
                if _EMBED_UNIT_ROWS:  # equal row norms: no "hub" tokens that win every argmax
                    p.div_(torch.linalg.vector_norm(p, dim=-1, keepdim=True).div_(math.sqrt(hidden)))
                p.mul_(_EMBED_GAIN / math.sqrt(hidden))
            else:  # untied lm_head
                p.mul_(_LM_HEAD_GAIN / math.sqrt(hidden))
            if n_tokens is not None:
                p[n_tokens:].mul_(_PAD_ROW_GAIN)
        else:  # linear weight (out, in)
            gain = _LINEAR_GAIN * (_OUT_GAIN if ("o_proj" in name or "down_proj" in name) else 1.0)
            if "q_proj" in name:
                gain *= _Q_GAIN
            p.normal_(0.0, gain / math.sqrt(p.shape[-1]), generator=gen)


# --------------------------------------------------------------------------- build


def _save_kwargs(model, max_shard_size) -> dict:
    params = inspect.signature(model.save_pretrained).parameters
    kw: dict[str, Any] = {}
    if "safe_serialization" in params:  # transformers 4.x; 5.x always writes safetensors
        kw["safe_serialization"] = True
    if max_shard_size is not None:
        kw["max_shard_size"] = max_shard_size
    return kw


def build_tiny_checkpoint(
    out_dir,
    shape: str = "qwen3-tiny",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size=None,
    **config_overrides,
) -> str:
    """Write a random-weight checkpoint of ``SHAPES[shape]`` (plus overrides) to ``out_dir``.

    Writes config.json (eos=pad=0), model.safetensors (sharded with an index when
    ``max_shard_size`` is given, e.g. ``"200KB"``), generation_config.json (eos
    ``[0, 3]``) and the tiny tokenizer (vocab ``min(1024, vocab_size)``). The model is
    initialised in float32 with ``seed`` and cast to ``dtype`` before saving. Ids the
    tokenizer cannot produce (model vocab > tokenizer vocab) get down-scaled embedding /
    lm_head rows, so greedy outputs stay decodable. Deterministic for a given seed.
    Returns ``str(out_dir)``.
    """
    config = make_config(shape, **config_overrides)
    model_cls = getattr(transformers, SHAPES[shape]["architecture"])
    tokenizer = train_tiny_tokenizer(min(1024, int(config.vocab_size)))

    torch.manual_seed(seed)
    with torch.no_grad(), _no_init_weights():
        model = model_cls(config)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    _init_weights(model, seed, n_tokens=len(tokenizer))
    model = model.to(dtype=dtype).eval()

    gc = model.generation_config
    gc.eos_token_id = list(GENERATION_EOS_TOKEN_IDS)
    gc.pad_token_id = EOS_TOKEN_ID
    gc.bos_token_id = config.bos_token_id
    gc.do_sample = False

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), **_save_kwargs(model, max_shard_size))
    tokenizer.save_pretrained(str(out))
    del model
    return str(out)


def _has_weights(d: Path) -> bool:
    return (d / "config.json").is_file() and (
        (d / "model.safetensors").is_file() or (d / "model.safetensors.index.json").is_file()
    )


def cached_tiny_checkpoint(shape: str = "qwen3-tiny", cache_dir=None, **kw) -> str:
    """``build_tiny_checkpoint`` once into a cache dir and reuse it.

    Default location: ``~/.cache/nanokv/tiny/<shape>-<hash>``; ``cache_dir`` replaces
    ``~/.cache/nanokv/tiny``. The hash covers ``kw`` (seed, dtype, overrides...), the shape
    definition, transformers' version and this file's source. Built in a temp dir then
    renamed into place, so concurrent callers never see a partial checkpoint.
    """
    if shape not in SHAPES:
        raise KeyError(f"unknown shape {shape!r}; known: {sorted(SHAPES)}")
    root = Path(cache_dir) if cache_dir is not None else Path.home() / ".cache" / "nanokv" / "tiny"
    key = json.dumps(
        {
            "kw": {k: repr(v) for k, v in sorted(kw.items())},
            "shape": repr(SHAPES[shape]),
            "transformers": transformers.__version__,
            "format": FORMAT_VERSION,
            "source": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    final = root / f"{shape}-{digest}"
    if _has_weights(final):
        return str(final)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{shape}-{digest}-", dir=root))
    try:
        build_tiny_checkpoint(tmp, shape, **kw)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        if final.exists() and not _has_weights(final):
            shutil.rmtree(final, ignore_errors=True)  # stale partial dir from an older layout
        try:
            os.replace(tmp, final)
        except OSError:
            if not _has_weights(final):  # lost a race only if the winner is complete
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(final)
