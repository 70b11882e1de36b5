"""The Python side of each C kernel: weight packing (float32, bfloat16 or int8 panels), the
ops on packed weights and on the paged KV cache, and the buffers their outputs go to.
Inputs are contiguous float32 CPU tensors; the docstrings give the shapes."""

from __future__ import annotations

import ctypes
import json
import logging
import math
import os
import platform
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import torch

import nanokv.kernels.build as build
from nanokv.cpu_threads import one_thread
from nanokv.fileio import write_durably
from nanokv.kernels.ffi import NkLayer, NkStep, lib, ptr

logger = logging.getLogger("nanokv")

NR = 16  # output columns per packed weight panel (csrc/common.h)

_HUGE = 2 << 20
_MADV_HUGEPAGE = 14


@lru_cache(maxsize=1)
def _madvise():
    if platform.system() != "Linux":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise


@lru_cache(maxsize=1)
def _malloc_trim():
    if platform.system() != "Linux":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim). Packing frees each
    float32 weight after copying it; weights of a few MiB live on the heap, whose freed pages
    otherwise stay in the process's RSS (about 115 MiB for SmolLM2-135M)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def huge_pages(t: torch.Tensor) -> torch.Tensor:
    """Ask Linux for transparent huge pages under a large, not yet touched CPU tensor
    (returns t). The GEMMs stream every weight each step: with 4 KiB pages they miss the
    TLB all the time. (The CPU KV pool takes none: runner/kv_cache.py says why.)"""
    madvise = _madvise()
    if madvise is None or t.device.type != "cpu" or t.numel() * t.element_size() < 2 * _HUGE:
        return t
    addr, size = t.data_ptr(), t.numel() * t.element_size()
    start, end = -(-addr // _HUGE) * _HUGE, (addr + size) // _HUGE * _HUGE
    madvise(start, end - start, _MADV_HUGEPAGE)  # advice only: failure changes nothing
    return t


FORMATS = {"float32": 0, "bfloat16": 1, "int8": 2, "int8w": 3}  # GEMM weight formats (csrc/common.h's NK_F32, ...)
INT8_FORMATS = ("int8", "int8w")  # int8 dot products (activations quantized too), int8 weights only
QB = 32  # int8: activations are quantized in blocks of QB along K, weights' K is padded to it


@dataclass(eq=False)
class PackedWeight:
    """W [n, k] packed once for the GEMM kernels, in panels of NR output columns (zero padded):
    float32 data [panels, k, NR] (data[p, k, j] = W[p * NR + j, k]); bfloat16 the same with
    each panel's columns in BF16_ORDER; int8 a byte tensor [panels, panel_bytes] (csrc/gemm.h:
    blocks of 32 k, then the column scales); int8w a byte tensor [panels, k * NR + 4 *
    NR] (the int8 weights as float32's [k, NR], then the column scales)."""

    data: torch.Tensor
    n: int
    k: int
    format: str

    @property
    def code(self) -> int:
        return FORMATS[self.format]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def unpack(self) -> torch.Tensor:
        """The float32 [n, k] matrix the kernel multiplies by (int8: dequantized)."""
        if self.format not in INT8_FORMATS:
            data = self.data if self.format == "float32" else self.data[:, :, _BF16_INVERSE]
            return data.float().transpose(1, 2).reshape(-1, self.k)[:self.n]
        q, scale = self.int8()
        return q.float() * scale[:, None]

    def int8(self) -> tuple[torch.Tensor, torch.Tensor]:
        """int8 weights: (q int8 [n, k], scale float32 [n]), W ~ q * scale."""
        assert self.format in INT8_FORMATS
        panels, kp = self.data.shape[0], -(-self.k // QB) * QB
        if self.format == "int8w":
            q = self.data[:, :self.k * NR].view(torch.int8).view(panels, self.k, NR).transpose(1, 2)
            scale = self.data[:, self.k * NR:].contiguous().view(torch.float32).reshape(-1)[:self.n]
            return q.reshape(panels * NR, self.k)[:self.n], scale
        blocks = self.data[:, :kp // QB * _Q8_BLOCK].view(panels, kp // QB, _Q8_BLOCK)
        q = blocks[:, :, :QB * NR].reshape(panels, kp // QB, QB // 4, NR, 4).view(torch.int8)
        q = q.permute(0, 3, 1, 2, 4).reshape(panels * NR, kp)[:self.n, :self.k]
        scale = self.data[:, kp // QB * _Q8_BLOCK:].contiguous().view(torch.float32).reshape(-1)[:self.n]
        return q, scale


BF16_ORDER = [j // 2 + (j % 2) * 8 for j in range(NR)]  # 0, 8, 1, 9, ..: the columns of a bfloat16 panel row
_BF16_INVERSE = [BF16_ORDER.index(j) for j in range(NR)]
_Q8_BLOCK = QB * NR  # bytes per block of QB k in an int8 panel: its weights


def int8_panel_bytes(k: int) -> int:
    """Bytes of one int8 panel of k rows (csrc/gemm.c's nk_panel_bytes)."""
    return -(-k // QB) * _Q8_BLOCK + NR * 4


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row (per output channel) int8: scale = max |w| / 127, q = round(w / scale)
    in [-127, 127]; an all-zero row gets scale 0. [n, k] float -> (q int8 [n, k], scale [n])."""
    w = weight.float()
    scale = w.abs().amax(1) / 127
    q = torch.where(scale[:, None] > 0, torch.round(w / torch.where(scale > 0, scale, 1)[:, None]), 0)
    return q.clamp(-127, 127).to(torch.int8), scale


def pack_weight(weight: torch.Tensor, format: str = "float32") -> PackedWeight:
    """[N, K] float -> PackedWeight in `format` (FORMATS), the layout nk_linear reads."""
    if format not in FORMATS:
        raise ValueError(f"unknown weight format {format!r}; use one of {', '.join(FORMATS)}")
    n, k = weight.shape
    panels = -(-n // NR)
    if format == "int8":
        return PackedWeight(_pack_int8(weight, panels), n, k, format)
    if format == "int8w":
        return PackedWeight(_pack_int8w(weight, panels), n, k, format)
    dtype = torch.float32 if format == "float32" else torch.bfloat16
    if n == panels * NR and weight.dtype == dtype:  # whole panels: transposed straight from the weight
        padded = weight.contiguous()
    else:
        padded = torch.zeros(panels * NR, k, dtype=dtype, device=weight.device)
        padded[:n] = weight  # bfloat16: rounded to nearest even
    if format == "bfloat16":
        padded = padded.view(panels, NR, k)[:, BF16_ORDER].reshape(panels * NR, k)
    out = huge_pages(torch.empty(panels, k, NR, dtype=dtype, device=weight.device))
    return PackedWeight(out.copy_(padded.view(panels, NR, k).transpose(1, 2)), n, k, format)


def _quantized_panels(weight: torch.Tensor, panels: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_int8(weight), zero padded: q [panels * NR, k] int8 (k >= the weight's K),
    scale [panels * NR]."""
    n, wk = weight.shape
    q, scale = quantize_int8(weight)
    qp = torch.zeros(panels * NR, k, dtype=torch.int8)
    qp[:n, :wk] = q
    sp = torch.zeros(panels * NR)
    sp[:n] = scale
    return qp, sp


def _pack_int8(weight: torch.Tensor, panels: int) -> torch.Tensor:
    k = weight.shape[1]
    kp, nb = -(-k // QB) * QB, -(-k // QB)
    qp, sp = _quantized_panels(weight, panels, kp)
    out = huge_pages(torch.empty(panels, int8_panel_bytes(k), dtype=torch.uint8))
    blocks = out[:, :nb * _Q8_BLOCK].view(panels, nb, _Q8_BLOCK)
    quads = qp.view(panels, NR, nb, QB // 4, 4).permute(0, 2, 3, 1, 4)  # [panel, block, quad, column, 4]
    blocks[:] = quads.reshape(panels, nb, QB * NR).view(torch.uint8)
    out[:, nb * _Q8_BLOCK:] = sp.view(panels, NR).view(torch.uint8)
    return out


def _pack_int8w(weight: torch.Tensor, panels: int) -> torch.Tensor:
    k = weight.shape[1]
    qp, sp = _quantized_panels(weight, panels, k)
    out = huge_pages(torch.empty(panels, k * NR + NR * 4, dtype=torch.uint8))
    out[:, :k * NR] = qp.view(panels, NR, k).transpose(1, 2).reshape(panels, k * NR).view(torch.uint8)
    out[:, k * NR:] = sp.view(panels, NR).view(torch.uint8)
    return out


INT8_LAYOUT_ENV = "NANOKV_INT8_LAYOUT"  # int8 or int8w: that layout for quantization="int8", not the measured one
LAYOUT_SHAPE = (1536, 1024)  # [n, k] of the weights int8_format times
LAYOUT_COPIES = 16  # that many of them (24 MiB per layout: beyond the caches, as a model's weights are)
LAYOUT_ROWS = (1, 32)  # rows multiplied at once: batch-1 decode, and a batch
LAYOUT_ROUNDS = 5  # timed rounds per layout and row count, alternating; the fastest of each counts


def int8_format() -> str:
    """The int8 weight layout quantization="int8" packs: NANOKV_INT8_LAYOUT when set, else
    the one this library computes fastest on this machine, measured once per kernel
    library (LAYOUT_*: the product of the times at 1 and 32 rows, the smaller wins) and
    kept beside it in the cache. int8 multiplies int8 activations (VNNI: one instruction
    multiplies and adds 4 int8 pairs per lane, but every row is quantized first); int8w
    widens int8 weights into float32 FMAs (no quantized activations, more instructions).
    Which is faster depends on the machine more than on its instruction set."""
    forced = os.environ.get(INT8_LAYOUT_ENV, "").strip()
    if forced:
        if forced not in INT8_FORMATS:
            raise ValueError(f"{INT8_LAYOUT_ENV}={forced!r}: use {' or '.join(INT8_FORMATS)}, or unset it for the "
                             "layout measured fastest here")
        return forced
    return _measured_layout(lib().nk_name)


@lru_cache(maxsize=None)
def _measured_layout(library: str) -> str:
    """The cached measurement for `library` (a kernel build's name) if it is a whole one of
    ours; else measured now and written (atomically; a cache that cannot be written only
    costs the measurement next time)."""
    path = build.cache_dir() / f"{library}.int8-layout.json"
    try:
        entry = json.loads(path.read_bytes()[:4096])
        if entry.get("library") == library and entry.get("layout") in INT8_FORMATS:
            return entry["layout"]
        logger.info("nanokv CPU kernels: %s is not a layout measurement of this library; measuring again", path)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, AttributeError) as e:
        logger.info("nanokv CPU kernels: unreadable %s (%s); measuring again", path, e)
    seconds = time_int8_layouts()
    layout = min(INT8_FORMATS, key=lambda f: math.prod(seconds[f].values()))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_durably(path, [json.dumps({"library": library, "layout": layout, "seconds": seconds}).encode()])
    except OSError as e:
        logger.info("nanokv CPU kernels: could not keep the int8 layout measurement in %s: %s", path, e)
    logger.info("nanokv CPU kernels: int8 weights as %s, the faster here (seconds %s)", layout, seconds)
    return layout


def time_int8_layouts() -> dict[str, dict[str, float]]:
    """{layout: {rows: seconds}}: the fastest of LAYOUT_ROUNDS passes of LAYOUT_ROWS rows
    through LAYOUT_COPIES weights of LAYOUT_SHAPE, layouts alternating round by round, on
    one thread: what each layout costs a core, which other processes on the machine's
    cores change far less than a parallel region's (its threads wait for each other)."""
    with one_thread():
        return _time_int8_layouts()


def _time_int8_layouts() -> dict[str, dict[str, float]]:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(*LAYOUT_SHAPE, generator=g) * 0.02
    packs = {}
    for fmt in INT8_FORMATS:
        one = pack_weight(weight, fmt)
        packs[fmt] = [one] + [PackedWeight(one.data.clone(), one.n, one.k, fmt) for _ in range(LAYOUT_COPIES - 1)]
    best = {fmt: {} for fmt in INT8_FORMATS}
    for rows in LAYOUT_ROWS:
        x = torch.randn(rows, LAYOUT_SHAPE[1], generator=g)
        out = torch.empty(rows, LAYOUT_SHAPE[0])
        for r in range(LAYOUT_ROUNDS + 1):  # the first round warms up
            for fmt in INT8_FORMATS:
                start = time.perf_counter()
                for p in packs[fmt]:
                    linear(x, p, out=out)
                seconds = time.perf_counter() - start
                if r:
                    best[fmt][str(rows)] = min(best[fmt].get(str(rows), seconds), seconds)
    return best


def interleave_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [I, K] -> [ceil(I / 8) * 16, K]: rows 16p.. are gate rows 8p..8p+7, then the
    same up rows (zero padded), so that panel p of its packing holds gate in lanes 0-7 and up
    in lanes 8-15. A bias [I] each interleaves as a [*, 1] weight: interleave_gate_up(g[:, None], u[:, None])."""
    i, k = gate.shape
    panels = -(-i // 8)
    if i == panels * 8:  # whole panels: one copy
        return torch.stack((gate.reshape(panels, 8, k), up.reshape(panels, 8, k)), 1).reshape(panels * 16, k)
    both = torch.zeros(2, panels * 8, k, dtype=gate.dtype, device=gate.device)
    both[0, :i], both[1, :i] = gate, up
    return both.view(2, panels, 8, k).transpose(0, 1).reshape(panels * 16, k)


def pack_gate_up(gate: torch.Tensor, up: torch.Tensor, format: str = "float32") -> PackedWeight:
    """gate, up [I, K] -> a PackedWeight of I outputs (silu(gate) * up) in the layout
    nk_linear_silu_mul reads; its bias: interleave_gate_up(bg[:, None], bu[:, None]).flatten()."""
    packed = pack_weight(interleave_gate_up(gate, up), format)
    return PackedWeight(packed.data, gate.shape[0], packed.k, format)


def linear_silu_mul(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x Wg^T + bg) * (x Wu^T + bu) -> [M, I] for x [M, K]; packed = pack_gate_up(Wg, Wu),
    bias = interleave_gate_up(bg[:, None], bu[:, None]).flatten()."""
    m, k = x.shape
    assert k == packed.k, (k, packed.k)
    if out is None:
        out = torch.empty(m, packed.n, dtype=x.dtype)
    lib().nk_linear_silu_mul(x.data_ptr(), m, k, packed.data.data_ptr(), packed.code, packed.n, ptr(bias),
                             out.data_ptr())
    return out


def linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (float32, contiguous) @ W^T (+ bias) -> [M, n] (into out, contiguous, when
    given), W given as pack_weight(W, format)."""
    m, k = x.shape
    assert k == packed.k, (k, packed.k)
    if out is None:
        out = torch.empty(m, packed.n, dtype=x.dtype)
    lib().nk_linear(x.data_ptr(), m, k, packed.data.data_ptr(), packed.code, packed.n, ptr(bias), out.data_ptr())
    return out


def embed(ids: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """Rows ids (int64 [T], each < packed.n) of the packed matrix, as the GEMM multiplies by
    them -> [T, k] float32 (packed.unpack()[ids], without unpacking the rest)."""
    ids = ids.contiguous()
    out = torch.empty(ids.numel(), packed.k)
    lib().nk_embed(ids.data_ptr(), ids.numel(), packed.data.data_ptr(), packed.code, packed.k, out.data_ptr())
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    rows: torch.Tensor, ctx_lens: torch.Tensor, max_len: int, scale: float,
                    out: torch.Tensor, k_scales: torch.Tensor | None = None,
                    v_scales: torch.Tensor | None = None) -> None:
    """q [T, Hq, D]: query t attends to the first ctx_lens[t] tokens of the sequence in row
    rows[t] of block_tables (int32 [B, width]) in the paged caches [num_blocks, block_size,
    Hkv, D] -> out [T, Hq, D]. rows and ctx_lens are int32 [T]; all contiguous, float32, or
    int8 caches with their (scale, zero) pairs [num_blocks, block_size, Hkv, 2] float16 (read
    in place)."""
    t, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    _check_kv(k_cache, v_cache, k_scales, v_scales)
    lib().nk_paged_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), ptr(k_scales), ptr(v_scales),
                             block_tables.data_ptr(), block_tables.shape[1], rows.data_ptr(), ctx_lens.data_ptr(),
                             t, hq, hkv, d, bs, scale, max_len, out.data_ptr())


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scales: torch.Tensor | None = None,
             v_scales: torch.Tensor | None = None) -> None:
    """k, v [T, Hkv, D] float32 (rows may be strided, heads contiguous) into slots
    slot_mapping (int64 [T]) of the caches [num_blocks, block_size, Hkv, D]: copied, or with
    scales ([num_blocks, block_size, Hkv, 2] float16) given quantized to int8 per (token,
    head) as attention/base.py's quantize_kv does."""
    t, hkv, d = k.shape
    _check_kv(k_cache, v_cache, k_scales, v_scales)
    assert k.stride(2) == v.stride(2) == 1 and k.stride(1) == v.stride(1) == d and slot_mapping.is_contiguous()
    lib().nk_store_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slot_mapping.data_ptr(), t, hkv, d,
                      k_cache.data_ptr(), v_cache.data_ptr(), ptr(k_scales), ptr(v_scales))


def _check_kv(k_cache, v_cache, k_scales, v_scales) -> None:
    quantized = k_scales is not None
    assert k_cache.dtype == v_cache.dtype == (torch.int8 if quantized else torch.float32)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert not quantized or (k_scales.dtype == v_scales.dtype == torch.float16 and k_scales.is_contiguous()
                             and v_scales.is_contiguous() and k_scales.shape == (*k_cache.shape[:3], 2))


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., H] (contiguous float32). With residual (same
    shape, contiguous): residual += x in place first, and the sum is normalised."""
    h = x.shape[-1]
    out = torch.empty_like(x)
    lib().nk_rmsnorm(x.data_ptr(), ptr(residual), x.numel() // h, h, weight.data_ptr(), eps, out.data_ptr())
    return out


def qk_norm_rope(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D], k [T, Hkv, D]: optional per-head RMSNorm
    (q_weight, k_weight [D]), then rotary with cos, sin [T, D]."""
    t = qkv.shape[0]
    q = torch.empty(t, num_heads, head_dim)
    k = torch.empty(t, num_kv_heads, head_dim)
    lib().nk_qk_norm_rope(qkv.data_ptr(), t, num_heads, num_kv_heads, head_dim, ptr(q_weight), ptr(k_weight),
                          eps, cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k.data_ptr())
    return q, k


class RowMasks(NamedTuple):
    """Token masks as the sampler kernels read them: words [M, W] int32 (vLLM's packed
    bitmask, contiguous) and index [N] int64, the row of words for each row of the logits
    (-1: no mask). A banned token reads as -inf wherever a kernel reads its row."""

    words: torch.Tensor
    index: torch.Tensor

    @staticmethod
    def build(n: int, rows: torch.Tensor, words: torch.Tensor) -> "RowMasks":
        """For logits of n rows whose rows rows [M] take words [M, W] in that order."""
        index = torch.full((n,), -1, dtype=torch.long)
        index[rows.long()] = torch.arange(len(rows))
        return RowMasks(words.to(torch.int32).contiguous(), index)


def _mask_args(logits: torch.Tensor, masks: RowMasks | None) -> tuple:
    if masks is None:
        return None, 0, None
    words = masks.words
    assert words.shape[1] == (logits.shape[1] + 31) // 32 and len(masks.index) == len(logits)
    return words.data_ptr(), words.shape[1], masks.index.data_ptr()


def top_candidates(logits: torch.Tensor, k: int, rows: torch.Tensor | None, block: int,
                   masks: RowMasks | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits of each row (rows [n] int64 of logits [N, V], None: all) and their
    ids, [n, k] each, largest first, ties lower id first: exactly a full sort's. block: the
    block size of the block maxima searched first (0: the whole row). masks: banned tokens
    read as -inf (every op below takes them the same way)."""
    n = len(logits) if rows is None else len(rows)
    vals = torch.empty(n, k)
    ids = torch.empty(n, k, dtype=torch.long)
    lib().nk_top_candidates(logits.data_ptr(), logits.shape[1], ptr(rows), n, k, block, vals.data_ptr(),
                            ids.data_ptr(), *_mask_args(logits, masks))
    return vals, ids


def sample_rows(logits: torch.Tensor, rows: torch.Tensor | None, c: int, block: int, scale: torch.Tensor,
                u: torch.Tensor | None, keys: torch.Tensor, top_p: torch.Tensor | None,
                min_p: torch.Tensor | None, masks: RowMasks | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [n] int64, z [n] float32: the weight of each row) for n sampled rows with top_k
    off (rows [n] int64 of logits [N, V], None: all), c candidates each (found with blocks of
    `block`, 0: none); [n] float32 scale (log2(e) / T), u (the first uniform; NaN, or u None
    for every row: the row's seeded_uniform(key, 0)), top_p and min_p (None: off), int64 keys
    (of the later uniforms, and a seeded row's first). csrc/sampler.c's nk_sample_rows."""
    n = len(keys)
    tokens, z = torch.empty(n, dtype=torch.long), torch.empty(n)
    args = [None if x is None else x.to(dtype).contiguous() for x, dtype in
            [(rows, torch.long), (scale, torch.float32), (u, torch.float32), (keys, torch.long),
             (top_p, torch.float32), (min_p, torch.float32)]]
    lib().nk_sample_rows(logits.data_ptr(), logits.shape[1], ptr(args[0]), n, c, block, *[ptr(x) for x in args[1:]],
                         z.data_ptr(), tokens.data_ptr(), *_mask_args(logits, masks))
    return tokens, z


def argmax_rows(logits: torch.Tensor, rows: torch.Tensor | None = None,
                masks: RowMasks | None = None) -> torch.Tensor:
    """logits[rows].argmax(dim=1) ([n] int64; rows int64, None: all) of contiguous float32
    logits [N, V]: the first of equal maxima, the first NaN where a row has one.
    csrc/sampler.c's nk_argmax_rows."""
    vocab = logits.shape[1]
    rows = None if rows is None else rows.to(torch.long).contiguous()
    n = len(logits) if rows is None else len(rows)
    out = torch.empty(n, dtype=torch.long)
    lib().nk_argmax_rows(logits.data_ptr(), n, vocab, out.data_ptr(), ptr(rows), *_mask_args(logits, masks))
    return out


def logprobs(logits: torch.Tensor, rows: torch.Tensor | None, picked: torch.Tensor, k: int, block: int,
             masks: RowMasks | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lse [n] float32: each row's log-sum-exp, above [n] int64: how many of its logits exceed
    picked [n], and its k largest logits and their ids [n, k], as top_candidates with blocks of
    `block`) for the n rows rows (int64, None: all) of logits [N, V]; csrc/sampler.c's nk_logprobs."""
    n = len(picked)
    lse, above = torch.empty(n), torch.empty(n, dtype=torch.long)
    vals, ids = torch.empty(n, k), torch.empty(n, k, dtype=torch.long)
    rows = None if rows is None else rows.to(torch.long).contiguous()
    picked = picked.float().contiguous()
    lib().nk_logprobs(logits.data_ptr(), logits.shape[1], ptr(rows), n, picked.data_ptr(), k, block, lse.data_ptr(),
                      above.data_ptr(), vals.data_ptr(), ids.data_ptr(), *_mask_args(logits, masks))
    return lse, above, vals, ids


def decoder_layer(layer: NkLayer, step: NkStep, x: torch.Tensor, residual: torch.Tensor, first: bool,
                  last: bool, out: torch.Tensor) -> None:
    """One decoder layer: x [T, H] -> out [T, H] (may be x), residual [T, H] updated in place
    (set to x when first). When last and step.keep is set, only the kept rows go on from
    attention through the MLP: out and residual then hold them in their first keep_n rows."""
    lib().nk_decoder_layer(ctypes.byref(layer), ctypes.byref(step), x.data_ptr(), residual.data_ptr(),
                           int(first), int(last), out.data_ptr())


def decoder_layers(layers, step: NkStep, x: torch.Tensor, residual: torch.Tensor, out: torch.Tensor) -> None:
    """Every layer of `layers` (a ctypes array of NkLayer), in order, in one C call: what
    decoder_layer does for each of them in turn (the first reads x, the others out; the
    last keeps step.keep's rows)."""
    lib().nk_decoder_layers(layers, len(layers), ctypes.byref(step), x.data_ptr(), residual.data_ptr(),
                            out.data_ptr())


class OutputBuffer:
    """One reusable output tensor, grown on demand. Large fresh CPU tensors are mmapped and
    page-faulted on every step; a projection whose output is consumed before the same
    projection of the next layer runs can write into one buffer shared by all layers."""

    def __init__(self):
        self.data = torch.empty(0)

    def get(self, m: int, n: int) -> torch.Tensor:
        if self.data.numel() < m * n:
            self.data = torch.empty(m * n)
        return self.data[:m * n].view(m, n)
