"""Triton kernels for paged attention over the cache layout [num_blocks, block_size, Hkv, D].

reshape_and_cache writes the step's new K/V into their slots (quantize_and_cache for an
int8 or float8 e4m3 cache: per (token, head) a float16 (scale, zero), x ~ q * scale + zero).
paged_attention then attends over the paged cache for a flat varlen batch (decodes and
prefill chunks together); quantized pages are widened in registers, scale folded into the
scores and probabilities, zero in as zero * sum(q) and sum(p * zero):

- One program owns (query tile, kv head[, kv split]). A query tile is BLOCK_Q consecutive
  query tokens of one sequence times the GROUP query heads sharing the kv head, packed
  into BLOCK_M = BLOCK_Q * GROUP (padded) rows, so each K/V token is read once per group
  and tl.dot gets at least 16 rows even for a single decode token.
- Tiles are numbered without any host-side plan: sequence b owns tile ids starting at
  query_start_loc[b] // BLOCK_Q + b, which leaves room for its cdiv(q_len, BLOCK_Q)
  tiles; a program finds its sequence by binary search and surplus ids exit at once.
  The grid, T // BLOCK_Q + B, depends only on host sizes, so it suits CUDA graphs.
- Keys are gathered per token (block = table[j // block_size], offset = j % block_size),
  so any block size works; online softmax in float32, base 2 (scale folded with log2 e).
- Split-KV (flash decoding): with few programs and long contexts each tile's keys are cut
  into num_splits chunks; each writes a partial (max, sum, unnormalised acc) and a reduce
  kernel merges them.
- No recompilation inside a run: the sizes that change from step to step (num_seqs,
  num_tokens, the block-table stride) are not specialised on, split counts are powers of
  two, reshape_and_cache's tile depends on the model only, and warm_up() compiles every
  variant a run can launch (both tile shapes, every split count) before the first step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanokv.attention.base import QMAX

_LOG2E = 1.4426950408889634
# split-KV: every chunk keeps at least this many keys, and at most this many chunks
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64


@triton.jit(do_not_specialize=["num_tokens"])
def _reshape_and_cache_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_tokens, block_size,
                              stride_kt, stride_kh, stride_vt, stride_vh,
                              stride_kcb, stride_kco, stride_kch,
                              stride_vcb, stride_vco, stride_vch,
                              HEAD_DIM: tl.constexpr, ROW: tl.constexpr, ROW_PAD: tl.constexpr,
                              BLOCK_T: tl.constexpr):
    # BLOCK_T tokens per program, each token's Hkv * D values flattened into one row
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + t, mask=t < num_tokens, other=-1)  # [BLOCK_T]
    block, off = slot // block_size, slot % block_size
    i = tl.arange(0, ROW_PAD)
    h, d = i // HEAD_DIM, i % HEAD_DIM
    mask = (slot >= 0)[:, None] & (i < ROW)[None, :]  # slot -1: padding token, nothing to store
    t = t.to(tl.int64)[:, None]
    k = tl.load(k_ptr + t * stride_kt + (h * stride_kh + d)[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + (h * stride_vh + d)[None, :], mask=mask)
    tl.store(k_cache_ptr + (block * stride_kcb + off * stride_kco)[:, None] + (h * stride_kch + d)[None, :],
             k, mask=mask)
    tl.store(v_cache_ptr + (block * stride_vcb + off * stride_vco)[:, None] + (h * stride_vch + d)[None, :],
             v, mask=mask)


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Store k/v [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D] at slot_mapping [T]
    (int64 block * block_size + offset); a slot of -1 is skipped."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    row_pad = triton.next_power_of_2(num_heads * head_dim)
    block_t = max(1, 2048 // row_pad)  # the model's, whatever the step's size: one compiled variant
    _reshape_and_cache_kernel[(triton.cdiv(num_tokens, block_t),)](
        k, v, k_cache, v_cache, slot_mapping, num_tokens, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEAD_DIM=head_dim, ROW=num_heads * head_dim, ROW_PAD=row_pad, BLOCK_T=block_t)


@triton.jit
def _quantize_rows(x_ptr, c_ptr, s_ptr, t, h, block, off, stride_t, stride_h, stride_cb, stride_co, stride_ch,
                   stride_sb, stride_so, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, QMAX: tl.constexpr):
    """Rows t (int64 [BLOCK_T]) of head h -> their slots (block, off; block -1: skipped), as
    attention/base.py's quantize_kv: x ~ q * scale + zero, (scale, zero) float16 at s_ptr."""
    d = tl.arange(0, D_PAD)
    ok = block >= 0
    mask = ok[:, None] & (d < HEAD_DIM)[None, :]
    x = tl.load(x_ptr + t[:, None] * stride_t + h * stride_h + d[None, :], mask=mask, other=0.0).to(tl.float32)
    hi = tl.max(tl.where(mask, x, float("-inf")), 1)
    lo = tl.min(tl.where(mask, x, float("inf")), 1)
    zero = tl.where(ok, (hi + lo) * 0.5, 0.0).to(tl.float16).to(tl.float32)  # [BLOCK_T]
    centred = x - zero[:, None]
    sc = (tl.max(tl.where(mask, tl.abs(centred), 0.0), 1) / QMAX).to(tl.float16).to(tl.float32)
    y = centred / tl.where(sc > 0, sc, 1.0)[:, None]
    if c_ptr.dtype.element_ty == tl.int8:
        # round half to even, as torch.round: r = floor(y + 0.5), one less on the exact halves of odd r
        r = tl.floor(y + 0.5)
        r = tl.where((r - y == 0.5) & (r % 2 != 0), r - 1, r)
        y = tl.minimum(tl.maximum(r, -127.0), 127.0)
    tl.store(c_ptr + (block * stride_cb + off * stride_co)[:, None] + h * stride_ch + d[None, :],
             y.to(c_ptr.dtype.element_ty), mask=mask)
    params = s_ptr + block * stride_sb + off * stride_so + h * 2  # [Hkv, 2] (scale, zero) per slot
    tl.store(params, sc.to(tl.float16), mask=ok)
    tl.store(params + 1, zero.to(tl.float16), mask=ok)


@triton.jit(do_not_specialize=["num_tokens"])
def _quantize_and_cache_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
                               num_tokens, block_size, stride_kt, stride_kh, stride_vt, stride_vh,
                               stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch,
                               stride_ksb, stride_kso, stride_vsb, stride_vso,
                               HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, QMAX: tl.constexpr,
                               BLOCK_T: tl.constexpr):
    # BLOCK_T tokens x one KV head per program: scale = max |x| / QMAX per (token, head), the
    # page gets x / scale (int8: rounded to nearest even; fp8: cast to e4m3), as quantize_kv
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t, mask=t < num_tokens, other=-1)  # [BLOCK_T]; -1: padding, not stored
    block = tl.where(slot >= 0, slot // block_size, -1)
    off = tl.where(slot >= 0, slot % block_size, 0)
    t = t.to(tl.int64)
    _quantize_rows(k_ptr, k_cache_ptr, k_scale_ptr, t, h, block, off, stride_kt, stride_kh, stride_kcb, stride_kco,
                   stride_kch, stride_ksb, stride_kso, HEAD_DIM, D_PAD, QMAX)
    _quantize_rows(v_ptr, v_cache_ptr, v_scale_ptr, t, h, block, off, stride_vt, stride_vh, stride_vcb, stride_vco,
                   stride_vch, stride_vsb, stride_vso, HEAD_DIM, D_PAD, QMAX)


def quantize_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       k_scales: torch.Tensor, v_scales: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k/v [T, Hkv, D] quantized (int8 or float8 e4m3 caches [num_blocks, block_size,
    Hkv, D]) with their per-(token, head) (scale, zero) into k/v_scales [num_blocks,
    block_size, Hkv, 2] float16 at slot_mapping [T]; a slot of -1 is skipped."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert k_scales.stride()[2:] == v_scales.stride()[2:] == (2, 1) and k_scales.dtype == torch.float16
    d_pad = triton.next_power_of_2(head_dim)
    block_t = max(1, 2048 // d_pad)
    _quantize_and_cache_kernel[(triton.cdiv(num_tokens, block_t), num_heads)](
        k, v, k_cache, v_cache, k_scales, v_scales, slot_mapping, num_tokens, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_scales.stride(0), k_scales.stride(1), v_scales.stride(0), v_scales.stride(1),
        HEAD_DIM=head_dim, D_PAD=d_pad, QMAX=QMAX[k_cache.dtype], BLOCK_T=block_t)


@triton.jit
def _find_seq(query_start_loc_ptr, tile_id, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence b whose first tile id, query_start_loc[b] // BLOCK_Q + b, is <= tile_id."""
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first <= tile_id, mid, lo)
        hi = tl.where(first <= tile_id, hi, mid - 1)
    return lo


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
        block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr,
        scale_log2, num_seqs, block_size, num_q_heads,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch, stride_bt,
        stride_ksb, stride_kso, stride_vsb, stride_vso,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
        PRECISION: tl.constexpr, QUANTIZED: tl.constexpr):
    tile_id, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b = _find_seq(query_start_loc_ptr, tile_id, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    tile = tile_id - (q_start // BLOCK_Q + b)
    if tile * BLOCK_Q >= q_len:  # surplus tile id
        return
    seq_len = tl.load(seq_lens_ptr + b)

    # row r of the tile: query tile * BLOCK_Q + r // GROUP, head kv_head * GROUP + r % GROUP
    r = tl.arange(0, BLOCK_M)
    qi = tile * BLOCK_Q + r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_ok = (r < BLOCK_Q * GROUP) & (qi < q_len)
    pos = seq_len - q_len + qi  # [BLOCK_M] position of each row's query in its sequence
    token = (q_start + qi).to(tl.int64)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, D_PAD]

    # keys this tile needs: up to its last query's position; this split's share of them
    kv_end = seq_len - q_len + tl.minimum(q_len, (tile + 1) * BLOCK_Q)
    chunk = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), NUM_SPLITS) * BLOCK_N
    kv_lo = split * chunk
    kv_hi = tl.minimum(kv_end, kv_lo + chunk)

    if QUANTIZED:
        q_sum = tl.sum(q.to(tl.float32), 1)  # [BLOCK_M], for the keys' zeros
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    for start in range(kv_lo, kv_hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < kv_hi
        block = tl.load(table + j // block_size, mask=j_ok, other=0).to(tl.int64)
        off = j % block_size
        k_off = block * stride_kcb + off * stride_kco + kv_head * stride_kch  # [BLOCK_N]
        v_off = block * stride_vcb + off * stride_vco + kv_head * stride_vch
        k_t = tl.load(k_cache_ptr + k_off[None, :] + d[:, None],
                      mask=j_ok[None, :] & d_ok[:, None], other=0.0)  # [D_PAD, BLOCK_N]
        v = tl.load(v_cache_ptr + v_off[:, None] + d[None, :],
                    mask=j_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, D_PAD]

        if QUANTIZED:  # int8 / e4m3 pages, widened in registers; the scales fold into s and p
            # a key is k_q * scale + zero: q . k = scale (q . k_q) + zero sum(q); values the same
            k_par = k_scale_ptr + block * stride_ksb + off * stride_kso + kv_head * 2  # [BLOCK_N]
            v_par = v_scale_ptr + block * stride_vsb + off * stride_vso + kv_head * 2
            k_sc = tl.load(k_par, mask=j_ok, other=0.0).to(tl.float32)
            k_z = tl.load(k_par + 1, mask=j_ok, other=0.0).to(tl.float32)
            v_sc = tl.load(v_par, mask=j_ok, other=0.0).to(tl.float32)
            v_z = tl.load(v_par + 1, mask=j_ok, other=0.0).to(tl.float32)
            k_t = k_t.to(q.dtype)
            v = v.to(q.dtype)
            s = (tl.dot(q, k_t, input_precision=PRECISION) * k_sc[None, :]
                 + q_sum[:, None] * k_z[None, :]) * scale_log2  # [BLOCK_M, BLOCK_N]
        else:
            s = tl.dot(q, k_t, input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        s = tl.where(j_ok[None, :] & (j[None, :] <= pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row that has seen only masked keys keeps m = -inf; subtract 0 there, not -inf (NaN)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if QUANTIZED:
            acc = (acc * alpha[:, None] + tl.dot((p * v_sc[None, :]).to(v.dtype), v, input_precision=PRECISION)
                   + tl.sum(p * v_z[None, :], 1)[:, None])
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l = 0 only on padded rows
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partials are [T, Hq, NUM_SPLITS] (m, l) and [T, Hq, NUM_SPLITS, HEAD_DIM] (acc)
        row = (token * num_q_heads + head) * NUM_SPLITS + split
        tl.store(part_m_ptr + row, m_i, mask=row_ok)
        tl.store(part_l_ptr + row, l_i, mask=row_ok)
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=out_mask)


@triton.jit
def _merge_splits_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, num_q_heads,
                         stride_ot, stride_oh, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr):
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    s = tl.arange(0, S_PAD)
    s_ok = s < NUM_SPLITS
    d = tl.arange(0, D_PAD)
    row = (t * num_q_heads + h) * NUM_SPLITS + s  # [S_PAD]
    m = tl.load(part_m_ptr + row, mask=s_ok, other=float("-inf"))
    l = tl.load(part_l_ptr + row, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :],
                  mask=s_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)  # [S_PAD, D_PAD]
    # split 0 always holds key 0, which every query sees, so m_max is finite
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)  # empty splits (m = -inf) weigh 0
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def tile_shape(num_q_heads: int, num_kv_heads: int, head_dim: int, max_query_len: int,
               elem_bytes: int = 2) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_Q, BLOCK_N): tile rows, query tokens per tile, keys per iteration.

    Decode-only steps get 16 rows (tl.dot's minimum), longer queries 64; never fewer rows
    than one query's GROUP heads. K/V tiles of at most 64 x 256 bytes per row keep the
    pipelined loads within the ~100 KB of shared memory of consumer GPUs."""
    group = num_q_heads // num_kv_heads
    rows = 16 if max_query_len * group <= 16 else 64
    block_m = max(rows, triton.next_power_of_2(group))
    row_bytes = triton.next_power_of_2(head_dim) * elem_bytes
    block_n = max(16, 64 * 256 // max(row_bytes, 256))
    return block_m, block_m // group, block_n


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, block_q: int,
                      max_seq_len: int, num_sms: int) -> int:
    """1 (single pass) unless each sequence is one tile, those tiles fill less than the GPU,
    and contexts are long: then enough chunks of >= MIN_SPLIT_TOKENS keys for ~2 waves,
    rounded down to a power of two (each count is a compiled variant: few of them)."""
    if max_query_len > block_q:
        return 1
    programs = num_seqs * num_kv_heads
    by_length = max_seq_len // MIN_SPLIT_TOKENS
    if programs >= num_sms or by_length < 2:
        return 1
    return 1 << (min(MAX_SPLITS, by_length, -(-2 * num_sms // programs)).bit_length() - 1)


def possible_num_splits(num_kv_heads: int, max_seq_len: int, num_sms: int) -> list[int]:
    """Every split count choose_num_splits can return when contexts reach max_seq_len."""
    most = choose_num_splits(1, num_kv_heads, 1, 1, max_seq_len, num_sms)
    return [1 << i for i in range(most.bit_length())]


def warm_up(num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
            block_size: int, max_seq_len: int, num_sms: int, kv_dtype: torch.dtype | None = None) -> int:
    """Compile every kernel variant a run of this model can launch, by launching each once
    on a scratch pool: reshape_and_cache, and paged_attention for both tile shapes with
    every split count (and its merge kernel). Inputs are laid out as the model hands them
    (q, k rotated copies, v a view of the fused qkv projection), so strides and
    alignments specialise alike. Returns the number of paged_attention launches."""
    group = num_q_heads // num_kv_heads
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    cache = torch.zeros(2, 1, block_size, num_kv_heads, head_dim, dtype=kv_dtype, device=device)
    scales = (torch.zeros(2, 1, block_size, num_kv_heads, 2, dtype=torch.float16, device=device)
              if kv_dtype in QMAX else None)
    ks, vs = (None, None) if scales is None else (scales[0], scales[1])
    tables = torch.zeros(1, 1, dtype=torch.int32, device=device)
    elem = torch.empty(0, dtype=dtype).element_size()  # tile_shape sizes tiles by q's element
    # one query length per tile shape: a decode's, and the shortest the decode tile cannot hold
    by_tile = {tile_shape(num_q_heads, num_kv_heads, head_dim, n, elem): n for n in (max(2, 16 // group + 1), 1)}
    launches = 0
    for (_, block_q, _), q_len in by_tile.items():
        qkv = torch.zeros(q_len, num_q_heads + 2 * num_kv_heads, head_dim, dtype=dtype, device=device)
        q = torch.zeros(q_len, num_q_heads, head_dim, dtype=dtype, device=device)
        k = torch.zeros(q_len, num_kv_heads, head_dim, dtype=dtype, device=device)
        store_kv(k, qkv[:, num_q_heads + num_kv_heads:], cache[0], cache[1],
                 torch.zeros(q_len, dtype=torch.long, device=device), ks, vs)
        qsl = torch.tensor([0, q_len], dtype=torch.int32, device=device)
        seq_lens = torch.tensor([q_len], dtype=torch.int32, device=device)
        for n in possible_num_splits(num_kv_heads, max_seq_len, num_sms) if q_len <= block_q else [1]:
            paged_attention(q, cache[0], cache[1], torch.empty_like(q), qsl, seq_lens, tables,
                            scale=1.0, max_query_len=q_len, max_seq_len=max_seq_len, num_sms=num_sms,
                            num_splits=n, k_scales=ks, v_scales=vs)
            launches += 1
    return launches


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    *, scale: float, max_query_len: int, max_seq_len: int, num_sms: int = 132,
                    num_splits: int | None = None, k_scales: torch.Tensor | None = None,
                    v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """out [T, Hq, D] = causal paged attention of q [T, Hq, D] over the caches (already
    holding this step's K/V). query_start_loc [B + 1] int32, seq_lens [B] int32 (context
    after this step), block_tables [B, max_blocks] int32. num_splits None: choose_num_splits
    decides; 1 forces the single pass, > 1 split-KV. Quantized caches (int8, float8 e4m3)
    come with their (scale, zero) pairs [num_blocks, block_size, Hkv, 2] float16
    (quantize_and_cache)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_seqs = k_cache.shape[2], seq_lens.shape[0]
    if num_tokens == 0:
        return out
    assert num_q_heads % num_kv_heads == 0 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    q = _last_dim_contiguous(q)
    assert out.stride(-1) == 1
    block_m, block_q, block_n = tile_shape(num_q_heads, num_kv_heads, head_dim, max_query_len, q.element_size())
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_query_len, block_q, max_seq_len, num_sms)
    d_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    if num_splits > 1:
        part_m = q.new_empty(num_tokens, num_q_heads, num_splits, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
        part_acc = q.new_empty(num_tokens, num_q_heads, num_splits, head_dim, dtype=torch.float32)
    else:
        part_m = part_l = part_acc = out  # unused
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    quantized = k_scales is not None
    assert quantized == (k_cache.dtype in QMAX)
    if quantized:
        assert k_scales.stride()[2:] == v_scales.stride()[2:] == (2, 1)
        ks, vs, scale_strides = k_scales, v_scales, (*k_scales.stride()[:2], *v_scales.stride()[:2])
    else:
        ks = vs = out  # unused
        scale_strides = (0, 0, 0, 0)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, part_m, part_l, part_acc,
        block_tables, query_start_loc, seq_lens, ks, vs,
        scale * _LOG2E, num_seqs, k_cache.shape[1], num_q_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), *scale_strides,
        HEAD_DIM=head_dim, D_PAD=d_pad, GROUP=num_q_heads // num_kv_heads, BLOCK_Q=block_q,
        BLOCK_M=block_m, BLOCK_N=block_n, NUM_SPLITS=num_splits, PRECISION="ieee", QUANTIZED=quantized,
        num_warps=8 if block_m * d_pad >= 64 * 128 else 4)  # no register spills at these sizes (sm_90)
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            part_m, part_l, part_acc, out, num_q_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, D_PAD=d_pad, NUM_SPLITS=num_splits, S_PAD=triton.next_power_of_2(num_splits))
    return out


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scales: torch.Tensor | None = None,
             v_scales: torch.Tensor | None = None) -> None:
    """reshape_and_cache, or quantize_and_cache for a quantized cache (scales given)."""
    if k_scales is None:
        reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
    else:
        quantize_and_cache(k, v, k_cache, v_cache, k_scales, v_scales, slot_mapping)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
