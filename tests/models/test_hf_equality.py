"""nanokv greedy output equals transformers' generate token for token (float32, CPU),
for every supported architecture and under every scheduler path."""

from __future__ import annotations

import pytest

from nanokv import LLM, SamplingParams
from nanokv.testing.tiny import GENERATION_EOS_TOKEN_IDS

from ..conftest import hf_greedy, random_prompts

SHAPES = ["qwen3-tiny", "qwen2-tiny", "llama3-tiny"]
# mixed lengths crossing block boundaries (block size 16), 1 to a few hundred tokens
LENGTHS = [1, 2, 5, 15, 16, 17, 31, 33, 47, 64, 100, 127, 129, 200, 255, 300]
MAX_TOKENS = [24, 1, 9, 30, 17, 2, 40, 12, 25, 3, 33, 18, 7, 28, 16, 21]


@pytest.fixture(scope="module")
def reference(checkpoint):
    cache = {}

    def get(shape):
        if shape not in cache:
            model_dir = checkpoint(shape)
            prompts = random_prompts(LENGTHS, 1024, seed=100 + SHAPES.index(shape))  # the same in every process
            cache[shape] = model_dir, prompts, hf_greedy(model_dir, prompts, MAX_TOKENS, GENERATION_EOS_TOKEN_IDS)
        return cache[shape]

    return get


def generate(llm, prompts, max_tokens=MAX_TOKENS):
    params = [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens]
    return llm.generate(prompts, params, use_tqdm=False)


def assert_same(outputs, expected, prompts):
    assert len(outputs) == len(expected)
    for i, (out, (tokens, reason), prompt) in enumerate(zip(outputs, expected, prompts)):
        assert out.prompt_token_ids == prompt
        got = out.outputs[0]
        assert got.token_ids == tokens, f"prompt {i} (len {len(prompt)}) differs"
        assert got.finish_reason == reason, f"prompt {i}"


def select_cpu_path(path: str, monkeypatch) -> str:
    """Set the environment for one CPU path (see cpu_path); skip where it cannot run."""
    from nanokv import kernels

    if path == "torch":
        monkeypatch.setenv("NANOKV_CPU_KERNELS", "0")
    elif not kernels.available():
        pytest.skip("no C compiler: CPU kernels not built")
    elif path == "cpu-kernels-other-width":
        monkeypatch.setenv("NANOKV_CPU_WIDTH", "8" if kernels.ffi.lib().nk_width() == 16 else "16")
    return path


@pytest.fixture(params=["cpu-kernels", "cpu-kernels-other-width", "torch"])
def cpu_path(request, monkeypatch):
    """Both CPU paths: the C kernels (the default when they build; also built at the vector
    width this CPU does not pick, 8 or 16 floats) and pure torch."""
    return select_cpu_path(request.param, monkeypatch)


def assert_path(llm, path):
    model = llm.llm_engine.runner.model
    kernels = path.startswith("cpu-kernels")
    assert llm.llm_engine.config.attention_backend == ("cpu" if kernels else "torch")
    assert (model.lm_head.packed is not None) == kernels
    assert (model.model.fused_layers is not None) == kernels  # one C call per decoder layer


@pytest.mark.parametrize("shape", SHAPES)
def test_batch_equals_hf(shape, reference, cpu_path):
    model_dir, prompts, expected = reference(shape)
    llm = LLM(model_dir)
    assert_path(llm, cpu_path)
    assert_same(generate(llm, prompts), expected, prompts)
    assert llm.llm_engine.scheduler.num_preemptions == 0


@pytest.mark.parametrize("shape", SHAPES)
def test_preemption_equals_hf(shape, checkpoint):
    model_dir = checkpoint(shape)
    # 12 requests that are all admitted, then outgrow a 16-block pool while decoding
    prompts = random_prompts([10, 23, 31, 40, 17, 52, 8, 33, 45, 26, 60, 12], 1024, seed=3)
    max_tokens = [40] * len(prompts)
    expected = hf_greedy(model_dir, prompts, max_tokens, GENERATION_EOS_TOKEN_IDS)
    llm = LLM(model_dir, max_model_len=256, num_kvcache_blocks=16)
    assert_same(generate(llm, prompts, max_tokens), expected, prompts)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("shape", SHAPES)
def test_chunked_prefill_and_odd_block_size_equal_hf(shape, reference, cpu_path):
    model_dir, prompts, expected = reference(shape)
    llm = LLM(model_dir, kvcache_block_size=5, max_num_batched_tokens=37, max_num_seqs=6)
    assert_path(llm, cpu_path)
    assert_same(generate(llm, prompts), expected, prompts)


@pytest.mark.parametrize("shape", SHAPES)
def test_shared_prefix_hits_equal_hf(shape, checkpoint):
    model_dir = checkpoint(shape)
    (prefix,) = random_prompts([150], 1024, seed=7)
    suffixes = random_prompts([1, 3, 16, 20, 33, 2, 9, 40], 1024, seed=8)
    prompts = [prefix + s for s in suffixes] + [prefix[:64]]  # the last is fully cached
    max_tokens = [12, 5, 20, 8, 16, 3, 10, 6, 9]
    expected = hf_greedy(model_dir, prompts, max_tokens, GENERATION_EOS_TOKEN_IDS)
    llm = LLM(model_dir)
    generate(llm, [prefix], [1])  # warm the cache with the shared prefix
    bm = llm.llm_engine.block_manager
    assert_same(generate(llm, prompts, max_tokens), expected, prompts)
    # 9 blocks of the prefix per request (the fully cached one recomputes its last token)
    assert bm.hit_tokens == 8 * 144 + 63
