"""Loading the built library through ctypes: argument types, the structs the C kernels
share with Python (csrc/common.h), and the one question callers ask first, available()."""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from functools import lru_cache

import torch

import nanokv.kernels.build as build

logger = logging.getLogger("nanokv")

_P, _L, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_float


class NkLayer(ctypes.Structure):
    """struct nk_layer (csrc/common.h): one decoder layer's sizes, packed weights and KV cache."""

    _fields_ = [(n, _L) for n in ("H", "Hq", "Hkv", "D", "I", "bs", "fmt")] + [("eps", _F), ("scale", _F)] + [
        (n, _P) for n in ("input_norm", "post_norm", "q_norm", "k_norm", "qkv", "qkv_bias", "o", "o_bias",
                          "gate_up", "gate_up_bias", "down", "down_bias", "k_cache", "v_cache",
                          "k_scales", "v_scales")]


class NkStep(ctypes.Structure):
    """struct nk_step (csrc/common.h): one step's rotary rows, cache slots, attention
    metadata and workspace, shared by all layers."""

    _fields_ = [(n, _L) for n in ("T", "width", "max_len")] + [
        (n, _P) for n in ("cos", "sin", "slots", "rows", "ctx", "tables",
                          "normed", "qkv", "q", "k", "attn", "o", "act")] + [
        ("keep_n", _L), ("keep", _P)]


_threads = threading.local()  # the thread count last given to the kernels from this thread


def lib():
    """The library of this process's variant (NANOKV_CPU_WIDTH, read on every call; built
    at its first call), or None: switched off or not buildable. Its parallel regions run
    on as many threads as torch's ops (torch.get_num_threads(), which NANOKV_NUM_THREADS and
    torch.set_num_threads set: nanokv/cpu_threads.py), told to the kernels' pool (csrc/pool.c)
    per calling thread."""
    if build.switched_off():
        return None
    library = load(build.width())
    if library is not None:
        n = torch.get_num_threads()
        if getattr(_threads, "n", None) != (n, id(library)):
            library.nk_set_threads(n)
            _threads.n = (n, id(library))
    return library


@lru_cache(maxsize=None)
def load(width: int | None = None, portable: bool | str = False):
    """One variant of the library (build.flags), built and loaded once; None when it does
    not build or load (warned)."""
    try:
        built = build.build(width, portable)
        lib = _open(built)
    except Exception as e:  # no compiler, a compile error, an unloadable library
        logger.warning("nanokv CPU kernels unavailable, using the torch path: %s", e)
        return None
    lib.nk_name = built.path.stem  # the build's cache name: what is measured of it is kept under it
    p, i, f, n = _P, _L, _F, ctypes.c_int
    lib.nk_linear.argtypes = [p, i, i, p, n, i, p, p]
    lib.nk_linear.restype = None
    lib.nk_paged_attention.argtypes = [p, p, p, p, p, p, i, p, p, i, i, i, i, i, f, i, p]
    lib.nk_paged_attention.restype = None
    lib.nk_store_kv.argtypes = [p, i, p, i, p, i, i, i, p, p, p, p]
    lib.nk_store_kv.restype = None
    lib.nk_linear_silu_mul.argtypes = [p, i, i, p, n, i, p, p]
    lib.nk_linear_silu_mul.restype = None
    lib.nk_panel_bytes.argtypes = [n, i]
    lib.nk_panel_bytes.restype = i
    lib.nk_embed.argtypes = [p, i, p, n, i, p]
    lib.nk_embed.restype = None
    lib.nk_width.argtypes = []
    lib.nk_width.restype = n
    lib.nk_set_threads.argtypes = [n]
    lib.nk_set_threads.restype = None
    lib.nk_threads.argtypes = []
    lib.nk_threads.restype = n
    lib.nk_pool_workers.argtypes = []
    lib.nk_pool_workers.restype = n
    lib.nk_pool_stats.argtypes = [p, p]
    lib.nk_pool_stats.restype = None
    lib.nk_pool_test.argtypes = [i, i, i, p, p, i, n]
    lib.nk_pool_test.restype = None
    lib.nk_int8_isa.argtypes = []
    lib.nk_int8_isa.restype = ctypes.c_char_p
    lib.nk_decoder_layer.argtypes = [ctypes.POINTER(NkLayer), ctypes.POINTER(NkStep), p, p, ctypes.c_int,
                                     ctypes.c_int, p]
    lib.nk_decoder_layer.restype = None
    lib.nk_decoder_layers.argtypes = [ctypes.POINTER(NkLayer), i, ctypes.POINTER(NkStep), p, p, p]
    lib.nk_decoder_layers.restype = None
    lib.nk_rmsnorm.argtypes = [p, p, i, i, p, f, p]
    lib.nk_rmsnorm.restype = None
    lib.nk_qk_norm_rope.argtypes = [p, i, i, i, i, p, p, f, p, p, p, p]
    lib.nk_qk_norm_rope.restype = None
    lib.nk_top_candidates.argtypes = [p, i, p, i, i, i, p, p, p, i, p]
    lib.nk_top_candidates.restype = None
    lib.nk_sample_rows.argtypes = [p, i, p, i, i, i, p, p, p, p, p, p, p, p, i, p]
    lib.nk_sample_rows.restype = None
    lib.nk_argmax_rows.argtypes = [p, i, i, p, p, p, i, p]
    lib.nk_argmax_rows.restype = None
    lib.nk_logprobs.argtypes = [p, i, p, i, p, i, i, p, p, p, p, p, i, p]
    lib.nk_logprobs.restype = None
    return lib


_memory_files: list[int] = []  # descriptors of loaded libraries' memory files: open for good


def _open(built: build.Built) -> ctypes.CDLL:
    """dlopen the bytes build checked, not the file again: they are copied into an
    anonymous memory file (memfd) and loaded from it, so nothing done to the cache file
    after the check (a truncation: SIGBUS; changed bytes) reaches the process, at load or
    later. Its descriptor stays open: the dynamic loader knows a library by its path
    (/proc/self/fd/N), and a reused N would give back the old library. Without memfd (not
    Linux, or executable memfds forbidden) the checked file is loaded by path: nanokv
    replaces cache files only by rename, so only another writer could change it between
    the check and the load."""
    try:
        fd = os.memfd_create(built.path.name, os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        return ctypes.CDLL(str(built.path))
    try:
        view = memoryview(built.data)
        while view:
            view = view[os.write(fd, view):]
        lib = ctypes.CDLL(f"/proc/self/fd/{fd}")
    except OSError as e:
        os.close(fd)
        logger.info("nanokv CPU kernels: loading %s by path (from a memory file: %s)", built.path, e)
        return ctypes.CDLL(str(built.path))
    _memory_files.append(fd)
    return lib


def available() -> bool:
    """The kernels are switched on (NANOKV_CPU_KERNELS, read on every call) and built:
    the first call compiles the kernels unless the cache holds it."""
    return not build.switched_off() and lib() is not None


def ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's data pointer for a C argument; None (NULL) for no tensor."""
    return None if t is None else t.data_ptr()
