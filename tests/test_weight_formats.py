"""bfloat16 and int8 weights on the CPU kernels (dtype="bfloat16", quantization="int8"):
what the engine arguments resolve to, every projection packed in its format, and greedy
output against references: token for token where the arithmetic is the same (bfloat16
weights of a bfloat16 checkpoint), within a stated agreement against transformers running
the same int8 arithmetic in torch."""

from __future__ import annotations

import pytest
import torch

from nanokv import LLM, SamplingParams, kernels
from nanokv.layers.linear import _Matmul

from .conftest import random_prompts

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="no C compiler: CPU kernels not built")

LENGTHS = [1, 3, 17, 40, 77, 130]
MAX_TOKENS = 16


def _generate(llm, prompts, logprobs=None):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=logprobs, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False)


@needs_kernels
@pytest.mark.parametrize("kwargs, weights, lm_head", [
    (dict(), "float32", "float32"),
    (dict(dtype="bfloat16"), "bfloat16", "bfloat16"),
    (dict(quantization="int8"), "int8", "float32"),
    (dict(quantization="int8", quantize_lm_head=True), "int8", "int8"),
])
def test_every_projection_is_packed_in_its_format(model_dir, kwargs, weights, lm_head):
    # quantization="int8" packs the int8 layout the library computes fastest: int8 dot
    # products with VNNI, int8 weights widened into the float32 FMAs (int8w) without
    weights, lm_head = (kernels.int8_format() if f == "int8" else f for f in (weights, lm_head))
    llm = LLM(model_dir, max_model_len=128, **kwargs)
    config, runner = llm.llm_engine.config, llm.llm_engine.runner
    assert config.dtype == torch.float32  # activations, KV cache and accumulation stay float32
    assert (runner.kernels.weights, runner.kernels.lm_head) == (weights, lm_head)
    assert runner.kernels.fused_layers and runner.backend.name == "cpu"
    matmuls = [m for m in runner.model.modules() if isinstance(m, _Matmul)]
    for m in matmuls:
        assert m.packed.format == (lm_head if m is runner.model.lm_head else weights)
    assert runner.kv_cache.dtype == torch.float32


@needs_kernels
@pytest.mark.parametrize("kwargs, match", [
    (dict(quantization="fp8"), "unknown quantization"),
    (dict(quantize_lm_head=True), "quantize_lm_head"),
    (dict(quantization="int8", dtype="bfloat16"), "float32 activations"),
    (dict(quantization="int8", quantize_lm_head="yes"), "quantize_lm_head"),
])
def test_bad_weight_arguments(model_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(model_dir, **kwargs)


def test_without_the_kernels(model_dir, monkeypatch):
    """int8 needs the kernels (refused with the reason); bfloat16 runs torch's bfloat16 path."""
    monkeypatch.setenv("NANOKV_CPU_KERNELS", "0")
    with pytest.raises(ValueError, match="needs the CPU kernels"):
        LLM(model_dir, quantization="int8")
    llm = LLM(model_dir, dtype="bfloat16", max_model_len=128)
    config = llm.llm_engine.config
    assert (config.dtype, config.weight_format, llm.llm_engine.runner.kernels.cpu) == (torch.bfloat16, None, False)
    assert len(_generate(llm, [[5, 6, 7]])[0].outputs[0].token_ids) == MAX_TOKENS


@needs_kernels
@pytest.mark.parametrize("shape", ["qwen3-tiny", "llama3-tiny"])
def test_bfloat16_weights_of_a_bfloat16_checkpoint_equal_float32(checkpoint, shape):
    """Weights that bfloat16 holds exactly: the bfloat16 kernels sum the same products in the
    same order as the float32 ones, so tokens and logprobs are identical, bit for bit."""
    model_dir = checkpoint(shape, dtype=torch.bfloat16)
    prompts = random_prompts(LENGTHS, 1024, seed=7)
    results = []
    for kwargs in (dict(), dict(dtype="bfloat16")):
        outs = _generate(LLM(model_dir, max_model_len=256, **kwargs), prompts, logprobs=3)
        results.append([(o.outputs[0].token_ids, [{k: v.logprob for k, v in lp.items()} for lp in o.outputs[0].logprobs])
                        for o in outs])
    assert results[0] == results[1]


class _Int8Hooks:
    """transformers' model running nanokv's int8 arithmetic in torch: every projection (and
    the LM head, when asked) on int8 weights with its per-output-channel scale, its input
    quantized per 32 values where the kernels quantize it (the int8 format; int8w keeps it
    float32) (float64 sums: the kernels' float32 rounding differs slightly). A tied
    embedding then reads the head's int8 rows, as nanokv's does."""

    def __init__(self, model, with_head: bool, quantize_activations: bool):
        self.handles = []
        self.quantize_activations = quantize_activations
        head = model.get_output_embeddings()
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and (with_head or module is not head):
                q, scale = kernels.quantize_int8(module.weight.data)
                weight = (q.double() * scale.double()[:, None])
                self.handles.append(module.register_forward_hook(self._make(weight)))
                if module is head and model.config.tie_word_embeddings:
                    rows = weight.float()
                    self.handles.append(model.get_input_embeddings().register_forward_hook(
                        lambda m, args, out, rows=rows: torch.nn.functional.embedding(args[0], rows)))

    def _make(self, weight):
        def hook(module, args, output):
            x = args[0].double()
            if not self.quantize_activations:
                out = x @ weight.t()
                return (out if module.bias is None else out + module.bias.double()).to(output.dtype)
            k = x.shape[-1]
            kp = -(-k // 32) * 32
            xp = torch.nn.functional.pad(x, (0, kp - k)).unflatten(-1, (kp // 32, 32))
            amax = xp.abs().amax(-1, keepdim=True)
            scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
            xq = (torch.round((xp / scale).float()).clamp(-127, 127).double() * scale).flatten(-2)[..., :k]
            out = xq @ weight.t()
            return (out if module.bias is None else out + module.bias.double()).to(output.dtype)
        return hook


@needs_kernels
@pytest.mark.parametrize("layout", ["int8", "int8w"])
@pytest.mark.parametrize("with_head", [False, True], ids=["int8", "int8-head"])
@pytest.mark.parametrize("shape", ["qwen3-tiny", "llama3-tiny"])
def test_int8_agrees_with_transformers_running_the_same_quantization(checkpoint, shape, with_head, layout,
                                                                       monkeypatch):
    """Greedy tokens against transformers with the same int8 weights and activation blocks
    emulated in torch: at least 95% of the tokens agree (random-weight models have
    near-ties that the float32 rounding of the block sums can flip), and every first
    generated token (one forward of the whole prompt) does. Both layouts, whichever this
    machine measures faster (NANOKV_INT8_LAYOUT)."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv(kernels.ops.INT8_LAYOUT_ENV, layout)
    model_dir = checkpoint(shape)
    prompts = random_prompts(LENGTHS, 1024, seed=11)
    llm = LLM(model_dir, max_model_len=256, quantization="int8", quantize_lm_head=with_head)
    got = [o.outputs[0].token_ids for o in _generate(llm, prompts)]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    _Int8Hooks(model, with_head, kernels.int8_format() == "int8")
    agree = total = 0
    with torch.inference_mode():
        for prompt, tokens in zip(prompts, got):
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                                 pad_token_id=0)
            expected = out[0, len(prompt):].tolist()
            assert tokens[0] == expected[0]
            same = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), MAX_TOKENS)
            agree, total = agree + same, total + MAX_TOKENS
    assert agree / total >= 0.95, f"{agree}/{total} tokens before the first difference"
