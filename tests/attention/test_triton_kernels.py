"""Triton paged attention against the pure-torch oracle (TorchRefBackend), kernel by kernel
and end to end against transformers.

On a CPU machine the kernels run in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1): tiny shapes, float32 to 1e-5 and float16 loosely. Tests marked gpu
use realistic shapes on CUDA with the compiled kernels."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.triton
pytest.importorskip("triton")

from nanokv import LLM, SamplingParams  # noqa: E402
from nanokv.attention.base import AttentionMetadata  # noqa: E402
from nanokv.attention.torch_ref import TorchRefBackend  # noqa: E402
from nanokv.attention.triton_backend import TritonBackend  # noqa: E402
from nanokv.attention.triton_kernels import (MAX_SPLITS, choose_num_splits, possible_num_splits,  # noqa: E402
                                             reshape_and_cache, tile_shape, warm_up)
from nanokv.testing.tiny import GENERATION_EOS_TOKEN_IDS  # noqa: E402

from ..conftest import hf_greedy, random_prompts  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# the interpreter runs CPU tensors; compiled kernels need CUDA ones
DEVICE = "cpu" if INTERPRET else "cuda"
needs_triton_device = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                         reason="needs CUDA or TRITON_INTERPRET=1")
# with TRITON_INTERPRET=1 even CUDA tensors would go through the (slow, bf16-less) interpreter
needs_compiled_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or INTERPRET,
    reason="needs CUDA and compiled kernels (TRITON_INTERPRET unset)")


@dataclass
class Batch:
    meta: AttentionMetadata
    block_size: int
    num_blocks: int


def make_batch(specs: list[tuple[int, int]], block_size: int, device, seed: int = 0,
               spare_blocks: int = 3) -> Batch:
    """Metadata as ModelRunner._prepare builds it for sequences given as (start_pos, q_len),
    decodes (q_len 1) first, each holding a random set of distinct blocks of the pool."""
    q_lens = [q for _, q in specs]
    num_decodes = next((i for i, q in enumerate(q_lens) if q != 1), len(q_lens))
    assert all(q != 1 for q in q_lens[num_decodes:]), "list decodes first"
    seq_lens = [start + q for start, q in specs]
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, slots = [], []
    for (start, _), n, seq_len in zip(specs, needed, seq_lens):
        table, free = free[:n], free[n:]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, seq_len)]
    width = max(needed)
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        num_decodes=num_decodes, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=q_lens, seq_lens_cpu=seq_lens)
    return Batch(meta, block_size, num_blocks)


def random_inputs(batch: Batch, num_q_heads, num_kv_heads, head_dim, dtype, device, seed=0):
    """q [T, Hq, D], k/v [T, Hkv, D] and one [2, num_blocks, bs, Hkv, D] cache whose every
    slot holds random values: cached prefixes are whatever the pages already contain."""
    g = torch.Generator().manual_seed(seed)
    num_tokens = len(batch.meta.slot_mapping)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)

    kv = randn(2, batch.num_blocks, batch.block_size, num_kv_heads, head_dim)
    return randn(num_tokens, num_q_heads, head_dim), randn(num_tokens, num_kv_heads, head_dim), \
        randn(num_tokens, num_kv_heads, head_dim), kv


def run_backend(backend, batch, q, k, v, kv):
    kv = kv.clone()
    backend.prepare(batch.meta, batch.block_size)
    out = backend.forward(q, k, v, kv[0], kv[1], batch.meta, q.shape[-1] ** -0.5)
    return out, kv


def assert_matches_ref(specs, block_size, heads, head_dim, dtype, num_splits, device=DEVICE, atol=1e-5, seed=0):
    batch = make_batch(specs, block_size, device, seed)
    q, k, v, kv = random_inputs(batch, *heads, head_dim, dtype, device, seed)
    want, want_kv = run_backend(TorchRefBackend(), batch, q, k, v, kv)
    got, got_kv = run_backend(TritonBackend(num_splits=num_splits), batch, q, k, v, kv)
    assert torch.equal(got_kv, want_kv)
    torch.testing.assert_close(got, want, atol=atol, rtol=atol)


# (start_pos, q_len) per sequence, decodes first; (Hq, Hkv); head_dim; block_size
CASES = {
    # decodes, prefix hits (start > 0) and fresh prefills; contexts 6, 1, 10 = 2 blocks, 15
    "mixed-gqa4-d32-bs5": ([(5, 1), (0, 1), (9, 1), (3, 7), (0, 12), (10, 5)], (8, 2), 32, 5),
    # contexts of exactly one and two blocks and one either side; a chunk ending on a boundary
    "boundaries-mha-d64-bs16": ([(14, 1), (15, 1), (16, 1), (31, 1), (16, 16), (0, 17), (15, 2)], (2, 2), 64, 16),
    # one-token pages, one kv head, head_dim padded 80 -> 128
    "mqa-d80-bs1": ([(3, 1), (0, 1), (2, 6), (0, 4)], (4, 1), 80, 1),
    # pure decode, group of 3 (rows of the tile not a multiple of the group)
    "decode-gqa3-d128-bs16": ([(40, 1), (63, 1), (1, 1), (95, 1)], (6, 2), 128, 16),
}


@needs_triton_device
@pytest.mark.parametrize("num_splits", [1, 3], ids=["single-pass", "split-kv"])
@pytest.mark.parametrize("case", list(CASES))
def test_float32_matches_torch_ref(case, num_splits):
    specs, heads, head_dim, block_size = CASES[case]
    assert_matches_ref(specs, block_size, heads, head_dim, torch.float32, num_splits)


@needs_triton_device
@pytest.mark.parametrize("num_splits", [1, 2])
def test_float16_matches_torch_ref(num_splits):
    specs, heads, head_dim, block_size = CASES["mixed-gqa4-d32-bs5"]
    assert_matches_ref(specs, block_size, heads, head_dim, torch.float16, num_splits, atol=1e-2)


@needs_triton_device
@pytest.mark.skipif(INTERPRET, reason="the interpreter's tl.dot multiplies bfloat16 bit patterns "
                                      "(triton-lang/triton#11584); covered on CUDA")
def test_bfloat16_matches_torch_ref():
    specs, heads, head_dim, block_size = CASES["mixed-gqa4-d32-bs5"]
    for num_splits in (1, 2):
        assert_matches_ref(specs, block_size, heads, head_dim, torch.bfloat16, num_splits, atol=2e-2)


@needs_triton_device
def test_split_kv_with_empty_splits_and_fully_masked_rows():
    # 8 splits of (at least) 64-key chunks over contexts of 1..70 keys: most splits see no
    # key at all, and the split holding keys 64..67 of the chunk at positions 60..67 lies
    # entirely in the future of its first four queries
    assert_matches_ref([(69, 1), (0, 1), (20, 1), (60, 8), (0, 3)], 16, (4, 2), 32, torch.float32, 8)


@needs_triton_device
def test_reshape_and_cache_skips_negative_slots():
    num_blocks, block_size, heads, dim = 3, 5, 2, 24
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 6, heads, dim, generator=g).to(DEVICE)
    kv = torch.randn(2, num_blocks, block_size, heads, dim, generator=g).to(DEVICE)
    slots = torch.tensor([7, -1, 0, 14, -1, 3], device=DEVICE)
    want = kv.clone()
    keep = slots >= 0
    want[0].view(-1, heads, dim)[slots[keep]] = k[keep]
    want[1].view(-1, heads, dim)[slots[keep]] = v[keep]
    reshape_and_cache(k, v, kv[0], kv[1], slots)
    assert torch.equal(kv, want)


@needs_triton_device
def test_reshape_and_cache_reads_strided_inputs():
    # k and v as the model hands them: head-sliced views of one fused qkv projection
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(4, 3 + 2 * 2, 16, generator=g).to(DEVICE)  # [T, Hq + 2 Hkv, D]
    k, v = qkv[:, 3:5], qkv[:, 5:]
    kv = torch.zeros(2, 2, 4, 2, 16, device=DEVICE)
    slots = torch.tensor([5, 6, 7, 0], device=DEVICE)
    reshape_and_cache(k, v, kv[0], kv[1], slots)
    assert torch.equal(kv[0].view(-1, 2, 16)[slots], k)
    assert torch.equal(kv[1].view(-1, 2, 16)[slots], v)


def test_split_heuristic():
    block_q = tile_shape(32, 8, 128, 1)[1]
    assert choose_num_splits(4, 8, 1, block_q, 4096, num_sms=132) > 1  # few long decodes
    assert choose_num_splits(64, 8, 1, block_q, 4096, num_sms=132) == 1  # enough programs already
    assert choose_num_splits(4, 8, 1, block_q, 300, num_sms=132) == 1  # contexts too short to split
    assert choose_num_splits(4, 8, 512, block_q, 4096, num_sms=132) == 1  # prefill: many tiles


def test_tile_shape_packs_the_query_group():
    assert tile_shape(32, 8, 128, 1) == (16, 4, 64)  # decode: 4 tokens x 4 heads
    assert tile_shape(32, 8, 128, 100) == (64, 16, 64)
    assert tile_shape(6, 2, 256, 1) == (16, 5, 32)  # group of 3: 15 of 16 rows used
    assert tile_shape(64, 1, 64, 1) == (64, 1, 64)  # MQA: one token's 64 heads per tile
    assert tile_shape(32, 8, 128, 100, elem_bytes=4)[2] == 32  # float32: half the keys per step


def run_python(code: str, **env_changes) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), **env_changes}
    env = {k: v for k, v in env.items() if v is not None}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.mark.slow
def test_torch_backend_never_imports_triton(checkpoint):
    # a fresh interpreter: in this one transformers' generate (the HF oracle) has loaded it
    run_python(f"""
import sys
from nanokv import LLM, SamplingParams
llm = LLM({checkpoint("qwen3-tiny")!r}, attention_backend="torch", max_model_len=128, num_kvcache_blocks=40)
llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
assert "triton" not in sys.modules, "triton imported"
""")


# Compiles (no launch) for sm_90 with the real compiler, ptxas included: catches what the
# interpreter lets through (types of loop-carried values, dot shapes, constexpr branches).
COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nanokv.attention import triton_kernels as tk

def build(fn, types, constexprs):
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32))

f32 = "*fp32"
for kv, quantized in (("*bf16", False), ("*i8", True), ("*fp8e4nv", True)):  # pages: bf16, int8, e4m3
    build(tk._paged_attention_kernel,
          dict(q_ptr="*bf16", k_cache_ptr=kv, v_cache_ptr=kv, out_ptr="*bf16", part_m_ptr=f32,
               part_l_ptr=f32, part_acc_ptr=f32, block_tables_ptr="*i32", query_start_loc_ptr="*i32",
               seq_lens_ptr="*i32", k_scale_ptr="*fp16", v_scale_ptr="*fp16", scale_log2="fp32"),
          dict(HEAD_DIM=80, D_PAD=128, GROUP=3, BLOCK_Q=5, BLOCK_M=16, BLOCK_N=64, NUM_SPLITS=4, PRECISION="ieee",
               QUANTIZED=quantized))
    if quantized:
        build(tk._quantize_and_cache_kernel,
              dict(k_ptr="*bf16", v_ptr="*bf16", k_cache_ptr=kv, v_cache_ptr=kv, k_scale_ptr="*fp16", v_scale_ptr="*fp16",
                   slot_ptr="*i64"),
              dict(HEAD_DIM=80, D_PAD=128, QMAX=127.0 if kv == "*i8" else 448.0, BLOCK_T=16))
build(tk._merge_splits_kernel, dict(part_m_ptr=f32, part_l_ptr=f32, part_acc_ptr=f32, out_ptr="*bf16"),
      dict(HEAD_DIM=80, D_PAD=128, NUM_SPLITS=4, S_PAD=4))
build(tk._reshape_and_cache_kernel,
      dict(k_ptr="*bf16", v_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", slot_ptr="*i64"),
      dict(HEAD_DIM=80, ROW=160, ROW_PAD=256, BLOCK_T=8))
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_a_gpu():
    run_python(COMPILE_FOR_SM90, TRITON_INTERPRET=None)


# ---- end to end: greedy tokens equal transformers' ----------------------------------------

def triton_llm(model_dir, **kw):
    # The interpreter copies every tensor argument's whole storage (the entire pool) at each
    # launch, so keep the pool small.
    return LLM(model_dir, attention_backend="triton", max_model_len=128, num_kvcache_blocks=40, **kw)


def generate(llm, prompts, max_tokens):
    params = [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def hf_tokens(model_dir, prompts, max_tokens):
    return [tokens for tokens, _ in hf_greedy(model_dir, prompts, max_tokens, GENERATION_EOS_TOKEN_IDS)]


@needs_triton_device
def test_llm_greedy_equals_hf(checkpoint):
    model_dir = checkpoint("qwen3-tiny")
    prompts = random_prompts([1, 17, 40, 6], 1024, seed=11)
    max_tokens = [8, 6, 4, 8]
    llm = triton_llm(model_dir, kvcache_block_size=16)
    assert generate(llm, prompts, max_tokens) == hf_tokens(model_dir, prompts, max_tokens)


@needs_triton_device
def test_llm_prefix_hit_and_chunked_prefill_equal_hf(checkpoint):
    model_dir = checkpoint("qwen3-tiny")
    (prefix,) = random_prompts([21], 1024, seed=12)
    suffixes = random_prompts([3, 12], 1024, seed=13)
    prompts = [prefix + s for s in suffixes]
    max_tokens = [5, 4]
    expected = hf_tokens(model_dir, prompts, max_tokens)

    llm = triton_llm(model_dir, kvcache_block_size=16)
    generate(llm, [prefix], [1])  # caches the prefix's first block
    assert generate(llm, prompts, max_tokens) == expected
    assert llm.llm_engine.block_manager.hit_tokens == 2 * 16

    chunked = triton_llm(model_dir, kvcache_block_size=5, max_num_batched_tokens=9)
    assert generate(chunked, prompts, max_tokens) == expected


# ---- CUDA: realistic shapes, compiled kernels ---------------------------------------------

GPU_SPECS = {
    # few long decodes: the split-KV heuristic's case
    "long-decodes": [(4095, 1), (2999, 1), (16, 1), (255, 1)],
    # decodes next to a fresh prefill and a chunk after a 3000-token cached prefix
    "mixed": [(4000, 1), (511, 1), (0, 512), (3000, 200), (256, 17)],
}


@pytest.mark.gpu
@needs_compiled_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("num_splits", [None, 1, 4], ids=["auto", "single-pass", "split-kv"])
@pytest.mark.parametrize("specs", list(GPU_SPECS))
def test_cuda_matches_torch_ref(specs, num_splits, block_size, dtype):
    batch = make_batch(GPU_SPECS[specs], block_size, "cuda")
    q, k, v, kv = random_inputs(batch, 32, 8, 128, dtype, "cuda")
    # oracle in float32 from the same rounded inputs; the kernel rounds P to 16 bits for P @ V
    want, want_kv = run_backend(TorchRefBackend(), batch, q.float(), k.float(), v.float(), kv.float())
    got, got_kv = run_backend(TritonBackend(num_splits=num_splits), batch, q, k, v, kv)
    assert torch.equal(got_kv.float(), want_kv)
    atol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=atol)


@pytest.mark.gpu
@needs_compiled_cuda
def test_cuda_auto_heuristic_splits_long_decodes():
    batch = make_batch(GPU_SPECS["long-decodes"], 16, "cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    block_q = tile_shape(32, 8, 128, 1)[1]
    assert choose_num_splits(batch.meta.num_seqs, 8, 1, block_q, batch.meta.max_seq_len, sms) > 1


def test_auto_never_picks_flash_attn_for_float32(monkeypatch):
    import nanokv.attention as attention

    monkeypatch.setattr(attention, "_importable", lambda module: True)  # flash_attn and triton "installed"
    cuda = torch.device("cuda")
    assert attention.resolve_backend("auto", cuda, 256, torch.bfloat16, 128) == "flash_attn"
    assert attention.resolve_backend("auto", cuda, 256, torch.float16, 128) == "flash_attn"
    assert attention.resolve_backend("auto", cuda, 256, torch.float32, 128) == "triton"
    with pytest.raises(ValueError, match="float16 and bfloat16"):
        attention.resolve_backend("flash_attn", cuda, 256, torch.float32, 128)


def test_split_counts_are_powers_of_two_and_warm_up_lists_them_all():
    seen = set()
    for num_kv_heads in (1, 2, 8):
        for num_seqs in range(1, 80):
            for max_seq_len in (255, 300, 700, 1500, 5000, 40960):
                n = choose_num_splits(num_seqs, num_kv_heads, 1, 4, max_seq_len, num_sms=132)
                assert n & (n - 1) == 0 and n <= MAX_SPLITS
                assert n in possible_num_splits(num_kv_heads, max_seq_len, 132)
                seen.add(n)
    assert seen == {1, 2, 4, 8, 16, 32, 64}
    assert possible_num_splits(8, 40960, 132) == [1, 2, 4, 8, 16, 32]  # Qwen3-0.6B on an H200


@needs_triton_device
def test_warm_up_launches_every_variant():
    # group 2: decode tile (16 rows) and prefill tile (64 rows, 32 queries), each with 1, 2, 4 splits
    assert possible_num_splits(2, 1024, 8) == [1, 2, 4]
    assert warm_up(4, 2, 32, torch.float32, torch.device(DEVICE), 16, 1024, num_sms=8) == 2 * 3
    # group 32: one tile shape whatever the query length
    assert warm_up(32, 1, 16, torch.float32, torch.device(DEVICE), 16, 300, num_sms=8) == 1


def test_varying_step_sizes_are_not_specialised_on():
    from nanokv.attention import triton_kernels as tk

    def unspecialised(fn):  # a JITFunction, or the interpreter's stand-in (which keeps jit's kwargs)
        return set(getattr(fn, "do_not_specialize", None) or fn.kwargs.get("do_not_specialize", ()))

    assert {"num_seqs", "stride_bt"} <= unspecialised(tk._paged_attention_kernel)
    assert {"num_tokens"} <= unspecialised(tk._reshape_and_cache_kernel)


def _compiled_variants(fn) -> int:
    caches = getattr(fn, "device_caches", None)  # triton >= 3.2: device -> (kernel cache, ...)
    if caches is None:
        pytest.skip("this triton keeps its compiled kernels elsewhere")
    return sum(len(entry[0]) for entry in caches.values())


@pytest.mark.gpu
@needs_compiled_cuda
def test_cuda_nothing_compiles_after_warm_up(checkpoint):
    """Steps of every size (batch 1 to 9, contexts up to 1000, prefill chunks beside decodes)
    launch only kernel variants the LLM's warm-up compiled."""
    from nanokv.attention import triton_kernels as tk

    llm = LLM(checkpoint("qwen3-tiny"), dtype="bfloat16", attention_backend="triton", max_model_len=1024,
              max_num_batched_tokens=512, enforce_eager=True)
    kernels = (tk._paged_attention_kernel, tk._merge_splits_kernel, tk._reshape_and_cache_kernel)
    before = [_compiled_variants(k) for k in kernels]
    prompts = random_prompts([1, 7, 40, 200, 600, 900, 3, 17, 64], 1024, seed=21)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (100, 90, 80, 70, 60, 50, 9, 5, 1)]
    llm.generate(prompts[:1], params[:1], use_tqdm=False)  # one long decode alone: the most splits
    llm.generate(prompts, params, use_tqdm=False)
    assert [_compiled_variants(k) for k in kernels] == before
