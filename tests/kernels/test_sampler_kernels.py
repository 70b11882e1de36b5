"""The sampler's C kernels (csrc/sampler.c's nk_top_candidates, nk_sample_rows) against a full sort
and against the sampler's torch path, at both vector widths."""

from __future__ import annotations

import math

import pytest
import torch

from nanokv import kernels
from nanokv.layers import sampler as sampler_module
from nanokv.layers.sampler import Sampler, SamplingTensors, seed_for_token

from .test_cpu_kernels import width  # noqa: F401  (the fixture: both vector widths)

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: CPU kernels not built")


def full_sort(x, k):
    """The k largest of each row, largest first, ties lower id first (a stable sort)."""
    vals, ids = x.sort(dim=1, descending=True, stable=True)
    return vals[:, :k], ids[:, :k]


@pytest.mark.parametrize("vocab", [300, 5000, 49152])
def test_top_candidates_are_a_full_sorts(width, vocab):  # noqa: F811
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g)
    x[1] = torch.randint(-5, 3, (vocab,), generator=g).float()  # ties everywhere, and at the cut
    x[2, ::3] = float("-inf")
    x[3, -7:] += 10  # the leaders in the ragged end
    rows = torch.tensor([4, 1, 1, 5])
    for k in (1, 7, 64, 300):
        if k > vocab // 2:
            continue
        block = 2 ** round(math.log2(max(1.0, math.sqrt(vocab / k))))
        use_blocks = block >= 8 and vocab // block >= 4 * k
        for b in ({0, block} if use_blocks else {0}):
            vals, ids = kernels.ops.top_candidates(x, k, None, b)
            ref_vals, ref_ids = full_sort(x, k)
            assert torch.equal(ids, ref_ids) and torch.equal(vals, ref_vals), (k, b)
            vals, ids = kernels.ops.top_candidates(x, k, rows, b)
            assert torch.equal(ids, ref_ids[rows]) and torch.equal(vals, ref_vals[rows])


@pytest.mark.parametrize("block", [0, 16])
def test_row_weight_is_the_sum_of_exp2(width, block):  # noqa: F811
    """z: the weight of the row, 2 ** ((logit - max) * scale) summed, to float32 rounding;
    -inf logits weigh 0, weights below 2 ** -126 count as the subnormals they are. block 16:
    the one-read pass (block maxima and block-relative sums), block 0: the plain one."""
    g = torch.Generator().manual_seed(2)
    vocab, n = 3001, 5
    x = torch.randn(n, vocab, generator=g) * 3
    x[1, ::2] = float("-inf")
    x[2] = torch.linspace(0, -160, vocab)  # down through the subnormals, and past them
    x[3, 0] = 50.0
    m = x.amax(dim=1)
    scale = torch.tensor([1.0, 1.7, 1.0, 0.9, 3.0])
    ref = torch.exp2((x.double() - m[:, None].double()) * scale[:, None].double()).sum(dim=1)
    z = _z(x, scale, block)
    torch.testing.assert_close(z.double(), ref, rtol=2e-6, atol=0)
    exact = torch.randint(-11, 1, (n, vocab), generator=g).float()  # weights 2 ** -k: exact sums
    assert torch.equal(_z(exact, torch.ones(n), block).double(),
                       torch.exp2(exact.double() - exact.amax(1, keepdim=True).double()).sum(1))


def _z(x, scale, block=0):
    n = len(x)
    _, z = kernels.ops.sample_rows(x, None, 4, block, scale, torch.zeros(n), torch.zeros(n, dtype=torch.long), None, None)
    return z


def stable_top_candidates(logits, k, rows=None, cpu_kernels=False, masks=None):
    """sampler.top_candidates with the torch path's ties broken as the kernel's (lower id first)."""
    if cpu_kernels:
        return kernels.ops.top_candidates(logits, k, rows, 0, masks)
    return full_sort(logits if rows is None else logits[rows], k)


@pytest.mark.parametrize("settings", [dict(), dict(top_p=0.9), dict(top_p=0.5), dict(min_p=0.02),
                                      dict(top_p=0.8, min_p=0.01), dict(top_k=20, top_p=0.9)])
def test_c_draw_equals_the_torch_draw_for_the_same_uniforms(width, monkeypatch, settings):  # noqa: F811
    """Logits whose weights are powers of two (integer logits, log2(e) / T = 1), so that every
    sum is exact in any order: the C path draws exactly the torch path's tokens, past the
    candidates, through rejections and redraws; seeded rows alone or in any batch."""
    monkeypatch.setattr(sampler_module, "top_candidates", stable_top_candidates)
    g = torch.Generator().manual_seed(5)
    n, vocab = 400, 3000
    logits = torch.randint(-11, 1, (n, vocab), generator=g).float()
    logits[::7, :40] = float("-inf")  # banned
    temperature = torch.tensor(math.log2(math.e), dtype=torch.float32)
    assert (math.log2(math.e) / temperature).item() == 1.0
    vocab_t = torch.full((n,), settings.get("top_k", vocab), dtype=torch.long)

    def draw(rows, cpu_kernels):
        m = len(rows)
        t = SamplingTensors(temperature.repeat(m), all_greedy=False,
                            top_k=vocab_t[:m] if "top_k" in settings else None,
                            top_p=torch.full((m,), settings["top_p"]) if "top_p" in settings else None,
                            min_p=torch.full((m,), settings["min_p"]) if "min_p" in settings else None,
                            seeded=[(i, seed_for_token(int(r), 3)) for i, r in enumerate(rows)])
        return Sampler(cpu_kernels)(logits[rows].clone(), t).tokens

    everything = torch.arange(n)
    ref = draw(everything, False)
    got = draw(everything, True)
    assert torch.equal(got, ref)
    assert len(set(ref.tolist())) > 200  # drawn far past the candidates
    assert not (ref[::7] < 40).any()
    picked = torch.tensor([17, 3, 250, 99])
    assert torch.equal(draw(picked, True), ref[picked])
    assert [draw(picked[i:i + 1], True).item() for i in range(4)] == ref[picked].tolist()


def test_logprobs_are_logsumexp_rank_and_top(width):  # noqa: F811
    g = torch.Generator().manual_seed(9)
    x = torch.randn(7, 4099, generator=g) * 4
    x[2, 5:] = float("-inf")
    x[3] = torch.randint(-3, 3, (4099,), generator=g).float()  # ties with the picked logit
    rows = torch.tensor([6, 2, 3, 3, 0])
    picked = x[rows, torch.tensor([0, 1, 7, 100, 4098])]
    for k, block in [(0, 0), (5, 0), (5, 16), (3, 32)]:
        lse, above, vals, ids = kernels.ops.logprobs(x, rows, picked, k, block)
        torch.testing.assert_close(lse, torch.logsumexp(x[rows].double(), dim=1).float(), rtol=1e-6, atol=1e-6)
        assert above.tolist() == (x[rows] > picked[:, None]).sum(dim=1).tolist()
        ref_vals, ref_ids = full_sort(x[rows], k)
        assert torch.equal(ids, ref_ids) and torch.equal(vals, ref_vals)


def test_c_draw_is_independent_of_the_thread_count(width):  # noqa: F811
    """Rows go to threads dynamically, each row drawn whole by one: any thread count, the
    same tokens (flat rows: most draws past the candidates, some rejected)."""
    g = torch.Generator().manual_seed(12)
    n, vocab = 64, 20000
    logits = torch.randn(n, vocab, generator=g)
    t = SamplingTensors(torch.full((n,), 0.9), all_greedy=False, top_p=torch.full((n,), 0.9),
                        seeded=[(i, seed_for_token(i, 0)) for i in range(n)])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = Sampler(True)(logits.clone(), t).tokens
        torch.set_num_threads(2)
        two = Sampler(True)(logits.clone(), t).tokens
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_c_draw_computes_a_seeded_rows_first_uniform_itself(width):  # noqa: F811
    """u None (every row seeded) or NaN for a row: the C draw takes seeded_uniform(key, 0),
    bit for bit, so the tokens equal those drawn from the uniforms computed in Python."""
    g = torch.Generator().manual_seed(21)
    n, vocab = 48, 5000
    logits = torch.randn(n, vocab, generator=g) * torch.linspace(0.5, 6, n)[:, None]  # flat to peaked rows
    keys = torch.randint(0, 1 << 62, (n,), generator=g)
    u = torch.tensor([sampler_module.seeded_uniform(int(k), 0) for k in keys])
    scale, top_p = torch.full((n,), math.log2(math.e) / 0.8), torch.full((n,), 0.9)
    block = sampler_module._block(vocab, 64)

    def draw(first):
        return kernels.ops.sample_rows(logits, None, 64, block, scale, first, keys, top_p, None)[0]

    ref = draw(u)
    assert len(set(ref.tolist())) > n // 2
    assert torch.equal(draw(None), ref)
    mixed = u.clone()
    mixed[::3] = float("nan")
    assert torch.equal(draw(mixed), ref)
    other = u.clone()
    other[1::3] = 1 - other[1::3]  # the rows given their own uniform take it
    assert not torch.equal(draw(other), ref)


@pytest.mark.parametrize("vocab", [1, 31, 300, 1024, 49152])
def test_argmax_rows_is_torchs_argmax(width, vocab):  # noqa: F811
    """Greedy ids in C: torch.argmax's, the first of equal maxima, the first NaN, -0 beside
    +0, rows of -inf; many rows (the threaded path) and few."""
    g = torch.Generator().manual_seed(vocab)
    for n in (7, (1 << 20) // vocab + 1):
        x = torch.randn(n, vocab, generator=g)
        x[1] = torch.randint(-3, 2, (vocab,), generator=g).float()  # ties at the maximum
        x[2] = float("-inf")
        x[3, vocab // 2:] = float("nan")
        x[4] = 0.0
        x[4, ::2] = -0.0
        x[5, -1] = 100.0  # in the ragged end
        if vocab > 3:
            x[6, 3] = float("nan")
            x[6, 1] = float("inf")
        assert torch.equal(kernels.ops.argmax_rows(x), x.argmax(dim=1)), n


def random_bitmask(n, vocab, g, density):
    """[n, (vocab + 31) // 32] int32 words with each token's bit set with probability density."""
    allowed = torch.rand(n, (vocab + 31) // 32 * 32, generator=g) < density
    weights = torch.tensor([1 << b for b in range(31)] + [-(1 << 31)], dtype=torch.int64)
    words = (allowed.view(n, -1, 32).long() * weights).sum(dim=2)  # each word's bits, as an int64
    return words.to(torch.int32)


@pytest.fixture(params=[8, 16, "portable"])
def isa(request, monkeypatch):
    """Every build the sampler kernels run as: 8 and 16 floats wide (AVX2, AVX-512, or pairs
    of 8-wide instructions), and the plain-C one (NK_PORTABLE: no intrinsics)."""
    if request.param == "portable":
        library = kernels.ffi.load(None, portable=True)
        monkeypatch.setattr(kernels.ops, "lib", lambda: library)
    else:
        monkeypatch.setenv("NANOKV_CPU_WIDTH", str(request.param))
        assert kernels.ffi.lib().nk_width() == request.param
    return request.param


def _masked_case(vocab, g, n=9):
    """Logits [n, vocab] and masks on rows 0, 2, 3, 5, 6, 8: random words of several
    densities, all-banned-but-one rows, a row with every token allowed, and, behind banned
    bits, +inf and NaN logits that the mask must hide."""
    x = torch.randn(n, vocab, generator=g) * 3
    rows = torch.tensor([0, 2, 3, 5, 6, 8])
    mask = random_bitmask(len(rows), vocab, g, 0.05)
    mask[1] = random_bitmask(1, vocab, g, 0.6)[0]
    for i, keep in ((2, vocab - 1), (3, 0), (5, vocab // 2)):  # one token allowed
        mask[i] = 0
        mask[i, keep // 32] = torch.tensor(1 << (keep % 32), dtype=torch.int64).to(torch.int32)
    mask[4] = -1  # every token allowed
    mask[0, 1:3] = 0  # whole words banned
    for i, r in enumerate(rows.tolist()):
        allowed = sampler_module.unpack_mask(mask[i:i + 1], vocab)[0]
        banned = (~allowed).nonzero().squeeze(1)
        if len(banned) > 2:
            x[r, banned[0]] = float("inf")
            x[r, banned[-1]] = float("nan")
    ref = x.clone()
    sampler_module.apply_token_mask(ref, rows, mask)  # the tensor-ops path: the reference
    return x, ref, kernels.ops.RowMasks.build(n, rows, mask), rows, mask


def _same(a, b):
    """Equal bit for bit, NaN where the other has NaN (a row with every token banned weighs NaN)."""
    return a.dtype == b.dtype and a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("vocab", [31, 1000, 1029, 49152])
def test_fused_mask_kernels_read_what_masking_first_gives(isa, vocab):
    """Every sampler kernel reading the rows through a token mask (a bit test where it reads
    the row) gives, bit for bit, what it gives on the logits the torch path's masked_fill
    leaves: argmax, top candidates (with and without blocks), the draw with top_k off
    (fused and unfused read, top-p, min-p, seeded and the generator's uniforms) and logprobs;
    on all rows and on rows picked out. The logits themselves are not written."""
    ops = kernels.ops
    g = torch.Generator().manual_seed(vocab)
    x, ref, masks, _, _ = _masked_case(vocab, g)
    before = x.clone()
    n = len(x)
    picked_rows = torch.tensor([8, 1, 3, 0])
    for rows in (None, picked_rows):
        m = n if rows is None else len(rows)
        assert torch.equal(ops.argmax_rows(x, rows, masks), ops.argmax_rows(ref, rows))
        assert torch.equal(ops.argmax_rows(x, rows, masks), (ref if rows is None else ref[rows]).argmax(dim=1))
        for k, block in ((1, 0), (5, 0), (min(20, vocab), 0), (5, 8), (3, 32)):
            if block and vocab // block < 4 * k:
                continue
            got = ops.top_candidates(x, k, rows, block, masks)
            want = ops.top_candidates(ref, k, rows, block)
            assert all(map(_same, got, want)), (k, block)
        c = min(64, vocab)
        for block in {sampler_module._block(vocab, c), 0}:
            for top_p, min_p in ((None, None), (0.9, None), (None, 0.05), (0.5, 0.01)):
                args = [c, block, torch.full((m,), 1.3), torch.rand(m, generator=g),
                        torch.randint(0, 1 << 62, (m,), generator=g),
                        None if top_p is None else torch.full((m,), top_p),
                        None if min_p is None else torch.full((m,), min_p)]
                args[3][::2] = float("nan")  # seeded rows: their own first uniform
                got = ops.sample_rows(x, rows, *args, masks)
                want = ops.sample_rows(ref, rows, *args)
                assert all(map(_same, got, want)), (block, top_p, min_p)
        tokens = ops.argmax_rows(ref, rows)
        picked = (ref if rows is None else ref[rows]).gather(1, tokens[:, None]).squeeze(1)
        for k, block in ((0, 0), (4, 0), (4, 16)):
            if block and vocab // block < 4 * k:
                continue
            got = ops.logprobs(x, rows, picked, k, block, masks)
            want = ops.logprobs(ref, rows, picked, k, block)
            assert all(map(_same, got, want)), (k, block)
    assert _same(x, before)


@pytest.mark.parametrize("vocab", [1029, 49152])
def test_fused_mask_sampler_equals_the_torch_reference(isa, vocab, monkeypatch):
    """The whole sampler, C path (mask read where the rows are read) against the torch path
    (mask written first), on one batch mixing greedy rows, seeded sampled rows with top_k
    off and on, top-p and min-p, logit_bias and logprobs, with all-banned-but-one rows:
    logits whose weights are powers of two (integer logits, log2(e) / T = 1), so that every
    sum is exact in any order and the two paths draw the same tokens. Every token is
    allowed by its row's mask; a row allowing one token draws it with logprob 0."""
    monkeypatch.setattr(sampler_module, "top_candidates", stable_top_candidates)
    g = torch.Generator().manual_seed(3)
    x, _, _, rows, mask = _masked_case(vocab, g)
    x = x.clamp(-8, 8).round().nan_to_num(0.0, 8.0)  # integer logits (finite: the torch path's sums)
    n = len(x)
    temperature = math.log2(math.e)
    temps = torch.tensor([temperature, 0.0, temperature, temperature, 0.0, temperature, temperature,
                          temperature, temperature])
    top_k = torch.tensor([vocab, vocab, 5, vocab, vocab, vocab, 40, vocab, vocab])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.9, 1.0, 1.0, 0.8, 0.7, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.02, 0.0, 0.0, 0.0])
    out = {}
    for c in (False, True):
        t = SamplingTensors(temps.clone(), all_greedy=False, top_k=top_k, top_p=top_p, min_p=min_p,
                            mask_rows=rows, mask=mask, bias_rows=torch.tensor([0, 3]),
                            bias_ids=torch.tensor([7 % vocab, 9 % vocab]), bias_values=torch.tensor([2.0, -3.0]),
                            seeded=[(i, seed_for_token(21, i)) for i in range(n) if temps[i] > 0],
                            max_logprobs=3)
        out[c] = Sampler(cpu_kernels=c)(x.clone(), t)
    ref, got = out[False], out[True]
    assert torch.equal(got.tokens, ref.tokens)
    assert torch.equal(got.ranks, ref.ranks) and torch.equal(got.top_ids, ref.top_ids)
    torch.testing.assert_close(got.logprobs, ref.logprobs)
    torch.testing.assert_close(got.top_logprobs, ref.top_logprobs)
    for i, r in enumerate(rows.tolist()):
        tok = int(got.tokens[r])
        assert int(mask[i, tok // 32]) >> (tok % 32) & 1, r
        if sampler_module.unpack_mask(mask[i:i + 1], vocab).sum() == 1:
            assert got.logprobs[r].item() == 0.0 and got.ranks[r].item() == 1


@pytest.mark.parametrize("temperature", [0.0, 0.8, 5.0])
def test_masked_sampler_draws_only_allowed_tokens_on_both_paths(width, temperature):  # noqa: F811
    """The sampler with a token mask and a logit bias: the C and torch paths give the same
    tokens (seeded rows, greedy rows), every token allowed; unmasked rows are untouched."""
    g = torch.Generator().manual_seed(7)
    n, vocab = 8, 3001
    logits = torch.randn(n, vocab, generator=g) * 2
    mask = random_bitmask(4, vocab, g, 0.03)
    mask_rows = torch.tensor([0, 3, 5, 6])
    out = {}
    for c in (False, True):
        t = SamplingTensors(torch.full((n,), temperature), all_greedy=temperature == 0, mask_rows=mask_rows,
                            mask=mask, bias_rows=torch.tensor([1, 1, 3]), bias_ids=torch.tensor([10, 20, 30]),
                            bias_values=torch.tensor([100.0, -100.0, 3.0]),
                            seeded=[(i, seed_for_token(11, i)) for i in range(n)])
        out[c] = Sampler(cpu_kernels=c)(logits.clone(), t).tokens
    assert torch.equal(out[True], out[False])
    for i, r in enumerate(mask_rows.tolist()):
        tok = int(out[True][r])
        assert int(mask[i, tok // 32]) >> (tok % 32) & 1
    if temperature == 0:
        free = [r for r in range(n) if r not in mask_rows.tolist() and r != 1]
        assert out[True][free].tolist() == logits[free].argmax(dim=1).tolist()
        assert int(out[True][1]) == 10
