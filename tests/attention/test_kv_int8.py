"""The quantized KV cache (kv_cache_dtype='int8'; 'fp8' on CUDA): the per-(token, head)
quantizer, every attention backend on int8 pages against the torch reference, pool sizing
from the byte formula, and end to end on the tiny checkpoints.

The oracle for the kernels is TorchRefBackend on the same int8 pages: it dequantizes the
pages it gathers (q * scale) and runs SDPA, so a kernel that reads the pages, the scales
or their slots wrongly differs from it by far more than float32 rounding."""

from __future__ import annotations

import pytest
import torch

from nanokv import LLM, SamplingParams, kernels
from nanokv.attention.base import AttentionMetadata, dequantize_kv, quantize_kv, store_kv
from nanokv.attention.cpu_backend import CpuBackend
from nanokv.attention.torch_ref import TorchRefBackend
from nanokv.runner.kv_cache import bytes_per_token

from .test_triton_kernels import CASES, INTERPRET, make_batch

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="needs the CPU kernels (a C compiler)")


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---- the quantizer -------------------------------------------------------------------------

def test_int8_round_trip_error_is_within_half_a_step():
    x = _randn(64, 4, 64) * torch.logspace(-3, 2, 64)[:, None, None] + torch.linspace(-5, 5, 64)[:, None, None]
    q, params = quantize_kv(x, torch.int8)
    assert q.dtype == torch.int8 and params.shape == (64, 4, 2) and params.dtype == torch.float16
    scale, zero = params.float().unbind(-1)
    assert int(q.abs().max()) == 127 and (q.abs().amax(-1) >= 126).all()  # the range is used
    err = (dequantize_kv(q, params) - x).abs()
    # asymmetric rounding around the midpoint: at most half a quantization step per element
    assert (err <= scale[..., None] / 2 * (1 + 1e-3) + 1e-6).all()
    # the step is (max - min) / 254, plus the float16 rounding of the midpoint (2^-11 of it,
    # which matters only when the values sit far from 0 relative to their spread): a
    # symmetric max |x| / 127 step would be ~(|offset| + spread / 2) / 127
    width, mid = x.amax(-1) - x.amin(-1), (x.amax(-1) + x.amin(-1)) / 2
    assert (scale >= width / 254 * (1 - 1e-3)).all()
    assert (scale <= (width / 2 + mid.abs() * 2.0 ** -11) / 127 * (1 + 1e-3) + 1e-7).all()
    spread = width > 100 * mid.abs() * 2.0 ** -11
    torch.testing.assert_close(scale[spread], width[spread] / 254, rtol=0.025, atol=0)  # 2% from the midpoint
    gauss = _randn(64, 4, 64, seed=5)
    q, params = quantize_kv(gauss, torch.int8)
    rel = (dequantize_kv(q, params) - gauss).norm(dim=-1) / gauss.norm(dim=-1)
    assert float(rel.max()) < 0.01  # Gaussian heads: ~0.4% relative error


def test_constant_head_is_exact_and_zero_head_has_no_nan():
    x = _randn(3, 2, 16)
    x[1, 0] = 0
    x[2, 1] = 1.5
    q, params = quantize_kv(x, torch.int8)
    assert params[1, 0, 0] == 0 and (q[1, 0] == 0).all() and params[2, 1, 0] == 0
    y = dequantize_kv(q, params)
    assert torch.isfinite(y).all() and (y[1, 0] == 0).all() and (y[2, 1] == 1.5).all()


def test_fp8_round_trip_error():
    x = _randn(32, 2, 64)
    q, params = quantize_kv(x, torch.float8_e4m3fn)
    scale, zero = params.float().unbind(-1)
    err = (dequantize_kv(q, params) - x).abs()
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 of the centred value, plus subnormals near 0
    assert (err <= (x - zero[..., None]).abs() / 16 + scale[..., None] * 2.0 ** -9 + 1e-6).all()


def test_store_kv_writes_values_and_scales_into_the_slots():
    num_blocks, bs, heads, d = 4, 3, 2, 8
    k, v = _randn(5, heads, d, seed=1), _randn(5, heads, d, seed=2)
    cache = torch.zeros(2, num_blocks, bs, heads, d, dtype=torch.int8)
    scales = torch.zeros(2, num_blocks, bs, heads, 2, dtype=torch.float16)
    slots = torch.tensor([11, 0, 4, 5, 7])
    store_kv(k, v, cache[0], cache[1], slots, scales[0], scales[1])
    for x, c, s in ((k, cache[0], scales[0]), (v, cache[1], scales[1])):
        q, sc = quantize_kv(x, torch.int8)
        assert torch.equal(c.view(-1, heads, d)[slots], q) and torch.equal(s.view(-1, heads, 2)[slots], sc)
    untouched = torch.ones(num_blocks * bs, dtype=torch.bool)
    untouched[slots] = False
    assert (scales[0].view(-1, heads, 2)[untouched] == 0).all()


@needs_kernels
def test_c_store_quantizes_to_the_same_bits_as_torch():
    num_blocks, bs, heads, d = 5, 4, 3, 24
    qkv = _randn(9, 4 + 2 * heads, d, seed=3) * 3  # k and v as strided views of a fused projection
    k, v = qkv[:, 4:4 + heads], qkv[:, 4 + heads:]
    slots = torch.randperm(num_blocks * bs, generator=torch.Generator().manual_seed(0))[:9]
    want = (torch.zeros(2, num_blocks, bs, heads, d, dtype=torch.int8),
            torch.zeros(2, num_blocks, bs, heads, 2, dtype=torch.float16))
    got = torch.zeros_like(want[0]), torch.zeros_like(want[1])
    store_kv(k, v, want[0][0], want[0][1], slots, want[1][0], want[1][1])
    kernels.store_kv(k, v, got[0][0], got[0][1], slots, got[1][0], got[1][1])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---- backends on int8 pages against the torch reference -----------------------------------

def int8_inputs(batch, num_q_heads, num_kv_heads, head_dim, seed=0):
    """q, k, v and an int8 pool [2, blocks, bs, Hkv, D] with its (scale, zero) pairs [2,
    blocks, bs, Hkv, 2], every slot quantized from random offset values (cached prefixes:
    whatever the pages hold)."""
    g = torch.Generator().manual_seed(seed)
    n = len(batch.meta.slot_mapping)
    pool = torch.randn(2, batch.num_blocks, batch.block_size, num_kv_heads, head_dim, generator=g)
    pool = pool * torch.rand(2, batch.num_blocks, batch.block_size, num_kv_heads, 1, generator=g) * 4
    pool = pool + torch.randn(2, batch.num_blocks, batch.block_size, num_kv_heads, 1, generator=g)  # zeros matter
    cache, scales = quantize_kv(pool.flatten(0, 2), torch.int8)
    cache = cache.view(pool.shape)
    scales = scales.view(*pool.shape[:-1], 2)
    q = torch.randn(n, num_q_heads, head_dim, generator=g)
    k = torch.randn(n, num_kv_heads, head_dim, generator=g) + torch.randn(n, num_kv_heads, 1, generator=g)
    v = torch.randn(n, num_kv_heads, head_dim, generator=g) - 0.5
    return q, k, v, cache, scales


def run_int8(backend, batch, q, k, v, cache, scales):
    cache, scales = cache.clone(), scales.clone()
    backend.prepare(batch.meta, batch.block_size)
    out = backend.forward(q, k, v, cache[0], cache[1], batch.meta, q.shape[-1] ** -0.5, scales[0], scales[1])
    return out, cache, scales


def dequantized_oracle(batch, q, k, v, cache, scales):
    """The same step on a float64 pool holding the dequantized pages, with this step's k, v
    rounded through the quantizer: what every int8 backend must compute (float32 [T, Hq, D])."""
    cache, scales = cache.clone(), scales.clone()
    store_kv(k, v, cache[0], cache[1], batch.meta.slot_mapping, scales[0], scales[1])
    pool = dequantize_kv(cache, scales).double()
    ref = TorchRefBackend()
    ref.prepare(batch.meta, batch.block_size)
    kd, vd = (pool[i].view(-1, *pool.shape[3:])[batch.meta.slot_mapping] for i in (0, 1))
    return ref.forward(q.double(), kd, vd, pool[0], pool[1], batch.meta, q.shape[-1] ** -0.5).float()


def test_torch_ref_on_int8_pages_equals_attention_over_the_dequantized_pool():
    specs, heads, head_dim, block_size = CASES["mixed-gqa4-d32-bs5"]
    batch = make_batch(specs, block_size, "cpu")
    q, k, v, cache, scales = int8_inputs(batch, *heads, head_dim)
    got, _, _ = run_int8(TorchRefBackend(), batch, q, k, v, cache, scales)
    torch.testing.assert_close(got, dequantized_oracle(batch, q, k, v, cache, scales), atol=1e-6, rtol=1e-6)
    # and it is not float32 attention over the unquantized values: the test can tell them apart
    f32 = TorchRefBackend()
    f32.prepare(batch.meta, batch.block_size)
    exact = f32.forward(q, k, v, *dequantize_kv(cache, scales), batch.meta, head_dim ** -0.5)
    assert (got - exact).abs().max() > 1e-4


C_CASES = {
    **{name: CASES[name] for name in ("mixed-gqa4-d32-bs5", "boundaries-mha-d64-bs16", "decode-gqa3-d128-bs16")},
    # long prefill tiles after a cached prefix (tiles of 32 rows), odd pages, GQA 2
    "tiles-gqa2-d64-bs7": ([(3, 1), (40, 1), (0, 37), (21, 19), (9, 5)], (4, 2), 64, 7),
    # MQA decodes and a prefill, head_dim 24 (a half vector at width 16)
    "mqa-d24-bs3": ([(17, 1), (2, 1), (5, 9), (0, 20)], (6, 1), 24, 3),
    # two long decodes: one work item per (query, KV head), so heads h0 > 0 start an item
    "two-decodes-gqa2-d64-bs5": ([(50, 1), (33, 1)], (4, 2), 64, 5),
}


@needs_kernels
@pytest.mark.parametrize("width", kernels.build.WIDTHS, ids=lambda w: f"width{w}")
@pytest.mark.parametrize("case", list(C_CASES))
def test_c_kernels_on_int8_pages_match_torch_ref(case, width, monkeypatch):
    monkeypatch.setenv("NANOKV_CPU_WIDTH", str(width))
    specs, heads, head_dim, block_size = C_CASES[case]
    batch = make_batch(specs, block_size, "cpu")
    q, k, v, cache, scales = int8_inputs(batch, *heads, head_dim)
    want, want_cache, want_scales = run_int8(TorchRefBackend(), batch, q, k, v, cache, scales)
    got, got_cache, got_scales = run_int8(CpuBackend(), batch, q, k, v, cache, scales)
    assert torch.equal(got_cache, want_cache) and torch.equal(got_scales, want_scales)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.triton
@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("num_splits", [1, 3], ids=["single-pass", "split-kv"])
@pytest.mark.parametrize("case", ["mixed-gqa4-d32-bs5", "mqa-d80-bs1", "decode-gqa3-d128-bs16"])
def test_triton_on_int8_pages_matches_torch_ref(case, num_splits):
    pytest.importorskip("triton")
    from nanokv.attention.triton_backend import TritonBackend

    device = "cpu" if INTERPRET else "cuda"
    specs, heads, head_dim, block_size = CASES[case]
    batch = make_batch(specs, block_size, "cpu")
    q, k, v, cache, scales = int8_inputs(batch, *heads, head_dim)
    want, want_cache, want_scales = run_int8(TorchRefBackend(), batch, q, k, v, cache, scales)
    on = make_batch(specs, block_size, device)
    got, got_cache, got_scales = run_int8(TritonBackend(num_splits=num_splits), on, *(
        t.to(device) for t in (q, k, v, cache, scales)))
    assert torch.equal(got_cache.cpu(), want_cache) and torch.equal(got_scales.cpu(), want_scales)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)


# ---- a token's attention does not depend on the batch it runs in ----------------------------
# On int8 pages a one-ulp difference in a token's attention output can move a value of the
# next layer's K/V across a rounding boundary of its int8 step (1/254 of the head's range):
# the same request then gives other tokens warm (prefix cached: the rest of the prompt runs
# alone or in a shorter chunk) than cold. So every query's output must be the same bits
# however the step around it is cut: a decode, alone, in a prefill chunk of any length.

def _step_meta(steps, tables, block_size):
    """AttentionMetadata of one step: steps lists (sequence, first position, query length),
    decodes (length 1) first."""
    steps = sorted(steps, key=lambda st: st[2] != 1)
    q_lens = [n for _, _, n in steps]
    seq_lens = [p + n for _, p, n in steps]
    slots = [tables[i][t // block_size] * block_size + t % block_size for i, p, n in steps for t in range(p, p + n)]
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    return steps, AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(cu, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([tables[i] for i, _, _ in steps], dtype=torch.int32),
        num_decodes=q_lens.count(1), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=q_lens, seq_lens_cpu=seq_lens)


def _attend_in_steps(backend, cuts, length, num_q_heads, num_kv_heads, head_dim, block_size):
    """Two sequences of `length` tokens written into int8 pages and attended over step by
    step, each step running a chunk of each as cuts (chunk lengths, summing to length)
    gives -> outputs [2, length, Hq, D]. The same q, k, v whatever the cuts."""
    g = torch.Generator().manual_seed(7)
    per_seq = -(-length // block_size)
    order = torch.randperm(2 * per_seq + 1, generator=g).tolist()
    tables = [order[:per_seq], order[per_seq:2 * per_seq]]
    q = torch.randn(2, length, num_q_heads, head_dim, generator=g)
    k = torch.randn(2, length, num_kv_heads, head_dim, generator=g) * 2 + torch.randn(2, length, num_kv_heads, 1,
                                                                                      generator=g)
    v = torch.randn(2, length, num_kv_heads, head_dim, generator=g) - 0.5
    cache = torch.zeros(2, 2 * per_seq + 1, block_size, num_kv_heads, head_dim, dtype=torch.int8)
    scales = torch.zeros(*cache.shape[:-1], 2, dtype=torch.float16)
    out = torch.zeros_like(q)
    pos = [0, 0]
    for i, n in enumerate(cuts):
        # the second sequence runs its chunks in the other order: decodes beside prefills
        n2 = cuts[len(cuts) - 1 - i]
        steps, meta = _step_meta([(0, pos[0], n), (1, pos[1], n2)], tables, block_size)
        backend.prepare(meta, block_size)
        q_k_v = (torch.cat([x[s, p:p + m] for s, p, m in steps]) for x in (q, k, v))
        o = backend.forward(*q_k_v, cache[0], cache[1], meta, head_dim ** -0.5, scales[0], scales[1])
        start = 0
        for s, p, m in steps:
            out[s, p:p + m] = o[start:start + m]
            start += m
        pos[0] += n
        pos[1] += n2
    return out


def _cuts(length, first, size):
    cuts = [first] if first else []
    while sum(cuts) < length:
        cuts.append(min(size, length - sum(cuts)))
    return cuts


INVARIANCE_CASES = {  # (Hq, Hkv, D, block_size)
    "gqa3-d64-bs16": (9, 3, 64, 16),  # SmolLM2's heads
    "gqa2-d32-bs5": (6, 2, 32, 5),
    "mha-d16-bs8": (4, 4, 16, 8),
    "mqa-d24-bs3": (4, 1, 24, 3),
    "gqa8-d64-bs7": (16, 2, 64, 7),
}


def _invariance_backends():
    out = [pytest.param(("cpu", w), id=f"cpu-width{w}", marks=needs_kernels) for w in kernels.build.WIDTHS]
    return out + [pytest.param(("torch", None), id="torch")]


@pytest.mark.parametrize("backend", _invariance_backends())
@pytest.mark.parametrize("case", list(INVARIANCE_CASES))
def test_int8_attention_output_does_not_depend_on_how_the_steps_are_cut(case, backend, monkeypatch):
    """Every token as a decode (one query a step), against the whole prompt in one step,
    in chunks of 2, 3, 7 and 16 from several first lengths (a cached prefix, a chunk
    boundary): the same bits for every token."""
    name, width = backend
    if width is not None:
        monkeypatch.setenv("NANOKV_CPU_WIDTH", str(width))
    make = {"cpu": CpuBackend, "torch": TorchRefBackend}[name]
    length = 45
    want = _attend_in_steps(make(), [1] * length, length, *INVARIANCE_CASES[case])
    for cuts in ([length], _cuts(length, 0, 2), _cuts(length, 0, 3), _cuts(length, 5, 7), _cuts(length, 32, 16),
                 _cuts(length, 13, 16), _cuts(length, 44, 1)):
        got = _attend_in_steps(make(), cuts, length, *INVARIANCE_CASES[case])
        assert torch.equal(got, want), (cuts, (got - want).abs().amax((2, 3)).nonzero().tolist())


@pytest.mark.triton
@pytest.mark.skipif(not INTERPRET, reason="compiled Triton kernels (CUDA) choose split-KV and tiles by the batch: "
                    "not promised there (README)")
@pytest.mark.parametrize("case", ["gqa3-d64-bs16", "mqa-d24-bs3"])
def test_triton_int8_attention_in_the_interpreter_does_not_depend_on_how_the_steps_are_cut(case):
    pytest.importorskip("triton")
    from nanokv.attention.triton_backend import TritonBackend

    length = 45
    want = _attend_in_steps(TritonBackend(), [1] * length, length, *INVARIANCE_CASES[case])
    for cuts in ([length], _cuts(length, 5, 7), _cuts(length, 32, 16)):
        got = _attend_in_steps(TritonBackend(), cuts, length, *INVARIANCE_CASES[case])
        assert torch.equal(got, want), cuts


# ---- engine arguments and pool sizing -------------------------------------------------------

def test_fp8_on_the_cpu_is_refused_naming_int8(model_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        LLM(model_dir, device="cpu", kv_cache_dtype="fp8", max_model_len=128)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(model_dir, kv_cache_dtype="int4", max_model_len=128)


def test_kv_cache_dtype_flows_to_the_cli_flags():
    from nanokv.entrypoints.cli.arguments import build_parser, engine_args_from_cli
    from nanokv.entrypoints.cli.common import Rank

    commands = build_parser()._subparsers._group_actions[0].choices
    args = commands["generate"].parse_args(["--input", "i", "--output", "o", "--kv-cache-dtype", "int8"])
    assert engine_args_from_cli(args, Rank()).kv_cache_dtype == "int8"
    assert commands["serve"].parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"


def test_pool_holds_the_tokens_the_byte_formula_gives(checkpoint):
    """At one byte budget the int8 pool holds exactly budget // (block_size * bytes per
    token) blocks, bytes per token = 2 * layers * Hkv * (D + 4) (int8 values, a float16 scale
    and zero): at head_dim 64 that is 68 bytes a head against float32's 256, 3.76x the tokens."""
    model_dir = checkpoint("llama3-tiny", head_dim=64)
    budget = 64 << 20
    llms = {dt: LLM(model_dir, kv_cache_dtype=dt, kv_cache_memory_bytes=budget, max_model_len=256)
            for dt in ("auto", "int8")}
    cfg = llms["auto"].llm_engine.config.hf_config
    layers, kv_heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    per_token = {"auto": 2 * layers * kv_heads * 64 * 4, "int8": 2 * layers * kv_heads * (64 + 4)}
    for dt, llm in llms.items():
        stats = llm.kv_stats()
        assert stats.bytes_per_token == per_token[dt] == llm.llm_engine.runner.kv_bytes_per_token
        assert stats.num_blocks == budget // (16 * per_token[dt])
        assert stats.tokens_per_gib == (1 << 30) // per_token[dt]
    runner = llms["int8"].llm_engine.runner
    assert runner.kv_cache.dtype == torch.int8 and runner.kv_scales.dtype == torch.float16
    assert runner.kv_scales.shape == (*runner.kv_cache.shape[:-1], 2)
    ratio = llms["int8"].kv_stats().num_blocks / llms["auto"].kv_stats().num_blocks
    assert ratio >= 3.5 and abs(ratio - 256 / 68) < 0.01


def test_bytes_per_token_counts_the_scales(cpu_config_int8):
    assert bytes_per_token(cpu_config_int8, 3, 2, 64) == 2 * 3 * 2 * (64 + 4)


@pytest.fixture
def cpu_config_int8(model_dir):
    from nanokv.engine.arg_utils import EngineArgs

    return EngineArgs(model=model_dir, kv_cache_dtype="int8", max_model_len=128).create_engine_config()


# ---- end to end on the tiny checkpoints ----------------------------------------------------

def greedy(llm, prompts, max_tokens=24):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def prompts_for(llm, lengths, seed=0):
    vocab = llm.llm_engine.config.hf_config.vocab_size
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]


BACKENDS = ["cpu", "torch"] if kernels.available() else ["torch"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", ["qwen3-tiny", "llama3-tiny"])
def test_int8_greedy_agrees_with_float32_kv(checkpoint, shape, backend):
    """int8 pages against float32 pages on the same random weights, within a stated
    agreement: teacher-forced top-1 agreement >= 90% of positions (measured ~97%), and
    greedy runs keep >= 50% of their tokens before the first difference (measured ~70%).
    Random tiny models have flat distributions (median top-1 margin ~0.5 logits, about
    the int8 error of their logits), so near-ties flip far more often than on a trained
    model (SmolLM2: README); a wrong page, scale or slot read agrees on almost nothing."""
    from nanokv.testing.accuracy import scoring_engine, window_logits

    model_dir = checkpoint(shape)
    kw = dict(attention_backend=backend, max_model_len=256)
    tokens = list(range(4, 124))
    ref_logits = window_logits(scoring_engine(model_dir, **kw), tokens)
    q8_logits = window_logits(scoring_engine(model_dir, kv_cache_dtype="int8", **kw), tokens)
    assert float((ref_logits.argmax(-1) == q8_logits.argmax(-1)).float().mean()) >= 0.9
    ref = LLM(model_dir, **kw)
    q8 = LLM(model_dir, kv_cache_dtype="int8", **kw)
    prompts = prompts_for(ref, [5, 17, 33, 64, 90, 3, 48, 120])
    want, got = greedy(ref, prompts), greedy(q8, prompts)
    prefix = sum(next((i for i, (a, b) in enumerate(zip(w, g)) if a != b), len(w)) for w, g in zip(want, got))
    assert prefix / sum(len(w) for w in want) >= 0.5, (want, got)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int8_backends_agree_with_each_other(checkpoint, backend):
    """The C kernels (fused layers, C quantizer) and the torch path on int8 pages give the
    same greedy tokens: both compute the same quantized pages."""
    if backend == "torch":
        pytest.skip("the pair is (cpu, torch): run once")
    model_dir = checkpoint("qwen3-tiny")
    a = LLM(model_dir, attention_backend="cpu", kv_cache_dtype="int8", max_model_len=256)
    b = LLM(model_dir, attention_backend="torch", kv_cache_dtype="int8", max_model_len=256)
    prompts = prompts_for(a, [7, 40, 100, 2], seed=1)
    assert greedy(a, prompts) == greedy(b, prompts)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_cache_hits_on_int8_pages_give_the_cold_run_tokens(model_dir, backend):
    llm = LLM(model_dir, attention_backend=backend, kv_cache_dtype="int8", max_model_len=256)
    shared = prompts_for(llm, [64], seed=2)[0]
    prompts = [shared + tail for tail in prompts_for(llm, [5, 9, 1], seed=3)]
    cold = LLM(model_dir, attention_backend=backend, kv_cache_dtype="int8", max_model_len=256,
               enable_prefix_caching=False)
    want = greedy(cold, prompts)
    assert greedy(llm, prompts[:1]) == want[:1]
    before = llm.kv_stats().prefix_hit_tokens
    assert greedy(llm, prompts) == want  # the later prompts read the first one's int8 blocks
    assert llm.kv_stats().prefix_hit_tokens - before >= 3 * 64 - 16


@pytest.mark.parametrize("backend", BACKENDS)
def test_preemption_on_int8_pages_gives_the_same_tokens(model_dir, backend):
    """A pool too small for every sequence at once: sequences are preempted, recomputed into
    fresh int8 blocks, and end with the tokens of a run with room for all."""
    kw = dict(attention_backend=backend, kv_cache_dtype="int8", max_model_len=128)
    roomy = LLM(model_dir, **kw)
    tight = LLM(model_dir, num_kvcache_blocks=12, enable_prefix_caching=False, **kw)
    prompts = prompts_for(roomy, [30, 25, 40, 20], seed=4)
    want = greedy(roomy, prompts, max_tokens=40)
    assert greedy(tight, prompts, max_tokens=40) == want
    assert tight.kv_stats().num_preemptions > 0


def _tokens_and_logprobs(llm, prompts, max_tokens=40):
    """Greedy tokens and their summed logprobs (float bits: a difference anywhere in the
    step shows here long before it flips a token of a tiny model)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob)
            for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_int8_outputs_do_not_depend_on_prefix_hits_or_chunk_boundaries(checkpoint, backend):
    """The same requests cold (no prefix cache, whole prompts in one step), warm (their own
    prefixes cached, or a shared prefix another request cached: the rest runs alone or in a
    short chunk), and prefilled in chunks of 5 and 19 tokens with and without the prefix
    cache: the same tokens and the same logprobs to the bit."""
    if backend == "torch" and not kernels.available():
        pytest.skip("torch's own GEMMs round a row differently with the number of rows in the batch")
    model_dir = checkpoint("qwen3-tiny", num_hidden_layers=4)
    kw = dict(attention_backend=backend, kv_cache_dtype="int8", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    cold = LLM(model_dir, enable_prefix_caching=False, **kw)
    shared = prompts_for(cold, [48], seed=6)[0]  # three whole blocks
    prompts = [shared + tail for tail in prompts_for(cold, [1, 2, 3, 5, 20, 0], seed=7)]
    prompts += prompts_for(cold, [7, 33, 70], seed=8)
    want = _tokens_and_logprobs(cold, prompts)
    warm = LLM(model_dir, **kw)
    assert _tokens_and_logprobs(warm, prompts[5:6]) == want[5:6]  # caches the shared prefix only
    assert _tokens_and_logprobs(warm, prompts) == want  # hits on another request's blocks
    assert _tokens_and_logprobs(warm, prompts) == want  # hits on their own blocks
    assert warm.kv_stats().prefix_hit_tokens >= 2 * 6 * 48
    for budget in (5, 19):
        for caching in (False, True):
            chunked = LLM(model_dir, max_num_batched_tokens=budget, enable_prefix_caching=caching, **kw)
            assert _tokens_and_logprobs(chunked, prompts) == want, (budget, caching)
            if caching:
                assert _tokens_and_logprobs(chunked, prompts) == want, (budget, "warm")


@pytest.mark.triton
@pytest.mark.skipif(not INTERPRET, reason="the end-to-end interpreter run stands in for CUDA here")
def test_triton_int8_end_to_end_matches_torch_int8(model_dir):
    pytest.importorskip("triton")
    kw = dict(kv_cache_dtype="int8", max_model_len=128, num_kvcache_blocks=40)
    tri = LLM(model_dir, attention_backend="triton", **kw)
    ref = LLM(model_dir, attention_backend="torch", **kw)
    prompts = prompts_for(ref, [9, 20], seed=5)
    assert greedy(tri, prompts, max_tokens=6) == greedy(ref, prompts, max_tokens=6)


def test_scoring_prefill_reads_the_int8_pages(model_dir):
    """What bench.py --accuracy measures goes through the quantized cache: a prefill's
    queries read their own K/V back from the int8 pages (every backend stores first, then
    attends over the cache), so the logits differ from the float32 cache's."""
    from nanokv.testing.accuracy import scoring_engine, window_logits

    tokens = list(range(4, 104))
    ref = window_logits(scoring_engine(model_dir, max_model_len=256), tokens)
    q8 = window_logits(scoring_engine(model_dir, max_model_len=256, kv_cache_dtype="int8"), tokens)
    diff = (ref - q8).abs()
    assert diff.max() > 1e-4  # float32 runs of one engine differ by ~1e-6 at most
    assert diff.mean() < 0.02 * ref.std()  # ... and int8 is close: a slight error, not garbage


# ---- on the real weights ------------------------------------------------------------------

def _smollm2_missing() -> str | None:
    import importlib.util

    from nanokv import gguf as nk_gguf

    if importlib.util.find_spec("gguf") is None:
        return "gguf is not installed: pip install gguf"
    try:
        nk_gguf.resolve_model("smollm2")
    except ValueError as e:
        return str(e)
    return None


CHAT_QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "Write a haiku about the ocean.",
    "Explain what a prime number is in one sentence.", "What is 12 times 7?",
    "Give me one tip for sleeping better.", "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?", "Why is the sky blue?", "List two uses of copper.",
]


@pytest.mark.slow
@pytest.mark.skipif(_smollm2_missing() is not None, reason=f"SmolLM2: {_smollm2_missing()}")
def test_smollm2_int8_chat_answers_are_the_same_warm_cold_and_chunked(tmp_path, monkeypatch):
    """SmolLM2-135M on int8 pages, 10 chat prompts, 48 greedy tokens: asked again (every
    prompt's full blocks cached; the rest, a few tokens, runs alone) and prefilled 16 tokens
    a step, the same tokens and logprobs as the first, cold run (2 of 10 differed warm)."""
    from nanokv import gguf as nk_gguf

    monkeypatch.setattr(nk_gguf, "cache_dir", lambda: tmp_path)  # the derived config and tokenizer
    kw = dict(kv_cache_dtype="int8", kv_cache_memory_bytes=64 << 20, max_model_len=1024)
    conversations = [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=0)

    def answers(llm):
        return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob)
                for o in llm.chat(conversations, params, use_tqdm=False)]

    llm = LLM("smollm2", **kw)
    cold = answers(llm)
    hits = llm.kv_stats().prefix_hit_tokens
    assert answers(llm) == cold
    assert llm.kv_stats().prefix_hit_tokens - hits >= 10 * 16
    llm.close()
    chunked = LLM("smollm2", max_num_batched_tokens=16, enable_prefix_caching=False, **kw)
    assert answers(chunked) == cold
    chunked.close()
