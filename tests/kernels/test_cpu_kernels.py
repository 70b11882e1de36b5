"""The C kernels (nanokv/kernels/csrc/) against the torch expressions they replace."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from nanokv import kernels
from nanokv.attention.base import AttentionMetadata
from nanokv.attention.cpu_backend import CpuBackend
from nanokv.attention.torch_ref import TorchRefBackend

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: CPU kernels not built")


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.fixture(params=kernels.build.WIDTHS, ids=lambda w: f"width{w}")
def width(request, monkeypatch):
    """Both vector widths, whatever the CPU (a 16-wide build runs as pairs of 8-wide
    instructions without AVX-512): the ops call the library NANOKV_CPU_WIDTH names."""
    monkeypatch.setenv("NANOKV_CPU_WIDTH", str(request.param))
    assert kernels.ffi.lib().nk_width() == request.param
    return request.param


def _int8_reference(x, packed, bias=None):
    """The int8 GEMM's arithmetic in torch: each row quantized in blocks of 32 (scale = max |x|
    / 127, q = round(x * (127 / max |x|))), exact integer block sums, then sum over blocks of
    block scale * sum, times the column scale (float64: the C kernel's float32 rounding is
    within the tolerance)."""
    q, scale = packed.int8()
    m, k = x.shape
    kp = -(-k // 32) * 32
    xp = torch.zeros(m, kp)
    xp[:, :k] = x
    blocks = xp.view(m, kp // 32, 32)
    amax = blocks.abs().amax(-1)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    qx = torch.round(blocks * inv[..., None]).clamp(-127, 127).double()  # [m, blocks, 32]
    qw = torch.zeros(q.shape[0], kp, dtype=torch.float64)
    qw[:, :k] = q.double()
    sums = torch.einsum("mbi,nbi->mbn", qx, qw.view(-1, kp // 32, 32))  # exact integers
    out = (sums * (amax / 127).double()[..., None]).sum(1) * scale.double()
    return (out if bias is None else out + bias.double()).float()


def _reference(x, packed, bias=None):
    if packed.format == "int8":
        return _int8_reference(x, packed, bias)
    w = packed.unpack()  # the float32 weights, or the bfloat16-rounded ones
    return x @ w.t() if bias is None else torch.addmm(bias, x, w.t())


FORMATS = list(kernels.FORMATS)


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("k,n", [(384, 1024), (40, 1000), (1152, 384), (24, 17), (100, 33)])
def test_linear_matches_torch(width, format, k, n):
    """Every row count of decode steps (1-64) and two prefill sizes, odd shapes, with and
    without bias, against torch on the weights the kernel holds (bfloat16-rounded,
    int8-dequantized with the activations quantized the kernel's way)."""
    g = torch.Generator().manual_seed(k * 1000 + n)
    x, w, b = torch.randn(400, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    packed = kernels.pack_weight(w, format)
    assert packed.data.shape[0] == -(-n // kernels.NR) and packed.n == n
    assert packed.nbytes == packed.data.shape[0] * kernels.ffi.lib().nk_panel_bytes(packed.code, k)
    for m in list(range(1, 65)) + [193, 400]:
        xm = x[:m].contiguous()
        torch.testing.assert_close(kernels.linear(xm, packed), _reference(xm, packed), rtol=1e-5, atol=1e-4)
        if m in (1, 7, 64, 400):
            torch.testing.assert_close(kernels.linear(xm, packed, b), _reference(xm, packed, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("format", FORMATS)
def test_weight_formats_stay_close_to_float32(format):
    """Round-trip bounds: bfloat16 rounds each weight to 8 significant bits (relative error at
    most 2^-8); int8 to within half a step of its row's scale; products stay close."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 200, generator=g) * torch.rand(300, 1, generator=g) * 4
    w[7] = 0  # an all-zero row: scale 0, no NaN
    back = kernels.pack_weight(w, format).unpack()
    if format == "float32":
        assert torch.equal(back, w)
    elif format == "bfloat16":
        assert ((back - w).abs() <= w.abs() * 2 ** -8).all()
        assert torch.equal(back, w.to(torch.bfloat16).float())
    else:
        q, scale = kernels.pack_weight(w, format).int8()
        assert torch.equal(scale, w.abs().amax(1) / 127) and scale[7] == 0 and (q[7] == 0).all()
        assert (q.abs() <= 127).all() and (q.abs().amax(1)[scale > 0] == 127).all()
        assert ((back - w).abs() <= scale[:, None] / 2 * (1 + 1e-5)).all()
    x = torch.randn(16, 200, generator=g)
    exact = x @ w.t()
    err = (kernels.linear(x, kernels.pack_weight(w, format)) - exact).norm() / exact.norm()
    assert err < {"float32": 1e-6, "bfloat16": 4e-3, "int8": 2e-2, "int8w": 1e-2}[format], float(err)


@pytest.mark.parametrize("format", FORMATS)
def test_embedding_rows_from_the_packed_matrix(width, format):
    """A tied embedding reads its rows from the LM head's panels: exactly the rows the GEMM
    multiplies by (bfloat16-rounded, int8 dequantized), any id, odd widths."""
    g = torch.Generator().manual_seed(9)
    for n, k in ((1000, 64), (37, 40), (16, 200)):
        packed = kernels.pack_weight(torch.randn(n, k, generator=g), format)
        ids = torch.cat([torch.tensor([0, n - 1, 15, 16 % n]), torch.randint(0, n, (300,), generator=g)])
        assert torch.equal(kernels.embed(ids, packed), packed.unpack()[ids])


@pytest.mark.parametrize("format", FORMATS)
def test_linear_rows_do_not_depend_on_the_batch(width, format):
    """A row's result is bit-identical alone or in any batch (fixed summation order)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 200, generator=g), torch.randn(300, 200, generator=g)
    packed = kernels.pack_weight(w, format)
    full = kernels.linear(x, packed)
    for i in (0, 5, 36):
        assert torch.equal(kernels.linear(x[i:i + 1].contiguous(), packed)[0], full[i])
    assert torch.equal(kernels.linear(x[10:23].contiguous(), packed), full[10:23])


@pytest.mark.parametrize("format", FORMATS)
def test_gemms_are_bit_identical_across_widths_and_instruction_sets(format, monkeypatch):
    """Output columns sit in vector lanes and K is summed in order, so the width changes no
    GEMM result; int8 block sums are exact integers, so its plain-C path (what a machine
    without AVX2 or VNNI runs) gives the intrinsics' results bit for bit, and so does the
    VNNI paths' arithmetic (weights taken as w + 128, 128 * the activation block sums taken off)."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(70, 136, generator=g), torch.randn(75, 136, generator=g)
    packed, gate_up = kernels.pack_weight(w, format), kernels.pack_gate_up(w[:40], w[35:], format)
    results = []
    libs = [kernels.ffi.load(8), kernels.ffi.load(16), kernels.ffi.load(None, portable=True),
            kernels.ffi.load(None, portable="offset")]
    assert libs[3].nk_int8_isa() == b"generic-offset"
    for lib in libs:
        monkeypatch.setattr(kernels.ops, "lib", lambda lib=lib: lib)
        results.append((kernels.linear(x, packed), kernels.linear_silu_mul(x, gate_up)))
    for plain, glu in results[1:]:
        assert torch.equal(plain, results[0][0]) and torch.equal(glu, results[0][1])


def _meta(q_lens, ctx_lens, block_size, num_blocks, gen):
    """A mixed step (decodes first) over random, distinct pages."""
    widths = [-(-c // block_size) for c in ctx_lens]
    pages = torch.randperm(num_blocks, generator=gen)[:sum(widths)].tolist()
    tables, at = [], 0
    for w in widths:
        tables.append(pages[at:at + w] + [0] * (max(widths) - w))
        at += w
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    slots = []
    for table, n, c in zip(tables, q_lens, ctx_lens):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c - n, c)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(cu, dtype=torch.int32),
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32), block_tables=torch.tensor(tables, dtype=torch.int32),
        num_decodes=sum(1 for n in q_lens if n == 1), max_query_len=max(q_lens), max_seq_len=max(ctx_lens),
        query_lens_cpu=list(q_lens), seq_lens_cpu=list(ctx_lens))


@pytest.mark.parametrize("hq,hkv,d", [(8, 4, 64), (4, 1, 32), (6, 6, 16), (16, 2, 128), (2, 2, 8), (8, 1, 24), (3, 1, 40), (4, 2, 256), (2, 1, 512)])
@pytest.mark.parametrize("block_size", [16, 5, 1])
def test_paged_attention_matches_torch_reference(width, hq, hkv, d, block_size):
    """Decodes, whole prompts and chunks after a cached prefix in one step, against the
    pure-torch backend (gather + SDPA) on the same paged cache."""
    gen = torch.Generator().manual_seed(hq * 100 + d + block_size)
    q_lens = [1, 1, 1, 1, 7, 33, 1 + 4, 20]  # decodes first, then prefill chunks
    ctx_lens = [1, 9, 40, 77, 7, 33, 60, 20 + 17]  # a chunk of 5 after 55 cached tokens, ...
    num_blocks = sum(-(-c // block_size) for c in ctx_lens) + 7
    meta = _meta(q_lens, ctx_lens, block_size, num_blocks, gen)
    t = sum(q_lens)
    q, k, v = (torch.randn(t, h, d, generator=gen) for h in (hq, hkv, hkv))
    caches = [torch.randn(num_blocks, block_size, hkv, d, generator=gen) for _ in range(2)]
    outs = []
    for backend in (TorchRefBackend(), CpuBackend()):
        kc, vc = (c.clone() for c in caches)
        meta.backend_state = None
        backend.prepare(meta, block_size)
        outs.append((backend.forward(q, k, v, kc, vc, meta, d ** -0.5), kc, vc))
    (ref, kr, vr), (got, kg, vg) = outs
    assert torch.equal(kr, kg) and torch.equal(vr, vg)  # new K/V written to the same slots
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-6)


def test_paged_attention_few_queries_split_heads(width):
    """One long decode (heads split across threads) equals plain softmax attention."""
    gen = torch.Generator().manual_seed(1)
    bs, L, hq, hkv, d = 16, 1000, 8, 2, 64
    kc, vc = (torch.randn(80, bs, hkv, d, generator=gen) for _ in range(2))
    table = torch.randperm(80, generator=gen)[:-(-L // bs)].to(torch.int32)[None]
    q = torch.randn(1, hq, d, generator=gen)
    out = torch.empty_like(q)
    kernels.paged_attention(q, kc, vc, table, torch.zeros(1, dtype=torch.int32),
                            torch.tensor([L], dtype=torch.int32), L, d ** -0.5, out)
    keys = kc[table[0].long()].reshape(-1, hkv, d)[:L].repeat_interleave(hq // hkv, 1)  # [L, Hq, D]
    vals = vc[table[0].long()].reshape(-1, hkv, d)[:L].repeat_interleave(hq // hkv, 1)
    p = torch.softmax(torch.einsum("hd,lhd->hl", q[0], keys) * d ** -0.5, -1)
    torch.testing.assert_close(out[0], torch.einsum("hl,lhd->hd", p, vals), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("m,h", [(1, 384), (37, 384), (5000, 100), (3, 13), (2, 24)])
def test_rmsnorm_and_fused_residual(width, m, h):
    gen = torch.Generator().manual_seed(m + h)
    x, r, w = torch.randn(m, h, generator=gen), torch.randn(m, h, generator=gen), torch.randn(h, generator=gen)
    torch.testing.assert_close(kernels.rmsnorm(x, w, 1e-6), _rms(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    residual = r.clone()
    out = kernels.rmsnorm(x, w, 1e-6, residual)
    assert torch.equal(residual, x + r)  # the same additions as HF's residual + x
    torch.testing.assert_close(out, _rms(x + r, w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_norm", [True, False])
def test_qk_norm_rope(width, with_norm):
    gen = torch.Generator().manual_seed(2)
    t, hq, hkv, d = 29, 8, 2, 64
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen)
    qw, kw = (torch.randn(d, generator=gen) for _ in range(2))
    cos, sin = torch.randn(t, d, generator=gen), torch.randn(t, d, generator=gen)
    q, k = kernels.qk_norm_rope(qkv, hq, hkv, d, qw if with_norm else None, kw if with_norm else None,
                                1e-6, cos, sin)
    qr, kr = qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    if with_norm:
        qr, kr = _rms(qr, qw, 1e-6), _rms(kr, kw, 1e-6)

    def rope(x):
        x1, x2 = x.chunk(2, -1)
        return x * cos[:, None] + torch.cat((-x2, x1), -1) * sin[:, None]

    if with_norm:
        torch.testing.assert_close(q, rope(qr), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k, rope(kr), rtol=1e-5, atol=1e-5)
    else:  # rotary alone rounds exactly like the torch expression
        assert torch.equal(q, rope(qr)) and torch.equal(k, rope(kr))


@pytest.mark.parametrize("m,k,i", [(3, 384, 1152), (300, 64, 64), (7, 40, 13), (1, 8, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("format", FORMATS)
def test_gate_up_gemm_with_silu_epilogue(width, format, m, k, i, with_bias):
    gen = torch.Generator().manual_seed(m * 7 + i)
    x = torch.randn(m, k, generator=gen) / k ** 0.5
    x[0] *= 300  # gates far past exp's clamps, both signs
    gate, up = torch.randn(i, k, generator=gen), torch.randn(i, k, generator=gen)
    bg, bu = torch.randn(i, generator=gen), torch.randn(i, generator=gen)
    packed = kernels.pack_gate_up(gate, up, format)
    both = _reference(x, kernels.PackedWeight(packed.data, -(-i // 8) * 16, k, format))  # gate|up interleaved
    g = both.view(m, -1, 2, 8)[:, :, 0].reshape(m, -1)[:, :i]
    u = both.view(m, -1, 2, 8)[:, :, 1].reshape(m, -1)[:, :i]
    if with_bias:
        g, u = g + bg, u + bu
    ref = F.silu(g) * u
    bias = kernels.interleave_gate_up(bg[:, None], bu[:, None]).flatten() if with_bias else None
    got = kernels.linear_silu_mul(x, packed, bias)
    torch.testing.assert_close(got[1:], ref[1:], rtol=1e-5, atol=1e-5)
    # row 0 sums terms in the hundreds: compare relative to its scale
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-5 * float(ref[0].abs().max()) + 1e-30)
    assert (got[0][g[0] < -100].abs() < 1e-30).all() and (g[0] < -100).any()
    assert torch.isfinite(got).all()


@pytest.mark.slow
def test_without_a_compiler_everything_falls_back_to_torch(tmp_path):
    """No compiler on PATH: available() is False, auto picks the torch backend, and the
    model runs (and still matches) on the torch path."""
    code = (
        "import torch\n"
        "from nanokv import kernels\n"
        "from nanokv.attention import resolve_backend\n"
        "assert not kernels.available()\n"
        "print(resolve_backend('auto', torch.device('cpu'), 16))\n"
    )
    env = dict(os.environ, CC="/nonexistent/cc", NANOKV_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "torch"
    assert "CPU kernels unavailable" in out.stderr


@pytest.mark.slow
def test_disabled_by_environment(tmp_path):
    code = "from nanokv import kernels\nprint(kernels.available())\n"
    env = dict(os.environ, NANOKV_CPU_KERNELS="0", NANOKV_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
    assert not any(tmp_path.rglob("*.so"))


@pytest.mark.slow
def test_built_once_into_the_cache(tmp_path):
    code = "from nanokv import kernels\nprint(kernels.available())\n"
    env = dict(os.environ, NANOKV_CACHE_DIR=str(tmp_path))
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == "True", out.stderr
    assert len(list(tmp_path.rglob("*.so"))) == 1


def test_fused_layers_equal_the_layer_by_layer_kernels(model_dir):
    """One C call per decoder layer runs the same kernels as the modules, in the same
    order: identical tokens and logprobs, bit for bit."""
    from nanokv import LLM, SamplingParams

    prompts = [[(7 * i + j) % 1000 + 1 for j in range(n)] for i, n in enumerate([1, 9, 40, 77, 130])]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3)
    results = []
    for fused in (True, False):
        llm = LLM(model_dir, max_model_len=256, kvcache_block_size=8, max_num_batched_tokens=64)
        decoder = llm.llm_engine.runner.model.model
        if not fused:
            decoder.forward = decoder.forward_native  # layer by layer, on the same kernels
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert (decoder.forward == decoder.forward_cpu) == fused
        results.append([(o.outputs[0].token_ids, [{k: v.logprob for k, v in lp.items()} for lp in o.outputs[0].logprobs])
                        for o in outs])
    assert results[0] == results[1]


def test_fused_layers_follow_a_new_kv_cache_and_keep_no_old_one(model_dir):
    """The fused layers' descriptions point at the runner's KV cache: a pool set anew is
    followed (same tokens from a fresh pool), and a released one is not kept alive."""
    import gc
    import weakref

    from nanokv import LLM, SamplingParams
    from nanokv.runner.kv_cache import allocate_kv_cache

    llm = LLM(model_dir, max_model_len=256, kvcache_block_size=8, enable_prefix_caching=False)
    runner = llm.llm_engine.runner
    fused = runner.model.model.fused_layers
    prompts = [[(5 * i + j) % 900 + 1 for j in range(n)] for i, n in enumerate([3, 30])]
    params = SamplingParams(temperature=0, max_tokens=8)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    old = weakref.ref(runner.kv_cache)
    runner._set_kv_cache(*allocate_kv_cache(runner.config, runner.num_blocks + 1, *runner.kv_shape, log=False))
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert again == first
    for desc, layer in zip(fused.layers, runner.attn_layers):
        assert (desc.k_cache, desc.v_cache) == (layer.k_cache.data_ptr(), layer.v_cache.data_ptr())
    gc.collect()
    assert old() is None  # the first pool is gone: nothing held it
    runner.release_kv_cache()
    gc.collect()
    assert fused.cache_seen() is None


@pytest.mark.parametrize("fused", [True, False])
def test_last_layer_runs_only_the_rows_that_sample(model_dir, fused):
    """A prefill chunk needs the last layer's output only for its sampling token: with keep,
    the model returns exactly those rows of the full forward, in keep's order, bit for bit."""
    from nanokv import LLM, SamplingParams
    from nanokv.engine.types import ScheduledBatch, ScheduledSeq

    llm = LLM(model_dir, max_model_len=256, kvcache_block_size=8)
    runner = llm.llm_engine.runner
    decoder = runner.model.model
    if not fused:
        decoder.forward = decoder.forward_native  # layer by layer, on the same kernels
    params = SamplingParams(temperature=0)
    lens, tables = [37, 5, 20], [[0, 1, 2, 3, 4], [5], [6, 7, 8]]
    seqs = [ScheduledSeq(i, [(11 * i + j) % 500 + 1 for j in range(n)], 0, table, i != 1, params)
            for i, (n, table) in enumerate(zip(lens, tables))]
    input_ids, positions, meta, rows = runner.prepare(ScheduledBatch(seqs, sum(lens)))
    assert rows.tolist() != sorted(rows.tolist())  # the runner orders chunks shortest first
    with torch.inference_mode():
        runner.backend.prepare(meta, runner.block_size)
        full = runner.model(input_ids, positions, meta)
        kept = runner.model(input_ids, positions, meta, rows)
        none = runner.model(input_ids, positions, meta, torch.empty(0, dtype=torch.long))
    assert (decoder.forward == decoder.forward_cpu) == fused
    assert full.shape == (sum(lens), decoder.norm.weight.shape[0])
    assert torch.equal(kept, full[rows])
    assert none.shape == (0, full.shape[1])


def test_kernels_run_on_torchs_thread_count():
    """The kernels' thread pool is not torch's: each call gives it torch's thread count,
    so torch.set_num_threads (bench.py's one-thread runs, one_thread()) holds for them too."""
    if not kernels.available():
        pytest.skip("no C compiler: CPU kernels not built")
    before = torch.get_num_threads()
    try:
        for n in (1, 3, 1):
            torch.set_num_threads(n)
            assert kernels.ffi.lib().nk_threads() == n
    finally:
        torch.set_num_threads(before)
        kernels.ffi.lib()
