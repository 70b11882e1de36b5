"""CPU kernels in C (cpu.c), compiled at first use and called through ctypes.

Why C: on a few CPU cores the decode step is dominated by things torch does poorly at
small batch sizes: GEMMs with a handful of rows (the BLAS repacks the weights on every
call), paged attention (a page gather copies the KV cache before SDPA reads it again) and
per-op dispatch (dozens of small ops per layer). cpu.c does them directly: GEMMs on
weights packed once at load time, attention that reads each page in place through the
block table, fused norm/rotary/activation passes, and a whole decoder layer per call.

The shared library is built with the machine's C compiler (`cc -O3 -march=native
-fopenmp`) into a cache directory keyed by the source, the compiler and the CPU, the way
Triton caches its kernels; it links the libgomp torch already loaded, so both share one
OpenMP thread pool. Without a compiler, or with NANOKV_CPU_KERNELS=0, `available()` is
False and callers use their torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

logger = logging.getLogger("nanokv")

NR = 16  # output columns per packed weight panel (cpu.c)
_SOURCE = Path(__file__).with_name("cpu.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("NANOKV_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "nanokv")
    return Path(root) / "kernels"


def _build() -> Path:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    source = _SOURCE.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(b"\0".join([source, " ".join(_FLAGS).encode(), version.encode(),
                                     _cpu_signature().encode(), platform.machine().encode()]))
    target = _cache_dir() / f"nanokv_cpu_{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run([cc, *_FLAGS, str(_SOURCE), "-o", str(out), "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed to build {_SOURCE.name}:\n{proc.stderr[-2000:]}")
        os.replace(out, target)  # atomic: concurrent builders (torchrun ranks) agree
    logger.info("built nanokv CPU kernels: %s", target)
    return target


_P, _L, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_float


class NkLayer(ctypes.Structure):
    """struct nk_layer (cpu.c): one decoder layer's sizes, packed weights and KV cache."""

    _fields_ = [(n, _L) for n in ("H", "Hq", "Hkv", "D", "I", "bs")] + [("eps", _F), ("scale", _F)] + [
        (n, _P) for n in ("input_norm", "post_norm", "q_norm", "k_norm", "qkv", "qkv_bias", "o", "o_bias",
                          "gate_up", "gate_up_bias", "down", "down_bias", "k_cache", "v_cache")]


class NkStep(ctypes.Structure):
    """struct nk_step (cpu.c): one step's rotary rows, cache slots, attention metadata and
    workspace, shared by all layers."""

    _fields_ = [(n, _L) for n in ("T", "width", "max_len")] + [
        (n, _P) for n in ("cos", "sin", "slots", "rows", "ctx", "tables",
                          "normed", "qkv", "q", "k", "attn", "o", "act")] + [
        ("keep_n", _L), ("keep", _P)]


@lru_cache(maxsize=1)
def _lib():
    if os.environ.get("NANOKV_CPU_KERNELS", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except Exception as e:  # no compiler, a compile error, an unloadable library
        logger.warning("nanokv CPU kernels unavailable, using the torch path: %s", e)
        return None
    p, i, f = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
    lib.nk_linear.argtypes = [p, i, i, p, i, p, p]
    lib.nk_linear.restype = None
    lib.nk_paged_attention.argtypes = [p, p, p, p, i, p, p, i, i, i, i, i, f, i, p]
    lib.nk_paged_attention.restype = None
    lib.nk_linear_silu_mul.argtypes = [p, i, i, p, i, p, p]
    lib.nk_linear_silu_mul.restype = None
    lib.nk_decoder_layer.argtypes = [ctypes.POINTER(NkLayer), ctypes.POINTER(NkStep), p, p, ctypes.c_int,
                                     ctypes.c_int, p]
    lib.nk_decoder_layer.restype = None
    lib.nk_rmsnorm.argtypes = [p, p, i, i, p, f, p]
    lib.nk_rmsnorm.restype = None
    lib.nk_qk_norm_rope.argtypes = [p, i, i, i, i, p, p, f, p, p, p, p]
    lib.nk_qk_norm_rope.restype = None
    return lib


def ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's data pointer for a C argument; None (NULL) for no tensor."""
    return None if t is None else t.data_ptr()


def available() -> bool:
    return _lib() is not None


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
    _lib().nk_linear_silu_mul(x.data_ptr(), m, k, packed.data_ptr(), i, ptr(bias), out.data_ptr())
    return out


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (float32, contiguous) @ W^T (+ bias) -> [M, n] (into out, contiguous, when
    given), W given as pack_weight(W)."""
    m, k = x.shape
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype)
    _lib().nk_linear(x.data_ptr(), m, k, packed.data_ptr(), n,
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
    _lib().nk_paged_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                              block_tables.shape[1], rows.data_ptr(), ctx_lens.data_ptr(), t, hq, hkv, d, bs,
                              scale, max_len, out.data_ptr())


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., H] (contiguous float32). With residual (same
    shape, contiguous): residual += x in place first, and the sum is normalised."""
    h = x.shape[-1]
    out = torch.empty_like(x)
    _lib().nk_rmsnorm(x.data_ptr(), ptr(residual), x.numel() // h, h, weight.data_ptr(), eps, out.data_ptr())
    return out


def qk_norm_rope(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D], k [T, Hkv, D]: optional per-head RMSNorm
    (q_weight, k_weight [D]), then rotary with cos, sin [T, D]."""
    t = qkv.shape[0]
    q = torch.empty(t, num_heads, head_dim)
    k = torch.empty(t, num_kv_heads, head_dim)
    _lib().nk_qk_norm_rope(qkv.data_ptr(), t, num_heads, num_kv_heads, head_dim, ptr(q_weight), ptr(k_weight),
                           eps, cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k.data_ptr())
    return q, k


def decoder_layer(layer: NkLayer, step: NkStep, x: torch.Tensor, residual: torch.Tensor, first: bool,
                  last: bool, out: torch.Tensor) -> None:
    """One decoder layer: x [T, H] -> out [T, H] (may be x), residual [T, H] updated in place
    (set to x when first). When last and step.keep is set, only the kept rows go on from
    attention through the MLP: out and residual then hold them in their first keep_n rows."""
    _lib().nk_decoder_layer(ctypes.byref(layer), ctypes.byref(step), x.data_ptr(), residual.data_ptr(),
                            int(first), int(last), out.data_ptr())
