"""CPU kernels in C (csrc/), compiled at first use into one library and called through ctypes.

Why C: on a few CPU cores the decode step is dominated by things torch does poorly at
small batch sizes: GEMMs with a handful of rows (the BLAS repacks the weights on every
call), paged attention (a page gather copies the KV cache before SDPA reads it again) and
per-op dispatch (dozens of small ops per layer). The kernels do them directly: GEMMs on
weights packed once at load time, attention that reads each page in place through the
block table, fused norm/rotary/activation passes, and a whole decoder layer per call.

    csrc/            the C sources, one file per topic (gemm.c, gemm_int8.c, attention.c,
                     norm_rope.c, kv_store.c, sampler.c, layer.c) behind simd.h (vector
                     width, ISA mappings) and common.h (entry points, shared structs)
    build.py         the compiler, the cache directory (keyed by every source file, flags,
                     compiler and CPU, the way Triton caches its kernels) and the build
    ffi.py           ctypes: loading the library, argument types, the NkLayer/NkStep structs
    ops.py           the Python wrappers: packing, GEMMs, attention, norms, a decoder layer
    fused_layers.py  a model's decoder layers as one C call each (built by the model when
                     the kernel switch, layers/custom_op.py, fuses them)

Parallel regions run on the kernels' own threads (csrc/pool.c: a region never waits for a
thread the machine has not scheduled, and idle threads spin briefly, then sleep); torch's
ops keep OpenMP's. Without a compiler, or with NANOKV_CPU_KERNELS=0, `available()` is False and
callers use their torch path. Nothing here compiles at import: `available()` (or the
first kernel call) does, once.
"""

from nanokv.kernels.build import can_build
from nanokv.kernels.ffi import NkLayer, NkStep, available, ptr
from nanokv.kernels.ops import (FORMATS, NR, OutputBuffer, PackedWeight, decoder_layer, embed, huge_pages,
                                int8_format, interleave_gate_up, linear, linear_silu_mul, pack_gate_up,
                                pack_weight, paged_attention, qk_norm_rope, quantize_int8, release_free_memory,
                                rmsnorm, store_kv)

__all__ = ["FORMATS", "NR", "NkLayer", "NkStep", "OutputBuffer", "PackedWeight", "available", "can_build",
           "decoder_layer", "embed", "huge_pages", "int8_format", "interleave_gate_up", "linear", "linear_silu_mul",
           "pack_gate_up", "pack_weight", "paged_attention", "ptr", "qk_norm_rope", "quantize_int8",
           "release_free_memory", "rmsnorm", "store_kv"]
