"""The Python side of each C kernel: weight packing, the ops on packed weights and on the
paged KV cache, and the buffers their outputs go to. Inputs are contiguous float32 CPU
tensors; the docstrings give the shapes."""

from __future__ import annotations

import ctypes
import platform
from functools import lru_cache

import torch

from nanokv.kernels.ffi import NkLayer, NkStep, lib, ptr

NR = 16  # output columns per packed weight panel (cpu.c)

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


def huge_pages(t: torch.Tensor) -> torch.Tensor:
    """Ask Linux for transparent huge pages under a large, not yet touched CPU tensor
    (returns t). Paged attention reads KV pages scattered over the pool and the GEMMs
    stream every weight each step: with 4 KiB pages both miss the TLB all the time."""
    madvise = _madvise()
    if madvise is None or t.device.type != "cpu" or t.numel() * t.element_size() < 2 * _HUGE:
        return t
    addr, size = t.data_ptr(), t.numel() * t.element_size()
    start, end = -(-addr // _HUGE) * _HUGE, (addr + size) // _HUGE * _HUGE
    madvise(start, end - start, _MADV_HUGEPAGE)  # advice only: failure changes nothing
    return t


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / NR), K, NR] panels (zero padded), the layout nk_linear reads."""
    n, k = weight.shape
    panels = -(-n // NR)
    padded = torch.zeros(panels * NR, k, dtype=weight.dtype, device=weight.device)
    padded[:n] = weight
    out = huge_pages(torch.empty(panels, k, NR, dtype=weight.dtype, device=weight.device))
    return out.copy_(padded.view(panels, NR, k).transpose(1, 2))


def pack_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [I, K] -> [ceil(I / 8), K, 16]: panel p holds gate rows 8p.. in lanes 0-7
    and up rows 8p.. in lanes 8-15 (zero padded), the layout nk_linear_silu_mul reads. A
    bias [I] each packs the same way as a [*, 1] weight: pack_gate_up(g[:, None], u[:, None])."""
    i, k = gate.shape
    panels = -(-i // 8)
    both = torch.zeros(2, panels * 8, k, dtype=gate.dtype, device=gate.device)
    both[0, :i], both[1, :i] = gate, up
    out = huge_pages(torch.empty(panels, k, 2 * 8, dtype=gate.dtype, device=gate.device))
    return out.copy_(both.view(2, panels, 8, k).permute(1, 3, 0, 2).reshape(panels, k, 2 * 8))


def linear_silu_mul(x: torch.Tensor, packed: torch.Tensor, i: int, bias: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x Wg^T + bg) * (x Wu^T + bu) -> [M, i] for x [M, K]; packed = pack_gate_up(Wg, Wu),
    bias = pack_gate_up(bg[:, None], bu[:, None])."""
    m, k = x.shape
    if out is None:
        out = torch.empty(m, i, dtype=x.dtype)
    lib().nk_linear_silu_mul(x.data_ptr(), m, k, packed.data_ptr(), i, ptr(bias), out.data_ptr())
    return out


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (float32, contiguous) @ W^T (+ bias) -> [M, n] (into out, contiguous, when
    given), W given as pack_weight(W)."""
    m, k = x.shape
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype)
    lib().nk_linear(x.data_ptr(), m, k, packed.data_ptr(), n,
                    None if bias is None else bias.data_ptr(), out.data_ptr())
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    rows: torch.Tensor, ctx_lens: torch.Tensor, max_len: int, scale: float,
                    out: torch.Tensor) -> None:
    """q [T, Hq, D]: query t attends to the first ctx_lens[t] tokens of the sequence in row
    rows[t] of block_tables (int32 [B, width]) in the paged caches [num_blocks, block_size,
    Hkv, D] -> out [T, Hq, D]. rows and ctx_lens are int32 [T]; all contiguous float32."""
    t, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    lib().nk_paged_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                             block_tables.shape[1], rows.data_ptr(), ctx_lens.data_ptr(), t, hq, hkv, d, bs,
                             scale, max_len, out.data_ptr())


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


def decoder_layer(layer: NkLayer, step: NkStep, x: torch.Tensor, residual: torch.Tensor, first: bool,
                  last: bool, out: torch.Tensor) -> None:
    """One decoder layer: x [T, H] -> out [T, H] (may be x), residual [T, H] updated in place
    (set to x when first). When last and step.keep is set, only the kept rows go on from
    attention through the MLP: out and residual then hold them in their first keep_n rows."""
    lib().nk_decoder_layer(ctypes.byref(layer), ctypes.byref(step), x.data_ptr(), residual.data_ptr(),
                           int(first), int(last), out.data_ptr())


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
