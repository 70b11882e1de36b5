/* nanokv CPU kernels: GEMMs on weights packed once at load time (float32, bfloat16 or int8;
 * the gate/up one with SiLU * up in its epilogue), paged attention that reads the KV pages in
 * place through the block tables, RMSNorm with the residual add, q/k norm with rotary, and a
 * whole decoder layer chaining them in one call. Activations, the KV cache and every
 * accumulation are float32.
 *
 * Built at first use by nanokv/kernels/build.py with the machine's C compiler
 * (-O3 -march=native -fopenmp) and called through ctypes on tensors' data pointers.
 * OpenMP resolves to the libgomp torch already loaded, so both share one thread pool.
 *
 * Vector width: NK_WIDTH floats, 16 where the compiler targets AVX-512, else 8, chosen when
 * the library is compiled (-DNK_WIDTH=8 or 16 forces it: build.py's NANOKV_CPU_WIDTH). The
 * code is written once on GCC vector extensions; on a machine without AVX-512 a 16-wide
 * build runs as pairs of 8-wide instructions, which is how both widths are tested anywhere.
 *
 * A GEMM output element is summed in a fixed order (sequential over K), whatever the
 * batch size, the row's position in the batch, the thread count or the vector width (its
 * lanes are output columns). Reductions across lanes (attention dot products, RMSNorm's sum
 * of squares) keep a fixed order for a given width, but a 16-wide build adds 16 partial
 * sums where an 8-wide one adds 8.
 *
 * Weight formats (the panels of pack_weight in ops.py; 16 output columns per panel):
 *   NK_F32   float32 [K][16]
 *   NK_BF16  bfloat16 [K][16]: widened to float32 by a 16-bit shift (exact), then the
 *            float32 FMAs; the sums are those of the float32 kernel on the rounded weights.
 *   NK_INT8  int8, symmetric, one scale per output column; the activations are quantized to
 *            int8 per row in blocks of 32 (scale = max |x| / 127) inside the call. Each block
 *            is an exact int32 dot product (AVX512-VNNI or AVX-VNNI where compiled for,
 *            AVX2's maddubs otherwise, plain C elsewhere: all give the same integers), then
 *            out += block scale * sum in float32, blocks in order, times the column scale.
 *   NK_INT8W int8 [K][16] (k-major like float32, then the 16 column scales): weight-only
 *            int8, the same symmetric per-column quantization; each weight widened to
 *            float32 (exact) in the float32 kernel's FMAs over unquantized activations, the
 *            sum times the column scale. Where int8 dot products are slow (AVX2's maddubs
 *            shares a port with the FMAs, and the activations need quantizing) this is the
 *            faster int8 path, and the more accurate one.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#if !defined(NK_PORTABLE) && (defined(__AVX2__) || defined(__AVX512VNNI__) || defined(__AVXVNNI__))
#include <immintrin.h>
#endif

#ifndef NK_WIDTH
#ifdef __AVX512F__
#define NK_WIDTH 16
#else
#define NK_WIDTH 8
#endif
#endif
#if NK_WIDTH != 8 && NK_WIDTH != 16
#error "NK_WIDTH must be 8 or 16"
#endif
#define VW NK_WIDTH

typedef float vf __attribute__((vector_size(4 * VW)));
typedef float vfu __attribute__((vector_size(4 * VW), aligned(4))); /* unaligned access */
typedef int32_t vi __attribute__((vector_size(4 * VW)));
typedef uint16_t vbf __attribute__((vector_size(2 * VW), aligned(2))); /* VW bfloat16 bit patterns */
typedef float v8 __attribute__((vector_size(32)));                    /* half a 16-wide vector */
typedef float v8u __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32)));

#define NR 16          /* output columns per packed weight panel, at either width */
#define NV (NR / VW)   /* vectors per panel row */

enum { NK_F32 = 0, NK_BF16 = 1, NK_INT8 = 2, NK_INT8W = 3 };

static inline vf loadv(const float *p) { return *(const vfu *)p; }
static inline void storev(float *p, vf v) { *(vfu *)p = v; }
static inline vf splat(float x) { return x - (vf){}; } /* x - 0 is x, for -0 too: no add emitted */
static inline vf selectv(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); } /* m ? a : b */
static inline v8 load8(const float *p) { return *(const v8u *)p; }
static inline void store8(float *p, v8 v) { *(v8u *)p = v; }

/* The first n floats at p (n >= 8, a multiple of 8), zero past them: the tail of a row
 * whose length is a multiple of 8 but not of VW. */
static inline vf loadv_part(const float *p, long n) {
#if VW == 8
    (void)n;
    return loadv(p);
#else
    if (n >= VW) return loadv(p);
    vf v = {};
    memcpy(&v, p, 32);
    return v;
#endif
}

static inline void storev_part(float *p, vf v, long n) {
#if VW == 8
    (void)n;
    storev(p, v);
#else
    if (n >= VW) {
        storev(p, v);
        return;
    }
    memcpy(p, &v, 32);
#endif
}

static inline float hsum8(v8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

static inline float hsum(vf v) {
#if VW == 8
    return hsum8(v);
#else
    return hsum8(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
#endif
}

/* out[i] = hsum(a[i]) for 8 vectors, rounded exactly as hsum's order, with 16 shuffles
 * and adds instead of 8 separate reductions (VW 8: lanes 0-3 and 4-7 added first, then
 * (0 + 1) + (2 + 3)) */
static inline void hsum_x8(const vf *a, float *out) {
#if VW == 8
    v8 u[4];
    for (int i = 0; i < 4; i++) /* [a(2i) lo + hi, a(2i+1) lo + hi] */
        u[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    /* hadd within 128-bit lanes: [x0 + x1, x2 + x3, y0 + y1, y2 + y3] per lane */
#define HADD(x, y) (__builtin_shufflevector(x, y, 0, 2, 8, 10, 4, 6, 12, 14) + __builtin_shufflevector(x, y, 1, 3, 9, 11, 5, 7, 13, 15))
    v8 h0 = HADD(u[0], u[1]), h1 = HADD(u[2], u[3]);
    v8 h = HADD(h0, h1); /* [a0, a2, a4, a6 | a1, a3, a5, a7] */
#undef HADD
    store8(out, __builtin_shufflevector(h, h, 0, 4, 1, 5, 2, 6, 3, 7));
#else
    for (int i = 0; i < 8; i++) out[i] = hsum(a[i]);
#endif
}

/* exp for any x (clamped to [-87, 88]): 2^n * p(f), n = round(x / ln2); for vectors of
 * floats VT with lanes ITYPE (VW wide, and 8 wide for the gate/up epilogue) */
#define DEFINE_EXP(NAME, VT, IT)                                                            \
    static inline VT NAME(VT x) {                                                           \
        const VT lo = (VT){} - 87.0f, hi = (VT){} + 88.0f;                                  \
        IT below = x < lo, above = x > hi;                                                  \
        x = (VT)(((IT)x & ~below) | ((IT)lo & below));                                      \
        x = (VT)(((IT)x & ~above) | ((IT)hi & above));                                      \
        VT t = x * 1.44269504088896341f;                                                    \
        IT neg = t < (VT){};                                                                \
        VT half = (VT)((((IT)((VT){} + 0.5f)) & ~neg) | ((IT)((VT){} - 0.5f) & neg));       \
        IT n = __builtin_convertvector(t + half, IT); /* round half away from zero */       \
        VT nf = __builtin_convertvector(n, VT);                                             \
        VT f = x - nf * 0.693145751953125f - nf * 1.428606765330187045e-06f;                \
        VT p = (VT){} + 1.0f / 5040;                                                        \
        p = p * f + 1.0f / 720;                                                             \
        p = p * f + 1.0f / 120;                                                             \
        p = p * f + 1.0f / 24;                                                              \
        p = p * f + 1.0f / 6;                                                               \
        p = p * f + 0.5f;                                                                   \
        p = p * f + 1.0f;                                                                   \
        p = p * f + 1.0f;                                                                   \
        IT e = n + 127; /* n in [-126, 127] after the clamp */                              \
        IT bits = e << 23;                                                                  \
        VT scale;                                                                           \
        memcpy(&scale, &bits, sizeof scale);                                                \
        return p * scale;                                                                   \
    }
DEFINE_EXP(exp_any, vf, vi)
#if VW == 8
#define exp8 exp_any
#else
DEFINE_EXP(exp8, v8, v8i)
#endif

/* ---- GEMM: out[M, N] = x[M, K] @ W^T (+ bias) -----------------------------------------
 * W is packed in panels of NR output columns (zero padded past N), one panel's K rows
 * contiguous: float32 wp[p][k][j] = W[p * NR + j][k], bfloat16 the same in 16-bit words
 * (columns in the order of load_bf16_row), int8 in blocks of 32 k (below). One panel
 * stays in L1/L2 while every row block of x streams past it; x itself stays in L2 for the
 * small M this is used for. */

/* rows per register tile (float32 / bfloat16 weights): 6 x 2 accumulators of 16 ymm
 * registers at width 8; 8 x 1 of 32 zmm at width 16 (not tuned on AVX-512 hardware) */
#define MR (VW == 16 ? 8 : 6)
#define MC 192                /* rows of x per pass over the weights: the block of x stays in L2 */

/* One call: what every tile of it reads. */
struct gemm {
    const float *x;                    /* float32 activations [M, K] */
    const int8_t *qx; const float *sx; /* int8 weights: x quantized, [M, Kp] and [M, Kp / QB] */
    long M, K, Kp, n, cols;            /* n outputs per row, cols of them per panel (16, gate/up 8) */
    const char *w; long panel_bytes;
    const float *bias;
    float *out;                        /* [M, n] */
};

/* a tile: rows [m, m + ROWS) against one panel (w), into out (row m, the panel's first
 * column; row stride g->n), ncols of its columns; pf: the next panel, to prefetch, or NULL */
typedef void (*tile_fn)(const struct gemm *g, long m, const char *w, const char *pf, float *out, int ncols,
                        const float *bias);

/* epilogues, one row of a tile: a = the panel's NR columns */
static inline __attribute__((always_inline)) void store_gemm_row(const vf *a, float *o, int ncols, const float *bias) {
    if (ncols == NR) {
        for (int v = 0; v < NV; v++) storev(o + v * VW, bias ? a[v] + loadv(bias + v * VW) : a[v]);
        return;
    }
    float tmp[NR];
    for (int v = 0; v < NV; v++) storev(tmp + v * VW, a[v]);
    for (int j = 0; j < ncols; j++) o[j] = bias ? tmp[j] + bias[j] : tmp[j];
}

/* Gate/up: lanes 0-7 of the panel are gate rows, lanes 8-15 the matching up rows (bias packed
 * the same way), so one tile computes both halves and the [M, 2I] intermediate is never
 * written: out[0, ncols) = silu(gate) * up, ncols <= 8. */
static inline __attribute__((always_inline)) void store_glu_row(const vf *a, float *o, int ncols, const float *bias) {
#if VW == 8
    v8 g = a[0], u = a[1];
#else
    v8 g = __builtin_shufflevector(a[0], a[0], 0, 1, 2, 3, 4, 5, 6, 7);
    v8 u = __builtin_shufflevector(a[0], a[0], 8, 9, 10, 11, 12, 13, 14, 15);
#endif
    if (bias) {
        g += load8(bias);
        u += load8(bias + 8);
    }
    v8 r = g / ((v8){} + 1.0f + exp8(-g)) * u;
    if (ncols == 8) {
        store8(o, r);
    } else {
        for (int j = 0; j < ncols; j++) o[j] = r[j];
    }
}

typedef int8_t v8q8 __attribute__((vector_size(8), aligned(1)));

/* 8 int8 values at p widened to float32. GCC 12 scalarizes __builtin_convertvector from
 * int8 (a movsx and a cvtsi2ss per value, measured 3x slower than the float32 cache), so
 * the AVX2 sign extension is spelled out. */
static inline __attribute__((always_inline)) v8 widen8(const char *p) {
#if defined(__AVX2__) && !defined(NK_PORTABLE)
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    return __builtin_convertvector(*(const v8q8 *)p, v8);
#endif
}

/* w[0, NV) = panel row k of float32 / bfloat16 weights. A bfloat16 is the top half of a
 * float32; a bfloat16 panel row stores its columns in the order 0, 8, 1, 9, .. 7, 15, so
 * that the even 16-bit words (shifted up) are columns 0-7 and the odd ones (masked) 8-15:
 * two integer operations widen 16 weights, at either vector width. */
static inline __attribute__((always_inline)) void load_f32_row(const char *wp, long k, vf *w) {
    for (int v = 0; v < NV; v++) w[v] = loadv((const float *)wp + k * NR + v * VW);
}

static inline __attribute__((always_inline)) void load_bf16_row(const char *wp, long k, vf *w) {
    typedef int32_t v8iu __attribute__((vector_size(32), aligned(2)));
    v8i words = *(const v8iu *)((const uint16_t *)wp + k * NR);
    v8 lo = (v8)(words << 16), hi = (v8)(words & (int32_t)0xffff0000u);
#if VW == 8
    w[0] = lo, w[1] = hi;
#else
    w[0] = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
}

/* w[0, NV) = panel row k of int8w weights, widened (exact); the column scales come at the store */
static inline __attribute__((always_inline)) void load_q8w_row(const char *wp, long k, vf *w) {
    v8 lo = widen8(wp + k * NR), hi = widen8(wp + k * NR + 8);
#if VW == 8
    w[0] = lo, w[1] = hi;
#else
    w[0] = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
}

/* an int8w tile row: its sums times the panel's column scales (after its K rows), then the
 * GEMM or gate/up epilogue */
static inline __attribute__((always_inline)) void store_q8w_row(const vf *a, float *o, int ncols, const float *bias,
                                                                const float *scale, int glu) {
    vf s[NV];
    for (int v = 0; v < NV; v++) s[v] = a[v] * loadv(scale + v * VW);
    if (glu)
        store_glu_row(s, o, ncols, bias);
    else
        store_gemm_row(s, o, ncols, bias);
}
#define STORE_Q8W_GEMM(a, o, ncols, bias) store_q8w_row(a, o, ncols, bias, (const float *)(wp + K * NR), 0)
#define STORE_Q8W_GLU(a, o, ncols, bias) store_q8w_row(a, o, ncols, bias, (const float *)(wp + K * NR), 1)

/* a[r][v] = x[r] . (the panel's columns v * VW ..), r < ROWS, summed over k in order; pf: the
 * next panel, prefetched a line per k (NULL: nothing to prefetch). Two copies of the k loop,
 * so that the hot one carries no prefetch test (measured: 25-30% faster). */
#define ACCUMULATE_K(ROWS, LOAD)                                                            \
    {                                                                                       \
        vf w[NV];                                                                           \
        LOAD(wp, k, w);                                                                     \
        for (int r = 0; r < ROWS; r++) {                                                    \
            vf xb = splat(x[r * K + k]);                                                    \
            for (int v = 0; v < NV; v++) a[r][v] += xb * w[v];                              \
        }                                                                                   \
    }
#define ACCUMULATE(ROWS, LOAD, ROW_BYTES)                                                   \
    vf a[ROWS][NV];                                                                         \
    for (int r = 0; r < ROWS; r++)                                                          \
        for (int v = 0; v < NV; v++) a[r][v] = splat(0.0f);                                 \
    if (pf) {                                                                               \
        _Pragma("GCC unroll 4") for (long k = 0; k < K; k++) {                              \
            __builtin_prefetch(pf + k * (ROW_BYTES), 0, 3);                                 \
            ACCUMULATE_K(ROWS, LOAD)                                                        \
        }                                                                                   \
    } else {                                                                                \
        _Pragma("GCC unroll 4") for (long k = 0; k < K; k++) ACCUMULATE_K(ROWS, LOAD)       \
    }

#define DEFINE_FLOAT_TILE(NAME, ROWS, LOAD, ROW_BYTES, STORE)                               \
    static void NAME##_##ROWS(const struct gemm *g, long m, const char *restrict wp, const char *pf, \
                              float *restrict out, int ncols, const float *restrict bias) { \
        long K = g->K;                                                                      \
        const float *restrict x = g->x + m * K;                                             \
        ACCUMULATE(ROWS, LOAD, ROW_BYTES)                                                   \
        for (int r = 0; r < ROWS; r++) STORE(a[r], out + r * g->n, ncols, bias);            \
    }

#define DEFINE_FLOAT_TILES(ROWS)                                                            \
    DEFINE_FLOAT_TILE(gemm_f32, ROWS, load_f32_row, NR * 4, store_gemm_row)                 \
    DEFINE_FLOAT_TILE(glu_f32, ROWS, load_f32_row, NR * 4, store_glu_row)                   \
    DEFINE_FLOAT_TILE(gemm_bf16, ROWS, load_bf16_row, NR * 2, store_gemm_row)               \
    DEFINE_FLOAT_TILE(glu_bf16, ROWS, load_bf16_row, NR * 2, store_glu_row)                   \
    DEFINE_FLOAT_TILE(gemm_q8w, ROWS, load_q8w_row, NR, STORE_Q8W_GEMM)                      \
    DEFINE_FLOAT_TILE(glu_q8w, ROWS, load_q8w_row, NR, STORE_Q8W_GLU)
DEFINE_FLOAT_TILES(1)
DEFINE_FLOAT_TILES(2)
DEFINE_FLOAT_TILES(3)
DEFINE_FLOAT_TILES(4)
DEFINE_FLOAT_TILES(5)
DEFINE_FLOAT_TILES(6)
#if MR > 6
DEFINE_FLOAT_TILES(7)
DEFINE_FLOAT_TILES(8)
#define TILES_7_8(name) , name##_7, name##_8
#else
#define TILES_7_8(name)
#endif
#define FLOAT_TILES(name) {0, name##_1, name##_2, name##_3, name##_4, name##_5, name##_6 TILES_7_8(name)}
static const tile_fn GEMM_F32[MR + 1] = FLOAT_TILES(gemm_f32), GLU_F32[MR + 1] = FLOAT_TILES(glu_f32);
static const tile_fn GEMM_BF16[MR + 1] = FLOAT_TILES(gemm_bf16), GLU_BF16[MR + 1] = FLOAT_TILES(glu_bf16);
static const tile_fn GEMM_Q8W[MR + 1] = FLOAT_TILES(gemm_q8w), GLU_Q8W[MR + 1] = FLOAT_TILES(glu_q8w);

/* ---- int8 weights ----------------------------------------------------------------------
 * Panel layout: K is padded to Kp, a multiple of QB = 32; for each block of 32 k, 8 groups
 * of 4 k, each 16 columns x 4 bytes (column j's 4 weights adjacent: what a VNNI dot product
 * reads), then the block's 16 column sums x 128 as int32 (the VNNI path needs them: it adds
 * 128 to the activations to make them unsigned); after the last block, the 16 column scales
 * (float32). An activation row is quantized in blocks of QB, each with its own scale. */
#define QB 32
#define Q8_BLOCK_BYTES (QB * NR + NR * 4)

#if !defined(NK_PORTABLE) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q8_VNNI512
#define Q8_ISA "avx512vnni"
#define Q8_UNSIGNED 1 /* activations stored as x + 128 */
#define MRQ 8
#elif !defined(NK_PORTABLE) && defined(__AVXVNNI__)
#define Q8_AVXVNNI
#define Q8_ISA "avxvnni"
#define Q8_UNSIGNED 1
#define MRQ 3 /* 16 ymm registers: 3 rows x (2 int32 + 2 float32 accumulators) and the weights */
#elif !defined(NK_PORTABLE) && defined(__AVX2__) && defined(__FMA__) && defined(__FMA__)
#define Q8_AVX2
#define Q8_ISA "avx2"
#define Q8_UNSIGNED 0
#define MRQ 3 /* 4 rows spill (measured: 1.6x slower) */
#else
#define Q8_GENERIC
#ifdef NK_INT8_OFFSET /* the VNNI paths' arithmetic in plain C (unsigned activations, column sums): tests */
#define Q8_ISA "generic-offset"
#define Q8_UNSIGNED 1
#else
#define Q8_ISA "generic"
#define Q8_UNSIGNED 0
#endif
#define MRQ 4
#endif

long nk_q8_padded_k(long K) { return (K + QB - 1) / QB * QB; }

/* x [K] -> q [Kp] (zero padded; + 128 as unsigned bytes for VNNI), s [Kp / QB]:
 * s = max |x| / 127 over the block, q = rint(x * (127 / max |x|)) (0 for an all-zero block) */
static void quantize_row(const float *x, long K, long Kp, int8_t *q, float *s) {
    for (long b = 0; b < Kp / QB; b++) {
        long k0 = b * QB, n = K - k0 < QB ? K - k0 : QB;
        float amax = 0.0f;
        for (long i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[k0 + i]));
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        s[b] = amax / 127.0f;
        for (long i = 0; i < QB; i++) {
            float v = i < n ? rintf(x[k0 + i] * inv) : 0.0f;
            v = fminf(fmaxf(v, -127.0f), 127.0f);
            q[k0 + i] = (int8_t)((int)v + (Q8_UNSIGNED ? 128 : 0));
        }
    }
}

/* One int8 tile: rows [m, m + ROWS) against one panel. Per block of QB k: exact int32 dot
 * products of the rows with the panel's 16 columns, then f = fma(block scale, float(sum), f);
 * every instruction set below computes the same integers and the same fused multiply-adds,
 * so all give the same floats. Q8_TILE_BEGIN / Q8_TILE_END are the shared parts. */
#define Q8_TILE_BEGIN                                                                       \
    long Kp = g->Kp, nb = Kp / QB;                                                          \
    const int8_t *qx = g->qx + m * Kp;                                                      \
    const float *sx = g->sx + m * nb;                                                       \
    const char *pb = pf ? pf : wp; /* lines to prefetch: the next panel's (or this one's) */ \
    float f[MRQ][NR];

/* f[r] * column scale, then the GEMM or gate/up epilogue */
static inline __attribute__((always_inline)) void q8_store(const float (*f)[NR], const char *wp, long nb, float *out,
                                                           long ldo, int ncols, const float *bias, const int ROWS,
                                                           const int glu) {
    const float *scale = (const float *)(wp + nb * Q8_BLOCK_BYTES);
    for (int r = 0; r < ROWS; r++) {
        vf a[NV];
        for (int v = 0; v < NV; v++) a[v] = loadv(f[r] + v * VW) * loadv(scale + v * VW);
        if (glu)
            store_glu_row(a, out + r * ldo, ncols, bias);
        else
            store_gemm_row(a, out + r * ldo, ncols, bias);
    }
}

static inline __attribute__((always_inline)) void q8_tile(const struct gemm *g, long m, const char *wp,
                                                          const char *pf, float *out, int ncols,
                                                          const float *bias, const int ROWS, const int glu) {
    Q8_TILE_BEGIN
#if defined(Q8_VNNI512)
    /* activations are stored + 128 (unsigned); the block's 128 * column sums come off */
    __m512 fa[MRQ];
    for (int r = 0; r < ROWS; r++) fa[r] = _mm512_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const char *wb = wp + b * Q8_BLOCK_BYTES;
        __m512i a[MRQ];
        for (int r = 0; r < ROWS; r++) a[r] = _mm512_setzero_si512();
        for (int q = 0; q < QB / 4; q++) {
            __builtin_prefetch(pb + b * Q8_BLOCK_BYTES + q * 64, 0, 3);
            __m512i w = _mm512_loadu_si512((const void *)(wb + q * 64));
            for (int r = 0; r < ROWS; r++) {
                int32_t xq;
                memcpy(&xq, qx + r * Kp + b * QB + q * 4, 4);
                a[r] = _mm512_dpbusd_epi32(a[r], _mm512_set1_epi32(xq), w);
            }
        }
        __m512i sums = _mm512_loadu_si512((const void *)(wb + QB * NR));
        for (int r = 0; r < ROWS; r++)
            fa[r] = _mm512_fmadd_ps(_mm512_set1_ps(sx[r * nb + b]), _mm512_cvtepi32_ps(_mm512_sub_epi32(a[r], sums)),
                                    fa[r]);
    }
    for (int r = 0; r < ROWS; r++) _mm512_storeu_ps(f[r], fa[r]);
#elif defined(Q8_AVXVNNI) || defined(Q8_AVX2)
    __m256 fa[MRQ][2];
    for (int r = 0; r < ROWS; r++) fa[r][0] = fa[r][1] = _mm256_setzero_ps();
#ifdef Q8_AVX2
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    for (long b = 0; b < nb; b++) {
        const char *wb = wp + b * Q8_BLOCK_BYTES;
        __m256i a[MRQ][2];
        for (int r = 0; r < ROWS; r++) a[r][0] = a[r][1] = _mm256_setzero_si256();
        for (int q = 0; q < QB / 4; q++) { /* unrolled, GCC spills the accumulators */
            __builtin_prefetch(pb + b * Q8_BLOCK_BYTES + q * 64, 0, 3);
            __m256i w0 = _mm256_loadu_si256((const __m256i *)(wb + q * 64));
            __m256i w1 = _mm256_loadu_si256((const __m256i *)(wb + q * 64 + 32));
#ifdef Q8_AVX2
            /* maddubs multiplies unsigned by signed bytes: |w| by x with w's sign, adjacent
             * pairs summed to int16 (at most 2 * 127 * 127: no saturation), then pairs of those */
            __m256i u0 = _mm256_abs_epi8(w0), u1 = _mm256_abs_epi8(w1);
#endif
            for (int r = 0; r < ROWS; r++) {
                int32_t xq;
                memcpy(&xq, qx + r * Kp + b * QB + q * 4, 4);
                __m256i xv = _mm256_set1_epi32(xq);
#ifdef Q8_AVX2
                a[r][0] = _mm256_add_epi32(a[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(u0, _mm256_sign_epi8(xv, w0)), ones));
                a[r][1] = _mm256_add_epi32(a[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(u1, _mm256_sign_epi8(xv, w1)), ones));
#else
                a[r][0] = _mm256_dpbusd_avx_epi32(a[r][0], xv, w0);
                a[r][1] = _mm256_dpbusd_avx_epi32(a[r][1], xv, w1);
#endif
            }
        }
#ifdef Q8_AVXVNNI
        __m256i s0 = _mm256_loadu_si256((const __m256i *)(wb + QB * NR));
        __m256i s1 = _mm256_loadu_si256((const __m256i *)(wb + QB * NR + 32));
        for (int r = 0; r < ROWS; r++) a[r][0] = _mm256_sub_epi32(a[r][0], s0), a[r][1] = _mm256_sub_epi32(a[r][1], s1);
#endif
        for (int r = 0; r < ROWS; r++) {
            __m256 s = _mm256_set1_ps(sx[r * nb + b]);
            fa[r][0] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(a[r][0]), fa[r][0]);
            fa[r][1] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(a[r][1]), fa[r][1]);
        }
    }
    for (int r = 0; r < ROWS; r++) _mm256_storeu_ps(f[r], fa[r][0]), _mm256_storeu_ps(f[r] + 8, fa[r][1]);
#else
    typedef int32_t vq __attribute__((vector_size(64)));
    typedef int32_t vqu __attribute__((vector_size(64), aligned(1)));
    memset(f, 0, sizeof f);
    for (long b = 0; b < nb; b++) {
        const char *wb = wp + b * Q8_BLOCK_BYTES;
        vq a[MRQ];
        for (int r = 0; r < ROWS; r++) a[r] = (vq){};
        for (int q = 0; q < QB / 4; q++) {
            __builtin_prefetch(pb + b * Q8_BLOCK_BYTES + q * 64, 0, 3);
            vq w = *(const vqu *)(wb + q * 64);
            for (int i = 0; i < 4; i++) {
                vq wi = (w << (24 - 8 * i)) >> 24; /* byte i of each column, sign-extended */
                for (int r = 0; r < ROWS; r++) {
                    int8_t xb = qx[r * Kp + b * QB + q * 4 + i];
                    a[r] += wi * (Q8_UNSIGNED ? (int32_t)(uint8_t)xb : (int32_t)xb);
                }
            }
        }
        if (Q8_UNSIGNED)
            for (int r = 0; r < ROWS; r++) a[r] -= *(const vqu *)(wb + QB * NR); /* 128 * column sums */
        for (int r = 0; r < ROWS; r++)
            for (int j = 0; j < NR; j++) f[r][j] = fmaf(sx[r * nb + b], (float)a[r][j], f[r][j]);
    }
#endif
    q8_store((const float (*)[NR])f, wp, nb, out, g->n, ncols, bias, ROWS, glu);
}

#define DEFINE_Q8_TILES(ROWS)                                                               \
    static void gemm_q8_##ROWS(const struct gemm *g, long m, const char *w, const char *pf, float *out, \
                               int ncols, const float *bias) {                              \
        q8_tile(g, m, w, pf, out, ncols, bias, ROWS, 0);                                    \
    }                                                                                       \
    static void glu_q8_##ROWS(const struct gemm *g, long m, const char *w, const char *pf, float *out, \
                              int ncols, const float *bias) {                               \
        q8_tile(g, m, w, pf, out, ncols, bias, ROWS, 1);                                    \
    }
DEFINE_Q8_TILES(1)
DEFINE_Q8_TILES(2)
DEFINE_Q8_TILES(3)
#if MRQ == 3
#define Q8_TILES(name) {0, name##_1, name##_2, name##_3}
#elif MRQ == 4
DEFINE_Q8_TILES(4)
#define Q8_TILES(name) {0, name##_1, name##_2, name##_3, name##_4}
#else
DEFINE_Q8_TILES(4)
DEFINE_Q8_TILES(5)
DEFINE_Q8_TILES(6)
DEFINE_Q8_TILES(7)
DEFINE_Q8_TILES(8)
#define Q8_TILES(name) {0, name##_1, name##_2, name##_3, name##_4, name##_5, name##_6, name##_7, name##_8}
#endif
static const tile_fn GEMM_Q8[MRQ + 1] = Q8_TILES(gemm_q8), GLU_Q8[MRQ + 1] = Q8_TILES(glu_q8);

/* ---- the calls --------------------------------------------------------------------------- */

/* Every packed panel against every row of x: panel p writes output columns
 * [p * cols, p * cols + cols) of out and reads bias + p * NR. Panels are split across
 * threads; the first row block of a panel streams in the next panel (weights come from
 * memory at decode batch sizes), the others find this one in cache. */
static void run_panels(const tile_fn *fn, int mr, const struct gemm *g) {
    long panels = (g->n + g->cols - 1) / g->cols, M = g->M;
#pragma omp parallel
    for (long m0 = 0; m0 < M; m0 += MC) {
        long m1 = m0 + MC < M ? m0 + MC : M;
#pragma omp for schedule(static) nowait
        for (long p = 0; p < panels; p++) {
            const char *w = g->w + p * g->panel_bytes;
            int ncols = (int)(g->n - p * g->cols < g->cols ? g->n - p * g->cols : g->cols);
            const float *b = g->bias ? g->bias + p * NR : 0;
            const char *pf = p + 1 < panels ? w + g->panel_bytes : 0;
            float *o = g->out + p * g->cols;
            long m = m0;
            for (; m + mr <= m1; m += mr, pf = 0) fn[mr](g, m, w, pf, o + m * g->n, ncols, b);
            if (m < m1) fn[m1 - m](g, m, w, pf, o + m * g->n, ncols, b);
        }
    }
}

/* bytes of one packed panel of K rows */
long nk_panel_bytes(int fmt, long K) {
    if (fmt == NK_INT8) return nk_q8_padded_k(K) / QB * Q8_BLOCK_BYTES + NR * 4;
    if (fmt == NK_INT8W) return K * NR + NR * 4;
    return K * NR * (fmt == NK_BF16 ? 2 : 4);
}

static void gemm(int fmt, int glu, const float *x, long M, long K, const void *w, long n, const float *bias,
                 float *out) {
    struct gemm g = {.x = x, .M = M, .K = K, .n = n, .cols = glu ? NR / 2 : NR, .w = w,
                     .panel_bytes = nk_panel_bytes(fmt, K), .bias = bias, .out = out};
    if (fmt == NK_F32) {
        run_panels(glu ? GLU_F32 : GEMM_F32, MR, &g);
        return;
    }
    if (fmt == NK_BF16) {
        run_panels(glu ? GLU_BF16 : GEMM_BF16, MR, &g);
        return;
    }
    if (fmt == NK_INT8W) {
        run_panels(glu ? GLU_Q8W : GEMM_Q8W, MR, &g);
        return;
    }
    g.Kp = nk_q8_padded_k(K);
    long nb = g.Kp / QB;
    int8_t *qx = malloc(M * g.Kp + 1);
    float *sx = malloc(sizeof(float) * (M * nb + 1));
#pragma omp parallel for schedule(static) if (M * K >= 32768)
    for (long m = 0; m < M; m++) quantize_row(x + m * K, K, g.Kp, qx + m * g.Kp, sx + m * nb);
    g.qx = qx, g.sx = sx;
    run_panels(glu ? GLU_Q8 : GEMM_Q8, MRQ, &g);
    free(qx);
    free(sx);
}

/* out[M, N] = x[M, K] @ W^T (+ bias [N]); w: W packed in format fmt */
void nk_linear(const float *x, long M, long K, const void *w, int fmt, long N, const float *bias, float *out) {
    gemm(fmt, 0, x, M, K, w, N, bias, out);
}

/* out[M, I] = silu(x Wg^T + bg) * (x Wu^T + bu); w, bias from pack_gate_up */
void nk_linear_silu_mul(const float *x, long M, long K, const void *w, int fmt, long I, const float *bias,
                        float *out) {
    gemm(fmt, 1, x, M, K, w, I, bias, out);
}

/* out[t] = row ids[t] of W [N, K] as the GEMM multiplies by it (bfloat16 widened, int8 times
 * its row's scale), read from the packed panels: a tied embedding looks its rows up in the
 * LM head's packed copy instead of keeping a second one. */
void nk_embed(const int64_t *ids, long T, const void *w, int fmt, long K, float *out) {
    long panel_bytes = nk_panel_bytes(fmt, K), nb = nk_q8_padded_k(K) / QB;
#pragma omp parallel for schedule(static) if (T * K >= 65536)
    for (long t = 0; t < T; t++) {
        long p = ids[t] / NR, j = ids[t] % NR;
        const char *panel = (const char *)w + p * panel_bytes;
        float *o = out + t * K;
        if (fmt == NK_F32) {
            for (long k = 0; k < K; k++) o[k] = ((const float *)panel)[k * NR + j];
        } else if (fmt == NK_BF16) {
            long at = j < 8 ? 2 * j : 2 * (j - 8) + 1; /* load_bf16_row's column order */
            for (long k = 0; k < K; k++) {
                uint32_t bits = (uint32_t)((const uint16_t *)panel)[k * NR + at] << 16;
                memcpy(o + k, &bits, 4);
            }
        } else if (fmt == NK_INT8W) {
            float scale = ((const float *)(panel + K * NR))[j];
            for (long k = 0; k < K; k++) o[k] = (float)((const int8_t *)panel)[k * NR + j] * scale;
        } else {
            float scale = ((const float *)(panel + nb * Q8_BLOCK_BYTES))[j];
            for (long k = 0; k < K; k++) {
                const int8_t *q = (const int8_t *)panel + (k / QB) * Q8_BLOCK_BYTES + (k % QB) / 4 * 64 + j * 4 + k % 4;
                o[k] = (float)*q * scale;
            }
        }
    }
}

int nk_width(void) { return VW; }
void nk_set_threads(int n) { omp_set_num_threads(n); } /* the calling thread's later parallel regions */
int nk_threads(void) { return omp_get_max_threads(); }
const char *nk_int8_isa(void) { return Q8_ISA; }

/* ---- paged decode attention ----------------------------------------------------------- */

/* KV pages hold float32 (Q8 = 0) or int8 (Q8 = 1) values. An int8 cache has a float16
 * (scale, zero) pair per (token, KV head) in a parallel array [num_blocks, bs, Hkv, 2]
 * ((slot * Hkv + h) * 2), the stored value being q * scale + zero (asymmetric:
 * quantize_kv_row). The kernels read the int8 pages in place, widen each vector of keys or
 * values to float32 and fold the pair into the dot products: a score is
 * scale_k (q . k_int8) + zero_k sum(q), a value row weighs p * scale_v and adds p * zero_v
 * to every dim. Every function below is written once for both, with Q8 a constant of each
 * call (always inlined into a float32 and an int8 copy). */
#define KV_ELEM(Q8) ((Q8) ? 1 : 4) /* bytes per stored value */
typedef _Float16 nk_half;         /* the (scale, zero) pairs */

/* sum of a row of D floats (D a multiple of 8) */
static inline float row_sum(const float *x, long D) {
    vf a = splat(0);
    for (long d = 0; d < D; d += VW) a += loadv_part(x + d, D - d);
    return hsum(a);
}

/* Pages sit anywhere in the pool, so the hardware prefetcher cannot guess the next one:
 * while a page is read, the next page of the table is prefetched, spread over the work
 * on this one: each inner iteration requests its share, a few lines (a burst of a whole
 * page of prefetches stalls on the miss buffers; measured: 20-30% more bandwidth). */
static inline void prefetch_page(const char *page, long bytes) {
    for (long i = 0; i < bytes; i += 64) __builtin_prefetch(page + i, 0, 3);
}

/* Rows [0, n) of an int8 page (rows rb bytes apart), heads [h0, h1), widened into wide
 * (float32, (h1 - h0) * D a row), and their (scale, zero) pairs (pairs: the page's, Hkv a
 * row) into sf[(h - h0) * bs + t] and zf[...] as floats; the next page's pairs (if any)
 * prefetched (its values are prefetched by the caller, spread over the work). */
static inline void widen_page(const char *page, const nk_half *pairs, const nk_half *next_pairs, long n, long rb,
                              long Hkv, long h0, long h1, long D, long bs, float *wide, float *sf, float *zf) {
    const long w = (h1 - h0) * D;
    if (next_pairs)
        for (long i = 0; i < n * Hkv * 2 * (long)sizeof(nk_half); i += 64) __builtin_prefetch((const char *)next_pairs + i, 0, 3);
    for (long t = 0; t < n; t++) {
        const char *src = page + t * rb + h0 * D;
        for (long i = 0; i < w; i += 8) store8(wide + t * w + i, widen8(src + i));
        for (long h = h0; h < h1; h++) {
            sf[(h - h0) * bs + t] = (float)pairs[(t * Hkv + h) * 2];
            zf[(h - h0) * bs + t] = (float)pairs[(t * Hkv + h) * 2 + 1];
        }
    }
}

/* Scores of NK consecutive float32 keys (rows row_stride floats apart) for query heads
 * [h0 * G, h1 * G): s[(h - h0) * G + g][i] (rows L apart) = scale * q . k_i; NK rows' bytes
 * of the next page (next, rb bytes a row) prefetched, a share in each (head, query)
 * iteration. One copy per NK. */
static inline __attribute__((always_inline)) void score_keys(
        const float *q, const float *keys, long ws, long G, long D, long h0, long h1, const char *next,
        long rb, float scale, float *s, long L, const int NK) {
    long iters = (h1 - h0) * G, share = (NK * rb + 64 * iters - 1) / (64 * iters) * 64, done = 0;
    for (long h = h0; h < h1; h++) {
        const float *k0 = keys + h * D;
        for (long g = 0; g < G; g++) {
            if (next && done < NK * rb) { /* this iteration's share of the next page */
                long len = NK * rb - done < share ? NK * rb - done : share;
                prefetch_page(next + done, len);
                done += len;
            }
            const float *qg = q + (h * G + g) * D;
            vf a[8];
            for (int i = 0; i < NK; i++) a[i] = splat(0);
            for (long d = 0; d < D; d += VW) {
                vf qv = loadv_part(qg + d, D - d);
                for (int i = 0; i < NK; i++) a[i] += qv * loadv_part(k0 + i * ws + d, D - d);
            }
            float *sg = s + ((h - h0) * G + g) * L;
            if (NK == 8) {
                hsum_x8(a, sg);
            } else {
                for (int i = 0; i < NK; i++) sg[i] = hsum(a[i]);
            }
            for (int i = 0; i < NK; i++) sg[i] *= scale;
        }
    }
}

/* Scores of query heads [h0 * G, h1 * G) against the first L cached float32 keys:
 * s[(h - h0) * G + g][t] = scale * q[h * G + g] . k_t[h]. Pages are read whole and in order
 * (KV heads h0..h1 of a row are adjacent); the next page is prefetched meanwhile. (int8
 * pages: scores_q8, in the prefill tiles' arithmetic.) */
static void scores_f32(const float *q, long G, long D, long h0, long h1, const float *kc, const int32_t *table,
                       long L, long bs, long row_stride, float scale, float *s) {
    const long rb = row_stride * 4; /* bytes per cache row */
    for (long t0 = 0; t0 < L; t0 += bs) {
        const float *rows = kc + (long)table[t0 / bs] * bs * row_stride;
        long n = L - t0 < bs ? L - t0 : bs;
        const char *next = t0 + bs < L ? (const char *)(kc + (long)table[t0 / bs + 1] * bs * row_stride) : 0;
        long t = 0;
        for (; t + 8 <= n; t += 8) /* 8 keys at a time: 8 independent chains of FMAs */
            score_keys(q, rows + t * row_stride, row_stride, G, D, h0, h1, next ? next + t * rb : 0, rb, scale,
                       s + t0 + t, L, 8);
        for (; t + 4 <= n; t += 4)
            score_keys(q, rows + t * row_stride, row_stride, G, D, h0, h1, next ? next + t * rb : 0, rb, scale,
                       s + t0 + t, L, 4);
        for (; t < n; t++)
            score_keys(q, rows + t * row_stride, row_stride, G, D, h0, h1, 0, rb, scale, s + t0 + t, L, 1);
    }
}

/* An int8 score: a * f + z * qs, each product rounded on its own, then their sum. Left to
 * itself the compiler fuses one product or the other into an FMA, and not the same one in
 * every copy of a kernel; the tiles and the single queries must agree to the bit. */
#if defined(__AVX512F__)
#define OPAQUE(v) __asm__("" : "+v"(v))
#elif defined(__AVX__) && VW == 8
#define OPAQUE(v) __asm__("" : "+x"(v))
#else /* a vector wider than the registers: through memory */
#define OPAQUE(v) __asm__("" : "+m"(v))
#endif
static inline __attribute__((always_inline)) vf q8_score(vf a, vf f, vf z, vf qs) {
    vf x = a * f, y = z * qs;
    OPAQUE(x);
    OPAQUE(y);
    return x + y;
}

/* a + b * c for the int8 kernels' running sums: one FMA where the machine has them, else a
 * product rounded and then added; never left to the compiler, which contracts a += b * c
 * or not by its tuning and the shape of the loop around it (GCC's znver tuning keeps
 * 256-bit chains in single-block loops unfused), so two kernels could round one sum two ways */
static inline __attribute__((always_inline)) vf fmadd(vf b, vf c, vf a) {
#if VW == 16 && defined(__AVX512F__) && !defined(NK_PORTABLE)
    return (vf)_mm512_fmadd_ps((__m512)b, (__m512)c, (__m512)a);
#elif VW == 8 && defined(__AVX2__) && defined(__FMA__) && !defined(NK_PORTABLE)
    return (vf)_mm256_fmadd_ps((__m256)b, (__m256)c, (__m256)a);
#else
    vf p = b * c;
    OPAQUE(p);
    return a + p;
#endif
}

/* acc[(h - h0) * G + g] = sum_t p[(h - h0) * G + g][t] v_t[h] (v_t[h] = v_int8 * scale + zero
 * when Q8); a page (in L1 after its first pass) is read once from memory, the next one
 * prefetched meanwhile; an int8 page is widened first (widen_page). Q8 follows the prefill
 * tiles' arithmetic (attend_tile_g): p unnormalized, each row's sum_t p_t zero_t one chain
 * in key order, and (acc + that sum) * inv[row] at the end. */
static inline __attribute__((always_inline)) void weighted_values_g(
        const float *s, long G, long D, long h0, long h1, const void *vc, const nk_half *vs,
        const int32_t *table, long L, long bs, long row_stride, float *acc, float *wide, const float *inv,
        const int Q8) {
    const long E = KV_ELEM(Q8), Hkv = row_stride / D, rb = row_stride * E;
    const long ws = Q8 ? (h1 - h0) * D : row_stride, hb = Q8 ? h0 : 0;
    long rows = (h1 - h0) * G;
    float zs[Q8 ? rows : 1]; /* sum_t p_t zero_t of each row: added to all its dims at the end */
    if (Q8) memset(zs, 0, sizeof(float) * rows);
    memset(acc, 0, sizeof(float) * rows * D);
    for (long t0 = 0; t0 < L; t0 += bs) {
        const char *page = (const char *)vc + (long)table[t0 / bs] * bs * rb;
        long n = L - t0 < bs ? L - t0 : bs;
        const char *next = t0 + bs < L ? (const char *)vc + (long)table[t0 / bs + 1] * bs * rb : 0;
        const float *vals = (const float *)page, *sf = wide + bs * row_stride, *zf = sf + bs * Hkv;
        if (Q8) {
            widen_page(page, vs + (long)table[t0 / bs] * bs * Hkv * 2,
                       next ? vs + (long)table[t0 / bs + 1] * bs * Hkv * 2 : 0, n, rb, Hkv, h0, h1, D, bs, wide,
                       (float *)sf, (float *)zf);
            vals = wide;
        }
        for (long r = 0; r < rows; r++) {
            /* this row's share of the next page, a line per value row read */
            const char *pf = 0, *pf_end = 0;
            if (next) {
                long share = (bs * rb + 64 * rows - 1) / (64 * rows) * 64; /* whole lines */
                long from = r * share, to = from + share < bs * rb ? from + share : bs * rb;
                if (from < to) pf = next + from, pf_end = next + to;
            }
            const float *sg = s + r * L + t0;
            float pw[Q8 ? bs : 1]; /* int8: p_t * scale_t */
            if (Q8) {
                const float *f = sf + (r / G) * bs, *z = zf + (r / G) * bs;
                float zsum = zs[r];
                for (long j = 0; j < n; j++) {
                    float pz = sg[j] * z[j];
                    OPAQUE(pz); /* rounded, then added, as in the tiles (where and whether the
                                 * compiler fuses a multiply-add into a chain depends on its tuning) */
                    zsum += pz;
                    pw[j] = sg[j] * f[j];
                }
                zs[r] = zsum;
                sg = pw;
            }
            const float *vh = vals + (h0 + r / G - hb) * D;
            float *ag = acc + r * D;
            for (long d0 = 0; d0 < D; d0 += 4 * VW) { /* up to 4 accumulators in registers over the page */
                long w = D - d0 < 4 * VW ? D - d0 : 4 * VW;
                vf a0 = loadv_part(ag + d0, w), a1 = w > VW ? loadv_part(ag + d0 + VW, w - VW) : splat(0);
                vf a2 = w > 2 * VW ? loadv_part(ag + d0 + 2 * VW, w - 2 * VW) : splat(0);
                vf a3 = w > 3 * VW ? loadv_part(ag + d0 + 3 * VW, w - 3 * VW) : splat(0);
                for (long j = 0; j < n; j++) {
                    const float *vr = vh + j * ws + d0;
                    if (pf < pf_end) {
                        __builtin_prefetch(pf, 0, 3);
                        pf += 64;
                    }
                    vf p = splat(sg[j]);
                    if (Q8) {
                        a0 = fmadd(p, loadv_part(vr, w), a0);
                        if (w > VW) a1 = fmadd(p, loadv_part(vr + VW, w - VW), a1);
                        if (w > 2 * VW) a2 = fmadd(p, loadv_part(vr + 2 * VW, w - 2 * VW), a2);
                        if (w > 3 * VW) a3 = fmadd(p, loadv_part(vr + 3 * VW, w - 3 * VW), a3);
                        continue;
                    }
                    a0 += p * loadv_part(vr, w);
                    if (w > VW) a1 += p * loadv_part(vr + VW, w - VW);
                    if (w > 2 * VW) a2 += p * loadv_part(vr + 2 * VW, w - 2 * VW);
                    if (w > 3 * VW) a3 += p * loadv_part(vr + 3 * VW, w - 3 * VW);
                }
                storev_part(ag + d0, a0, w);
                if (w > VW) storev_part(ag + d0 + VW, a1, w - VW);
                if (w > 2 * VW) storev_part(ag + d0 + 2 * VW, a2, w - 2 * VW);
                if (w > 3 * VW) storev_part(ag + d0 + 3 * VW, a3, w - 3 * VW);
            }
            if (pf < pf_end) prefetch_page(pf, pf_end - pf); /* what the reads did not cover */
        }
    }
    for (long r = 0; Q8 && r < rows; r++) {
        vf f = splat(inv[r]), z = splat(zs[r]);
        for (long d = 0; d < D; d += VW) storev_part(acc + r * D + d, (loadv_part(acc + r * D + d, D - d) + z) * f, D - d);
    }
}

/* softmax of s[0, L) in place; returns 1 / sum */
static float softmax_row(float *s, long L) {
    float mx = -INFINITY;
    for (long t = 0; t < L; t++) mx = s[t] > mx ? s[t] : mx;
    vf acc = splat(0);
    long t = 0;
    for (; t + VW <= L; t += VW) {
        vf e = exp_any(loadv(s + t) - splat(mx));
        storev(s + t, e);
        acc += e;
    }
    float sum = hsum(acc);
    for (; t < L; t++) {
        s[t] = expf(s[t] - mx);
        sum += s[t];
    }
    return 1.0f / sum;
}

/* ---- prefill tiles: consecutive queries of one sequence, as small GEMMs ---------------
 * A tile holds n consecutive prompt tokens of one sequence (positions p0..p0+n-1, so
 * context lengths c0..c0+n-1) and one KV head: its R = n * G query rows share every key
 * and value read. The rows are packed once, transposed, into 16-row panels, so that
 * S^T = K Q^T has the rows in vector lanes: keys are broadcast straight from their cache
 * rows, up to 6 keys x 16 rows of accumulators (16 / VW vectors per key). The softmax then runs down the keys with
 * the rows in lanes too (no horizontal sums), and O = P V goes a page at a time, up to 6
 * rows x 16 dims of accumulators, the page's value rows staying in L1 while every row
 * block passes over them. */
#define TILE_ROWS 32 /* query rows (queries x heads of the group) per tile; a multiple of 16 */

static const float ZERO_ROW[512] = {0}; /* stands in for missing rows of a block; D <= 512 */

/* r[k] <- lane k of every r[i] (an 8 x 8 transpose in registers) */
static inline void transpose8(v8 *r) {
    const v8i lo = {0, 8, 1, 9, 4, 12, 5, 13}, hi = {2, 10, 3, 11, 6, 14, 7, 15};
    const v8i even = {0, 1, 8, 9, 4, 5, 12, 13}, odd = {2, 3, 10, 11, 6, 7, 14, 15};
    const v8i first = {0, 1, 2, 3, 8, 9, 10, 11}, second = {4, 5, 6, 7, 12, 13, 14, 15};
    v8 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = __builtin_shuffle(r[2 * i], r[2 * i + 1], lo);
        t[2 * i + 1] = __builtin_shuffle(r[2 * i], r[2 * i + 1], hi);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = __builtin_shuffle(t[4 * i], t[4 * i + 2], even);
        u[4 * i + 1] = __builtin_shuffle(t[4 * i], t[4 * i + 2], odd);
        u[4 * i + 2] = __builtin_shuffle(t[4 * i + 1], t[4 * i + 3], even);
        u[4 * i + 3] = __builtin_shuffle(t[4 * i + 1], t[4 * i + 3], odd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = __builtin_shuffle(u[i], u[i + 4], first);
        r[i + 4] = __builtin_shuffle(u[i], u[i + 4], second);
    }
}

/* qt[p][d][j] = row 16 p + j of the tile at dim d, zero past R (8 x 8 blocks transposed) */
static void pack_rows(const float *const *qr, long R, long D, float *qt) {
    for (long j0 = 0; j0 < (R + 15) / 16 * 16; j0 += 8) {
        const float *rows[8];
        for (int i = 0; i < 8; i++) rows[i] = j0 + i < R ? qr[j0 + i] : ZERO_ROW;
        float *dst = qt + (j0 / 16) * D * 16 + j0 % 16;
        for (long d0 = 0; d0 < D; d0 += 8) {
            v8 b[8];
            for (int i = 0; i < 8; i++) b[i] = load8(rows[i] + d0);
            transpose8(b);
            for (int k = 0; k < 8; k++) store8(dst + (d0 + k) * 16, b[k]);
        }
    }
}

/* Register blocks of the tiles: up to KB keys (or rows) x 16 lanes of accumulators. Each
 * block body is written once, for a count NB the callers pass as a constant (SPECIALIZE),
 * so every size compiles to its own fully unrolled copy. */
#define KB 6
#define SPECIALIZE(n, call)                                                                 \
    switch (n) {                                                                            \
    case 1: call(1); break;                                                                 \
    case 2: call(2); break;                                                                 \
    case 3: call(3); break;                                                                 \
    case 4: call(4); break;                                                                 \
    case 5: call(5); break;                                                                 \
    default: call(6); break;                                                                \
    }

/* st[t][r] = scale * k_t . q_r for NB keys t (float32 rows, row_stride floats apart) and the
 * 16 rows of panel w; when Q8 the keys are the widened k_int8 (k_t = k_int8 * scale + zero,
 * the pair at ksc + t * kss) and qsum the panel's 16 row sums (times scale) */
static inline __attribute__((always_inline)) void score_block(const float *keys, long row_stride, long D,
                                                              const float *w, float scale, const nk_half *ksc,
                                                              long kss, const float *qsum, float *o, long Rp,
                                                              const int NB, const int Q8) {
    vf a[KB][NV];
    for (int i = 0; i < NB; i++)
        for (int v = 0; v < NV; v++) a[i][v] = splat(0);
    for (long d = 0; d < D; d++) {
        vf wv[NV];
        for (int v = 0; v < NV; v++) wv[v] = loadv(w + d * 16 + v * VW);
        for (int i = 0; i < NB; i++) {
            vf b = splat(keys[i * row_stride + d]);
            for (int v = 0; v < NV; v++) a[i][v] = Q8 ? fmadd(b, wv[v], a[i][v]) : a[i][v] + b * wv[v];
        }
    }
    for (int i = 0; i < NB; i++) {
        vf f = splat(Q8 ? scale * (float)ksc[i * kss] : scale);
        if (Q8) {
            vf z = splat((float)ksc[i * kss + 1]);
            for (int v = 0; v < NV; v++) storev(o + i * Rp + v * VW, q8_score(a[i][v], f, z, loadv(qsum + v * VW)));
        } else {
            for (int v = 0; v < NV; v++) storev(o + i * Rp + v * VW, a[i][v] * f);
        }
    }
}

/* st[t][r] = scale * k_t . q_r for the n keys of one page, r < Rp (ksc: the page's first
 * key's (scale, zero), stride kss; qsum: the Rp row sums times scale). int8 keys are
 * widened a block of KB at a time into kf, in L1, and every panel reads them from there
 * (widening in the inner loop costs a convert per broadcast). */
static inline __attribute__((always_inline)) void page_scores(const char *keys, long n, long row_stride, long D,
                                                              const float *qt, long Rp, float scale,
                                                              const nk_half *ksc, long kss, const float *qsum,
                                                              float *st, const int Q8) {
    float kf[Q8 ? KB * D : 1];
    for (long t = 0; t < n; t += KB) {
        const float *kb = (const float *)keys + t * row_stride;
        long ks = row_stride;
        if (Q8) {
            for (long i = 0; i < KB && t + i < n; i++)
                for (long d = 0; d < D; d += 8) store8(kf + i * D + d, widen8(keys + (t + i) * row_stride + d));
            kb = kf, ks = D;
        }
        for (long p = 0; p < Rp / 16; p++) {
#define SCORE_BLOCK(NB) score_block(kb, ks, D, qt + p * D * 16, scale, Q8 ? ksc + t * kss : 0, kss, qsum + p * 16, \
                                    st + t * Rp + p * 16, Rp, NB, Q8)
            SPECIALIZE(n - t, SCORE_BLOCK)
#undef SCORE_BLOCK
        }
    }
}

/* out rows 0..NB-1 (orow), dims [d0, d0 + DIMS) (16, or 8 at the end of an odd head), += P V
 * over nk float32 value rows (row_stride floats apart; p: P^T at the first of them and the
 * block's first row, stride Rp); first: start from zero. DIMS is a constant, so each case
 * compiles alone. */
static inline __attribute__((always_inline)) void value_block(const float *p, long Rp, const float *vals, long nk,
                                                              long row_stride, float *const *orow, int first,
                                                              long d0, const int DIMS, const int NB, const int Q8) {
    const int VECS = (DIMS + VW - 1) / VW; /* vectors over the dims, the last one perhaps half used */
    vf a[KB][NV];
    for (int i = 0; i < NB; i++)
        for (int v = 0; v < VECS; v++) a[i][v] = first ? splat(0) : loadv_part(orow[i] + d0 + v * VW, DIMS - v * VW);
    for (long j = 0; j < nk; j++) {
        const float *vr = vals + j * row_stride + d0;
        const float *pj = p + j * Rp;
        vf wv[NV];
        for (int v = 0; v < VECS; v++) wv[v] = loadv_part(vr + v * VW, DIMS - v * VW);
        for (int i = 0; i < NB; i++) {
            vf b = splat(pj[i]);
            for (int v = 0; v < VECS; v++) a[i][v] = Q8 ? fmadd(b, wv[v], a[i][v]) : a[i][v] + b * wv[v];
        }
    }
    for (int i = 0; i < NB; i++)
        for (int v = 0; v < VECS; v++) storev_part(orow[i] + d0 + v * VW, a[i][v], DIMS - v * VW);
}

/* out rows [0, R) += P V over nk value rows (float32, row_stride floats apart), p: P^T at the
 * first of them, stride Rp; Q8: the sums through fmadd (widened int8 values) */
static inline __attribute__((always_inline)) void values_rows_g(const float *p, long Rp, long R, const float *vals,
                                                                 long nk, long row_stride, float *const *orow,
                                                                 int first, long D, const int Q8) {
    for (long r0 = 0; r0 < R; r0 += KB)
        for (long d0 = 0; d0 < D; d0 += 16) {
#define VALUE_BLOCK_16(NB) value_block(p + r0, Rp, vals, nk, row_stride, orow + r0, first, d0, 16, NB, Q8)
#define VALUE_BLOCK_8(NB) value_block(p + r0, Rp, vals, nk, row_stride, orow + r0, first, d0, 8, NB, Q8)
            if (D - d0 >= 16) {
                SPECIALIZE(R - r0, VALUE_BLOCK_16)
            } else {
                SPECIALIZE(R - r0, VALUE_BLOCK_8)
            }
#undef VALUE_BLOCK_16
#undef VALUE_BLOCK_8
        }
}

static void values_rows(const float *p, long Rp, long R, const float *vals, long nk, long row_stride,
                        float *const *orow, int first, long D) {
    values_rows_g(p, Rp, R, vals, nk, row_stride, orow, first, D, 0);
}

static void values_rows_q8(const float *p, long Rp, long R, const float *vals, long nk, long row_stride,
                           float *const *orow, int first, long D) {
    values_rows_g(p, Rp, R, vals, nk, row_stride, orow, first, D, 1);
}

/* one prefill tile (queries t0..t0+n-1, contexts c0..c0+n-1) against KV head h;
 * s: L * Rp floats, qt: Rp * D floats (Rp = R rounded up to 16) */
static inline __attribute__((always_inline)) void attend_tile_g(
        const float *q, const void *kc, const void *vc, const nk_half *ks, const nk_half *vs, const int32_t *table,
        long t0, long n, long c0, long h, long Hq, long G, long D, long bs, long row_stride, float scale,
        float *out, float *s, float *qt, const int Q8) {
    const long E = KV_ELEM(Q8), Hkv = row_stride / D;
    const float *qr[TILE_ROWS];
    float *orow[TILE_ROWS];
    long R = n * G, L = c0 + n - 1, Rp = (R + 15) / 16 * 16;
    for (long i = 0; i < n; i++)
        for (long g = 0; g < G; g++) {
            qr[i * G + g] = q + ((t0 + i) * Hq + h * G + g) * D;
            orow[i * G + g] = out + ((t0 + i) * Hq + h * G + g) * D;
        }
    pack_rows(qr, R, D, qt);
    float qsum[TILE_ROWS] = {0}; /* each row's sum times scale, for the keys' zeros */
    for (long r = 0; Q8 && r < R; r++) qsum[r] = scale * row_sum(qr[r], D);
    for (long k0 = 0; k0 < L; k0 += bs) {
        long nk = L - k0 < bs ? L - k0 : bs, first = (long)table[k0 / bs] * bs; /* the page's first slot */
        page_scores((const char *)kc + (first * row_stride + h * D) * E, nk, row_stride, D, qt, Rp, scale,
                    Q8 ? ks + (first * Hkv + h) * 2 : 0, 2 * Hkv, qsum, s + k0 * Rp, Q8);
    }
    /* softmax down the keys, VW rows per vector: row r sees the first c0 + r / G keys */
    float inv[TILE_ROWS];
    for (long r0 = 0; r0 < Rp; r0 += VW) {
        vi seen;
        for (int i = 0; i < VW; i++) seen[i] = (int32_t)(c0 + (r0 + i) / G);
        vf mx = splat(-INFINITY), sum = splat(0);
        for (long t = 0; t < L; t++) {
            vf x = loadv(s + t * Rp + r0);
            vi live = (vi){} + (int32_t)t < seen;
            mx = selectv(live & (x > mx), x, mx);
        }
        for (long t = 0; t < L; t++) {
            vi live = (vi){} + (int32_t)t < seen;
            vf e = exp_any(loadv(s + t * Rp + r0) - mx);
            e = selectv(live, e, splat(0));
            storev(s + t * Rp + r0, e);
            sum += e;
        }
        for (int i = 0; i < VW && r0 + i < R; i++) inv[r0 + i] = 1.0f / sum[i];
    }
    /* O = P V, a page at a time; the sums go back to the output rows between pages. int8
     * values: VCHUNK rows at a time are widened into vf (in L1) and their P^T rows scaled by
     * the values' scales, each row's sum_t p_t zero_t kept in zs and added to every dim at
     * the end: the value blocks then run as on float32 pages. */
    enum { VCHUNK = 16 };
    float vf_[Q8 ? VCHUNK * D : 1], vsf[VCHUNK], vzf[VCHUNK], zs[TILE_ROWS] = {0};
    for (long k0 = 0; k0 < L; k0 += bs) {
        long first = (long)table[k0 / bs] * bs;
        const char *page = (const char *)vc + (first * row_stride + h * D) * E;
        long nk = L - k0 < bs ? L - k0 : bs;
        if (!Q8) {
            values_rows(s + k0 * Rp, Rp, R, (const float *)page, nk, row_stride, orow, k0 == 0, D);
            continue;
        }
        const nk_half *vsc = vs + (first * Hkv + h) * 2;
        for (long j0 = 0; j0 < nk; j0 += VCHUNK) {
            long c = nk - j0 < VCHUNK ? nk - j0 : VCHUNK;
            widen_page(page + j0 * row_stride, vsc + j0 * 2 * Hkv, 0, c, row_stride, Hkv, 0, 1, D, VCHUNK, vf_, vsf,
                       vzf); /* this head's rows: the page pointer is at head h already */
            for (long j = 0; j < c; j++) {
                float *pj = s + (k0 + j0 + j) * Rp;
                vf f = splat(vsf[j]), z = splat(vzf[j]);
                for (long r0 = 0; r0 < Rp; r0 += VW) {
                    vf pv = loadv(pj + r0), pz = pv * z;
                    OPAQUE(pz); /* rounded, then added: as weighted_values_g's chain */
                    storev(zs + r0, loadv(zs + r0) + pz);
                    storev(pj + r0, pv * f);
                }
            }
            values_rows_q8(s + (k0 + j0) * Rp, Rp, R, vf_, c, D, orow, k0 == 0 && j0 == 0, D);
        }
    }
    for (long r = 0; r < R; r++) {
        vf f = splat(inv[r]), z = splat(zs[r]);
        for (long d = 0; d < D; d += VW) storev_part(orow[r] + d, (loadv_part(orow[r] + d, D - d) + z) * f, D - d);
    }
}

/* the float32 and the int8 copies of the tile and decode kernels */
static void attend_tile_f32(const float *q, const void *kc, const void *vc, const int32_t *table, long t0, long n,
                            long c0, long h, long Hq, long G, long D, long bs, long row_stride, float scale,
                            float *out, float *s, float *qt) {
    attend_tile_g(q, kc, vc, 0, 0, table, t0, n, c0, h, Hq, G, D, bs, row_stride, scale, out, s, qt, 0);
}

static void attend_tile_q8(const float *q, const void *kc, const void *vc, const nk_half *ks, const nk_half *vs,
                           const int32_t *table, long t0, long n, long c0, long h, long Hq, long G, long D, long bs,
                           long row_stride, float scale, float *out, float *s, float *qt) {
    attend_tile_g(q, kc, vc, ks, vs, table, t0, n, c0, h, Hq, G, D, bs, row_stride, scale, out, s, qt, 1);
}

/* ---- one query alone (decodes, short prefill runs) ---------------------------------------
 * float32 pages: dot products across the head dims in vector lanes, softmax normalized
 * before the values. int8 pages: exactly the prefill tiles' arithmetic (attend_tile_g),
 * so that a token's output has the same bits whether it runs alone or in a tile of any
 * size. Its K/V in the later layers are quantized from that output, and a one-ulp
 * difference there moves a value across a rounding boundary of the int8 step (1/254 of
 * the head's range): the same request would give other tokens with its prefix cached, or
 * with its chunks cut elsewhere. So, per (row, key), the dot product in order over d,
 * times scale * key scale plus key zero * scale * sum(q); the softmax's sum in key order;
 * the values' sums in key order, normalized at the end. */

/* int8: o[i][j] (rows L apart, c of the 16 lanes kept) = score of query row i (qr, D apart)
 * against the 16 keys of the transposed panel kt ([D][16]), f the keys' scale * scale_k,
 * z their zeros, qsum the rows' scale * sum(q): the operations of score_block, keys and
 * rows swapped (an FMA's product does not depend on its order) */
static inline __attribute__((always_inline)) void key_panel_scores(const float *qr, long D, const float *kt,
                                                                   const float *f, const float *z,
                                                                   const float *qsum, float *o, long L, long c,
                                                                   const int NB) {
    vf a[KB][NV];
    for (int i = 0; i < NB; i++)
        for (int v = 0; v < NV; v++) a[i][v] = splat(0);
    for (long d = 0; d < D; d++) {
        vf wv[NV];
        for (int v = 0; v < NV; v++) wv[v] = loadv(kt + d * 16 + v * VW);
        for (int i = 0; i < NB; i++) {
            vf b = splat(qr[i * D + d]);
            for (int v = 0; v < NV; v++) a[i][v] = fmadd(b, wv[v], a[i][v]);
        }
    }
    for (int i = 0; i < NB; i++) {
        float row[16];
        vf qs = splat(qsum[i]);
        for (int v = 0; v < NV; v++) storev(row + v * VW, q8_score(a[i][v], loadv(f + v * VW), loadv(z + v * VW), qs));
        memcpy(o + i * L, row, sizeof(float) * c);
    }
}

/* int8: s[(h - h0) * G + g][t] (rows L apart) = the scores of query heads [h0 * G, h1 * G)
 * against the first L cached keys, as the tiles compute them; 16 keys of a KV head at a
 * time are widened and transposed (pack_rows) into lanes, the query rows broadcast */
static void scores_q8(const float *q, long G, long D, long h0, long h1, const int8_t *kc, const nk_half *ks,
                      const int32_t *table, long L, long bs, long row_stride, float scale, float *s) {
    const long Hkv = row_stride / D;
    float kf[16 * D], kt[16 * D], qsum[G], f[16], z[16];
    for (long h = h0; h < h1; h++) {
        const float *qh = q + h * G * D;
        float *sh = s + (h - h0) * G * L;
        for (long r = 0; r < G; r++) qsum[r] = scale * row_sum(qh + r * D, D);
        for (long k0 = 0; k0 < L; k0 += bs) {
            long nk = L - k0 < bs ? L - k0 : bs, first = (long)table[k0 / bs] * bs; /* the page's first slot */
            const int8_t *page = kc + first * row_stride + h * D;
            const nk_half *pairs = ks + (first * Hkv + h) * 2;
            for (long j0 = 0; j0 < nk; j0 += 16) {
                long c = nk - j0 < 16 ? nk - j0 : 16;
                const float *rows[16];
                for (long i = 0; i < 16; i++) {
                    f[i] = i < c ? scale * (float)pairs[(j0 + i) * 2 * Hkv] : 0;
                    z[i] = i < c ? (float)pairs[(j0 + i) * 2 * Hkv + 1] : 0;
                }
                for (long i = 0; i < c; i++) {
                    for (long d = 0; d < D; d += 8)
                        store8(kf + i * D + d, widen8((const char *)(page + (j0 + i) * row_stride + d)));
                    rows[i] = kf + i * D;
                }
                pack_rows(rows, c, D, kt);
                for (long r0 = 0; r0 < G; r0 += KB) {
#define KEY_PANEL(NB) key_panel_scores(qh + r0 * D, D, kt, f, z, qsum + r0, sh + r0 * L + k0 + j0, L, c, NB)
                    SPECIALIZE(G - r0, KEY_PANEL)
#undef KEY_PANEL
                }
            }
        }
    }
}

/* s[0, L) <- exp(s - max) in place, as the tiles' softmax computes it (exp_any on every
 * key); returns 1 / their sum, taken in key order */
static float softmax_in_order(float *s, long L) {
    float mx = -INFINITY, sum = 0;
    for (long t = 0; t < L; t++) mx = s[t] > mx ? s[t] : mx;
    for (long t = 0; t < L; t += VW) {
        long n = L - t < VW ? L - t : VW;
        float x[VW] = {0};
        memcpy(x, s + t, sizeof(float) * n);
        storev(x, exp_any(loadv(x) - splat(mx)));
        memcpy(s + t, x, sizeof(float) * n);
    }
    for (long t = 0; t < L; t++) sum += s[t];
    return 1.0f / sum;
}

/* one query (heads h0..h1 of its KV heads) over its L cached tokens */
static void attend_one_f32(const float *qt, const void *kc, const void *vc, const int32_t *table, long L, long G,
                           long D, long h0, long h1, long bs, long row_stride, float scale, float *s, float *ot) {
    scores_f32(qt, G, D, h0, h1, kc, table, L, bs, row_stride, scale, s);
    for (long r = 0; r < (h1 - h0) * G; r++) {
        float inv = softmax_row(s + r * L, L);
        for (long j = 0; j < L; j++) s[r * L + j] *= inv;
    }
    weighted_values_g(s, G, D, h0, h1, vc, 0, table, L, bs, row_stride, ot, 0, 0, 0);
}

static void attend_one_q8(const float *qt, const void *kc, const void *vc, const nk_half *ks, const nk_half *vs,
                          const int32_t *table, long L, long G, long D, long h0, long h1, long bs, long row_stride,
                          float scale, float *s, float *ot, float *wide) {
    long rows = (h1 - h0) * G;
    float inv[rows];
    scores_q8(qt, G, D, h0, h1, kc, ks, table, L, bs, row_stride, scale, s);
    for (long r = 0; r < rows; r++) inv[r] = softmax_in_order(s + r * L, L);
    weighted_values_g(s, G, D, h0, h1, vc, vs, table, L, bs, row_stride, ot, wide, inv, 1);
}

/* Paged attention, one query token per row: query t (q [T, Hq, D]) belongs to the
 * sequence in row rows[t] of tables [B, width] and sees that sequence's first ctx[t]
 * cached tokens (a decode: the whole context; a prefill token at position p: p + 1, which
 * is causal masking). Caches [num_blocks, bs, Hkv, D], float32, or int8 with their float16
 * (scale, zero) pairs ks, vs [num_blocks, bs, Hkv, 2] (NULL for float32); out [T, Hq, D]. Keys and values
 * are read in place. Runs of consecutive prompt tokens of one sequence form tiles that
 * share their key/value reads (attend_tile); other queries (decodes) go one by one, all
 * heads at once. D must be a multiple of 8 (and at most 512), Hq a multiple of Hkv. */
void nk_paged_attention(const float *q, const void *kc, const void *vc, const nk_half *ks, const nk_half *vs,
                        const int32_t *tables, long width, const int32_t *rows, const int32_t *ctx, long T, long Hq,
                        long Hkv, long D, long bs, float scale, long max_len, float *out) {
    long G = Hq / Hkv, row_stride = Hkv * D;
    long tile_queries = TILE_ROWS / G > 0 ? TILE_ROWS / G : 1;
    /* work items: (first query, queries, first KV head, end KV head) */
    long *items = malloc(sizeof(long) * 4 * (T * Hkv + 1));
    long num_items = 0, singles = 0;
    for (long t = 0; t < T;) {
        long n = 1;
        while (n < tile_queries && t + n < T && rows[t + n] == rows[t] && ctx[t + n] == ctx[t] + n) n++;
        if (n >= 4 && G <= TILE_ROWS) {
            for (long h = 0; h < Hkv; h++) {
                long *it = items + 4 * num_items++;
                it[0] = t, it[1] = n, it[2] = h, it[3] = h + 1;
            }
        } else {
            for (long i = 0; i < n; i++) {
                long *it = items + 4 * num_items++;
                it[0] = t + i, it[1] = 1, it[2] = 0, it[3] = Hkv;
                singles++;
            }
        }
        t += n;
    }
    if (num_items < 4 * omp_get_max_threads() && singles == num_items && Hkv > 1) {
        /* a few long decodes: one item per (query, KV head) keeps every thread busy */
        num_items = 0;
        for (long t = 0; t < T; t++)
            for (long h = 0; h < Hkv; h++) {
                long *it = items + 4 * num_items++;
                it[0] = t, it[1] = 1, it[2] = h, it[3] = h + 1;
            }
    }
#pragma omp parallel
    {
        long rows_max = Hq > TILE_ROWS ? Hq : TILE_ROWS;
        float *s = malloc(sizeof(float) * rows_max * (max_len > 0 ? max_len : 1));
        float *qt = malloc(sizeof(float) * TILE_ROWS * D);
        float *wide = ks ? malloc(sizeof(float) * bs * (row_stride + 2 * Hkv)) : 0; /* an int8 page widened, its pairs */
        /* longest first: the runner orders sequences shortest first, and a long item
         * left for last keeps the other threads waiting at the barrier */
#pragma omp for schedule(dynamic, 1)
        for (long j = 0; j < num_items; j++) {
            long k = num_items - 1 - j;
            long t = items[4 * k], n = items[4 * k + 1], h0 = items[4 * k + 2], h1 = items[4 * k + 3];
            long L = ctx[t];
            const int32_t *table = tables + (long)rows[t] * width;
            if (n > 1) {
                if (ks)
                    attend_tile_q8(q, kc, vc, ks, vs, table, t, n, L, h0, Hq, G, D, bs, row_stride, scale, out, s, qt);
                else
                    attend_tile_f32(q, kc, vc, table, t, n, L, h0, Hq, G, D, bs, row_stride, scale, out, s, qt);
                continue;
            }
            float *ot = out + (t * Hq + h0 * G) * D;
            if (L <= 0) {
                memset(ot, 0, sizeof(float) * (h1 - h0) * G * D);
                continue;
            }
            if (ks)
                attend_one_q8(q + t * Hq * D, kc, vc, ks, vs, table, L, G, D, h0, h1, bs, row_stride, scale, s, ot, wide);
            else
                attend_one_f32(q + t * Hq * D, kc, vc, table, L, G, D, h0, h1, bs, row_stride, scale, s, ot);
        }
        free(s);
        free(qt);
        free(wide);
    }
    free(items);
}

/* ---- elementwise: RMSNorm (+ residual add), q/k norm + rotary ---------------------------
 * Written to round like the torch expressions they replace, operation for operation, so
 * multiply-add contraction is off here; only reduction orders differ. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

/* one row: out = w * (x * rsqrt(mean(x^2) + eps)) */
static inline void rmsnorm_row(const float *x, long H, const float *w, float eps, float *out) {
    vf acc = splat(0);
    long i = 0;
    for (; i + VW <= H; i += VW) {
        vf v = loadv(x + i);
        acc += v * v;
    }
    float ss = hsum(acc);
    for (; i < H; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)H + eps);
    i = 0;
    for (; i + VW <= H; i += VW) storev(out + i, loadv(w + i) * (loadv(x + i) * splat(r)));
    for (; i < H; i++) out[i] = w[i] * (x[i] * r);
}

/* residual == NULL: out = RMSNorm(x). Otherwise residual += x (in place), then
 * out = RMSNorm(residual). x, residual, out: [M, H]. */
void nk_rmsnorm(const float *x, float *residual, long M, long H, const float *w, float eps, float *out) {
#pragma omp parallel for schedule(static) if (M * H >= 32768)
    for (long m = 0; m < M; m++) {
        const float *xr = x + m * H;
        if (residual) {
            float *rr = residual + m * H;
            long i = 0;
            for (; i + VW <= H; i += VW) storev(rr + i, loadv(xr + i) + loadv(rr + i));
            for (; i < H; i++) rr[i] = xr[i] + rr[i];
            xr = rr;
        }
        rmsnorm_row(xr, H, w, eps, out + m * H);
    }
}

/* x [D] -> out [D]: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1) */
static inline void rope_row(const float *x, const float *c, const float *s, long D, float *out) {
    long half = D / 2;
    for (long i = 0; i < half; i++) out[i] = x[i] * c[i] + (-x[i + half]) * s[i];
    for (long i = half; i < D; i++) out[i] = x[i] * c[i] + x[i - half] * s[i];
}

/* qkv [T, (Hq + 2 Hkv) D] rows -> q [T, Hq, D], k [T, Hkv, D]: per-head RMSNorm when
 * qw / kw are given (Qwen3), then rotary with this token's cos, sin [T, D]. */
void nk_qk_norm_rope(const float *qkv, long T, long Hq, long Hkv, long D, const float *qw,
                     const float *kw, float eps, const float *cos, const float *sin, float *q,
                     float *k) {
    long width = (Hq + 2 * Hkv) * D;
#pragma omp parallel for schedule(static) if (T * (Hq + Hkv) * D >= 32768)
    for (long t = 0; t < T; t++) {
        float tmp[D];
        const float *c = cos + t * D, *s = sin + t * D;
        for (long h = 0; h < Hq + Hkv; h++) {
            const float *x = qkv + t * width + h * D;
            const float *w = h < Hq ? qw : kw;
            float *o = h < Hq ? q + (t * Hq + h) * D : k + (t * Hkv + h - Hq) * D;
            if (w) {
                rmsnorm_row(x, D, w, eps, tmp);
                x = tmp;
            }
            rope_row(x, c, s, D, o);
        }
    }
}

#pragma GCC pop_options

/* ---- KV writes ---------------------------------------------------------------------------
 * One head's D values -> int8 q and its float16 (scale, zero), asymmetric, as
 * attention/base.py's quantize_kv computes them (the same bits): zero = (max + min) / 2
 * rounded to float16, scale = max |x - zero| / 127 rounded to float16, q = (x - zero) /
 * scale (the division, not a reciprocal's product) rounded to nearest even; a constant
 * head gets scale 0 and q 0. */
static void quantize_kv_row(const float *x, long D, int8_t *q, nk_half *params) {
    float hi = x[0], lo = x[0];
    for (long d = 1; d < D; d++) {
        hi = x[d] > hi ? x[d] : hi;
        lo = x[d] < lo ? x[d] : lo;
    }
    float zero = (float)(nk_half)((hi + lo) / 2), mx = 0;
    for (long d = 0; d < D; d++) mx = fabsf(x[d] - zero) > mx ? fabsf(x[d] - zero) : mx;
    float sc = (float)(nk_half)(mx / 127.0f);
    params[0] = (nk_half)sc, params[1] = (nk_half)zero;
    for (long d = 0; d < D; d++) {
        float y = sc > 0 ? nearbyintf((x[d] - zero) / sc) : 0.0f;
        q[d] = (int8_t)(y > 127 ? 127 : y < -127 ? -127 : y);
    }
}

/* Token t's k (row t of k, stride k_stride floats) and v (the same, v_stride) into cache
 * slot slots[t] of the caches [num_blocks, bs, Hkv, D]: copied (float32 caches, ks NULL),
 * or quantized per (token, KV head) with the pairs into ks, vs [num_blocks, bs, Hkv, 2]. */
void nk_store_kv(const float *k, long k_stride, const float *v, long v_stride, const int64_t *slots, long T,
                 long Hkv, long D, void *kc, void *vc, nk_half *ks, nk_half *vs) {
    long kv = Hkv * D;
    for (long t = 0; t < T; t++) {
        const float *kt = k + t * k_stride, *vt = v + t * v_stride;
        long slot = slots[t];
        if (!ks) {
            memcpy((float *)kc + slot * kv, kt, sizeof(float) * kv);
            memcpy((float *)vc + slot * kv, vt, sizeof(float) * kv);
            continue;
        }
        for (long h = 0; h < Hkv; h++) {
            quantize_kv_row(kt + h * D, D, (int8_t *)kc + slot * kv + h * D, ks + (slot * Hkv + h) * 2);
            quantize_kv_row(vt + h * D, D, (int8_t *)vc + slot * kv + h * D, vs + (slot * Hkv + h) * 2);
        }
    }
}

/* ---- one whole decoder layer (Llama family, one rank) in one call -----------------------
 * The same steps as the Python layer, kernel after kernel, without going back to Python
 * between them: per-step overhead is most of a small model's decode step otherwise. */
struct nk_layer {
    long H, Hq, Hkv, D, I, bs, fmt; /* fmt: the projections' weight format (NK_F32, ...) */
    float eps, scale;
    const float *input_norm, *post_norm, *q_norm, *k_norm; /* q/k norms may be NULL */
    const void *qkv; /* weights packed in format fmt, biases float32 */
    const float *qkv_bias;
    const void *o;
    const float *o_bias;
    const void *gate_up;
    const float *gate_up_bias;
    const void *down;
    const float *down_bias;
    void *k_cache, *v_cache; /* [num_blocks, bs, Hkv, D], float32, or int8 with ... */
    nk_half *k_scales, *v_scales; /* ... their (scale, zero) pairs [num_blocks, bs, Hkv, 2] (NULL: float32) */
};

struct nk_step {
    long T, width, max_len;
    const float *cos, *sin;                         /* [T, D] */
    const int64_t *slots;                           /* [T] cache slot of each new token */
    const int32_t *rows, *ctx, *tables;             /* paged attention (see nk_paged_attention) */
    float *normed, *qkv, *q, *k, *attn, *o, *act;   /* workspace, [T, *] each */
    /* The rows whose output the last layer must produce (NULL: all T), keep [keep_n],
     * ascending: only these go on from attention through o_proj and the MLP. */
    long keep_n;
    const int64_t *keep;
};

/* x [T, H] -> out [T, H] (may alias x); residual [T, H] in/out: first layer: residual = x.
 * The last layer with s->keep: out and residual [keep_n, H], the kept rows in order
 * (attention still runs for every row: it is a small share, and rows stay bit-identical). */
void nk_decoder_layer(const struct nk_layer *l, const struct nk_step *s, const float *x, float *residual,
                      int first, int last, float *out) {
    long T = s->T, H = l->H, qkv_width = (l->Hq + 2 * l->Hkv) * l->D, kv = l->Hkv * l->D, q_dim = l->Hq * l->D;
    if (first) {
        memcpy(residual, x, sizeof(float) * T * H);
        nk_rmsnorm(x, 0, T, H, l->input_norm, l->eps, s->normed);
    } else {
        nk_rmsnorm(x, residual, T, H, l->input_norm, l->eps, s->normed);
    }
    nk_linear(s->normed, T, H, l->qkv, l->fmt, qkv_width, l->qkv_bias, s->qkv);
    nk_qk_norm_rope(s->qkv, T, l->Hq, l->Hkv, l->D, l->q_norm, l->k_norm, l->eps, s->cos, s->sin, s->q, s->k);
    /* new K/V into their cache slots */
    nk_store_kv(s->k, kv, s->qkv + (l->Hq + l->Hkv) * l->D, qkv_width, s->slots, T, l->Hkv, l->D, l->k_cache,
                l->v_cache, l->k_scales, l->v_scales);
    nk_paged_attention(s->q, l->k_cache, l->v_cache, l->k_scales, l->v_scales, s->tables, s->width, s->rows, s->ctx,
                       T, l->Hq, l->Hkv, l->D, l->bs, l->scale, s->max_len, s->attn);
    if (last && s->keep) { /* compact the kept rows (keep ascending: r >= i) */
        for (long i = 0; i < s->keep_n; i++) {
            long r = s->keep[i];
            if (r == i) continue;
            memcpy(s->attn + i * q_dim, s->attn + r * q_dim, sizeof(float) * q_dim);
            memcpy(residual + i * H, residual + r * H, sizeof(float) * H);
        }
        T = s->keep_n;
        if (T == 0) return;
    }
    nk_linear(s->attn, T, q_dim, l->o, l->fmt, H, l->o_bias, s->o);
    nk_rmsnorm(s->o, residual, T, H, l->post_norm, l->eps, s->normed);
    nk_linear_silu_mul(s->normed, T, H, l->gate_up, l->fmt, l->I, l->gate_up_bias, s->act);
    nk_linear(s->act, T, l->I, l->down, l->fmt, H, l->down_bias, out);
}

/* ---- sampling (nanokv/layers/sampler.py): top candidates, and the full-vocabulary draw ----
 * Row by row (OpenMP over rows), each row's work in a per-thread scratch row that stays in
 * L2. Written to round like the torch expressions of sampler.py, operation for operation
 * (a product torch rounds before a subtraction goes through rounded(): no multiply-add);
 * the weights are exp2 to about an ulp, and sums differ from torch's in order (float32
 * blocks of SB weights, added in double). Candidates are exact: those of a full sort. */

#define SB 256 /* weights per block sum */

/* x as a rounded float32: an opaque value, which no multiply-add can absorb */
static inline float rounded(float x) {
    __asm__ volatile("" : "+m"(x));
    return x;
}

/* A float's bits as an int32 that orders like the float (-0 below +0, NaN above +inf). */
static inline int32_t fkey(float x) {
    int32_t b;
    memcpy(&b, &x, 4);
    return b ^ ((b >> 31) & 0x7fffffff);
}

static inline float unkey(int32_t k) {
    int32_t b = k ^ ((k >> 31) & 0x7fffffff);
    float x;
    memcpy(&x, &b, 4);
    return x;
}

static int32_t kth_largest_hoare(int32_t *a, long n, long k);

static inline int32_t median3(int32_t x, int32_t y, int32_t z) {
    int32_t lo = x < y ? x : y, hi = x < y ? y : x;
    return z < lo ? lo : z > hi ? hi : z;
}

/* The k-th largest (k >= 1) of a[0..n) (its contents clobbered). Up to 4096 items: rounds
 * of a branch-free three-way split into a second buffer (the larger ones from its front,
 * the smaller from its back, each item written to both sides and the index that counts
 * it moved on), about 3 cycles an item where a partition's branches mispredict half the
 * time; the rest, and beyond 4096, Hoare's quickselect. */
static int32_t kth_largest(int32_t *a, long n, long k) {
    enum { CAP = 4096 };
    if (n > CAP) return kth_largest_hoare(a, n, k);
    int32_t other[CAP], *base[2] = {a, other}, *src = a;
    int in = 0; /* src lies in base[in]; a round writes into the other buffer */
    while (n > 24) {
        int32_t *dst = base[1 - in], p = median3(src[0], src[n / 2], src[n - 1]);
        long g = 0, l = 0;
        for (long i = 0; i < n; i++) { /* greater from the front, smaller from the back */
            int32_t x = src[i];
            dst[g] = x;
            dst[n - 1 - l] = x;
            g += x > p;
            l += x < p;
        }
        if (k <= g) {
            src = dst, n = g;
        } else if (k <= n - l) {
            return p; /* among the equal ones (the pivot is one: every round drops it at least) */
        } else {
            k -= n - l;
            src = dst + n - l, n = l;
        }
        in = 1 - in;
    }
    return kth_largest_hoare(src, n, k);
}

/* The k-th largest (k >= 1) of a[0..n) (reordered): Hoare's quickselect. */
static int32_t kth_largest_hoare(int32_t *a, long n, long k) {
    long lo = 0, hi = n - 1, want = k - 1; /* a[want] once sorted descending */
    while (lo < hi) {
        int32_t p = a[lo + (hi - lo) / 2];
        long i = lo, j = hi;
        while (i <= j) {
            while (a[i] > p) i++;
            while (a[j] < p) j--;
            if (i <= j) {
                int32_t t = a[i];
                a[i++] = a[j];
                a[j--] = t;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return p;
    }
    return a[want];
}

/* the lanes of m that are set, as the low 8 bits of an int (lane 0 the lowest) */
static inline int mask_bits8(v8i m) {
#if defined(__AVX2__) && !defined(NK_PORTABLE)
    return _mm256_movemask_ps((__m256)m);
#else
    int bits = 0;
    for (int l = 0; l < 8; l++) bits |= (m[l] != 0) << l;
    return bits;
#endif
}

/* Appends to out (and id + i to ids, if ids) each key a[i], i in [0, n), that is >= t, in
 * order; returns the new count (from c). Eight keys at a time: few pass, so a mask of the
 * eight that do is walked bit by bit. */
static long keep_at_least(const int32_t *a, long id, long n, int32_t t, int32_t *out, int32_t *ids, long c) {
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        v8i v;
        memcpy(&v, a + i, 32);
        for (int bits = mask_bits8(v >= t); bits; bits &= bits - 1) {
            int l = __builtin_ctz(bits);
            out[c] = v[l];
            if (ids) ids[c] = (int32_t)(id + i + l);
            c++;
        }
    }
    for (; i < n; i++)
        if (a[i] >= t) {
            out[c] = a[i];
            if (ids) ids[c] = (int32_t)(id + i);
            c++;
        }
    return c;
}

struct cand { int32_t key, id; };

static int cand_cmp(const void *pa, const void *pb) {
    const struct cand *a = pa, *b = pb;
    if (a->key != b->key) return a->key < b->key ? 1 : -1;
    return (a->id > b->id) - (a->id < b->id);
}

/* The k best of n (key, id) items given in ascending id order (larger key first, then lower
 * id), sorted so, into out[0..k). tmp: n ints. */
/* c[0..n) sorted by larger key first, stably (insertion: for the few dozen items here) */
static void sort_cands(struct cand *c, long n) {
    for (long i = 1; i < n; i++) {
        struct cand x = c[i];
        long j = i - 1;
        while (j >= 0 && c[j].key < x.key) {
            c[j + 1] = c[j];
            j--;
        }
        c[j + 1] = x;
    }
}

static void select_best(const int32_t *keys, const int32_t *ids, long n, long k, int32_t *tmp, struct cand *out) {
    if (n <= k + k / 4 && n <= 80) { /* few more than k: sort them all, keep k */
        struct cand all[80];
        for (long i = 0; i < n; i++) all[i] = (struct cand){keys[i], ids ? ids[i] : (int32_t)i};
        sort_cands(all, n);
        memcpy(out, all, sizeof *out * (n < k ? n : k));
        return;
    }
    memcpy(tmp, keys, sizeof(int32_t) * n);
    int32_t t = kth_largest(tmp, n, k);
    long above = 0, got = 0;
    for (long i = 0; i < n; i++) above += keys[i] > t;
    long ties = k - above;
    for (long i = 0; i < n && got < k; i++) {
        if (keys[i] > t || (keys[i] == t && ties-- > 0)) out[got++] = (struct cand){keys[i], ids ? ids[i] : (int32_t)i};
    }
    if (k <= 64) /* items came in id order: the stable sort keeps ties lower id first */
        sort_cands(out, k);
    else
        qsort(out, k, sizeof *out, cand_cmp);
}

static inline int32_t block_max_key(const float *x, long B) {
    v8i m = {};
    m -= 0x7fffffff;
    m -= 1; /* INT32_MIN in every lane */
    for (long j = 0; j < B; j += 8) {
        v8i b;
        memcpy(&b, x + j, 32);
        b ^= (b >> 31) & 0x7fffffff;
        v8i gt = b > m;
        m = (b & gt) | (m & ~gt);
    }
    v8i h = __builtin_shufflevector(m, m, 4, 5, 6, 7, 0, 1, 2, 3), gt = h > m;
    m = (h & gt) | (m & ~gt);
    h = __builtin_shufflevector(m, m, 2, 3, 0, 1, 6, 7, 4, 5), gt = h > m;
    m = (h & gt) | (m & ~gt);
    return m[0] > m[1] ? m[0] : m[1];
}

/* One row's k largest logits, largest first (ties: lower id first), as sampler.py's
 * top_candidates: blocks of B, the k blocks with the largest maxima, then the best k of
 * those blocks and the ragged end (B == 0: of the whole row). work: 5 * V ints. */
static void top_row_given(const float *x, long V, long k, long B, int32_t *work, const int32_t *given, float *vals,
                          int64_t *ids);

static void top_row(const float *x, long V, long k, long B, int32_t *work, float *vals, int64_t *ids) {
    top_row_given(x, V, k, B, work, 0, vals, ids);
}

/* The blocks whose maxima may be among the k largest of mk[0..nb): (key, block) for each
 * key at or above a pivot taken from a sample a little below the k-th largest, in block
 * order (every block where nb is short or the sample misjudged). Returns how many (>= k). */
static long block_survivors(const int32_t *mk, long nb, long k, int32_t *sk, int32_t *sid) {
    enum { S = 128 };
    if (nb >= 8 * S && k <= nb / 16) {
        int32_t sample[S];
        for (long i = 0; i < S; i++) sample[i] = mk[i * (nb / S)];
        long r = 2 * k * S / nb + 4; /* expect ~2k survivors */
        long c = keep_at_least(mk, 0, nb, kth_largest(sample, S, r > S ? S : r), sk, sid, 0);
        if (c >= k) return c;
    }
    return keep_at_least(mk, 0, nb, INT32_MIN, sk, sid, 0);
}

/* top_row with the block maxima given (keys, [V / B]; NULL: found here). The few arrays a
 * row needs lie side by side at the start of work, so that they stay in L1 while the row
 * streams past. */
static void top_row_given(const float *x, long V, long k, long B, int32_t *work, const int32_t *given, float *vals,
                          int64_t *ids) {
    struct cand *best;
    if (B) {
        long nb = V / B, pool = (k + 1) * B, P = 0; /* pool: k blocks and the ragged end (< B) */
        int32_t *sk = work, *sid = sk + nb, *pk = sid + nb, *pid = pk + pool, *tmp = pid + pool,
                *mk = tmp + (nb > pool ? nb : pool); /* mk: nb ints, if not given */
        best = (struct cand *)(mk + nb);
        if (!given) {
            for (long b = 0; b < nb; b++) mk[b] = block_max_key(x + b * B, B);
            given = mk;
        }
        long c = block_survivors(given, nb, k, sk, sid);
        memcpy(tmp, sk, sizeof(int32_t) * c);
        int32_t t = kth_largest(tmp, c, k);
        long above = 0;
        for (long i = 0; i < c; i++) {
            above += sk[i] > t;
            if (sk[i] >= t) __builtin_prefetch(x + (long)sid[i] * B, 0, 3); /* the blocks read next */
        }
        long ties = k - above;
        /* the k chosen blocks each hold a key >= t, so the k best do too: only those join */
        for (long i = 0; i < c; i++) {
            if (!(sk[i] > t || (sk[i] == t && ties-- > 0))) continue;
            long j0 = (long)sid[i] * B;
            for (long j = 0; j < B; j += 8) { /* B: a multiple of 8; keep_at_least on the keys in registers */
                v8i v;
                memcpy(&v, x + j0 + j, 32);
                v ^= (v >> 31) & 0x7fffffff; /* fkey's, lane by lane */
                for (int bits = mask_bits8(v >= t); bits; bits &= bits - 1) {
                    int l = __builtin_ctz(bits);
                    pk[P] = v[l];
                    pid[P++] = (int32_t)(j0 + j + l);
                }
            }
        }
        for (long j = nb * B; j < V; j++) { /* the ragged end */
            int32_t kj = fkey(x[j]);
            pk[P] = kj;
            pid[P] = (int32_t)j;
            P += kj >= t;
        }
        select_best(pk, pid, P, k, tmp, best);
    } else {
        int32_t *pk = work, *tmp = work + V; /* V ints each */
        best = (struct cand *)(work + 2 * V);
        for (long j = 0; j < V; j++) pk[j] = fkey(x[j]);
        select_best(pk, 0, V, k, tmp, best);
    }
    for (long i = 0; i < k; i++) {
        vals[i] = unkey(best[i].key);
        ids[i] = best[i].id;
    }
}

/* vals, ids [n, k]: the k largest logits of each row rows[i] of logits [*, V] (rows NULL:
 * row i), largest first, ties lower id first. B: the block size (0: no blocks). */
void nk_top_candidates(const float *logits, long V, const int64_t *rows, long n, long k, long B, float *vals,
                       int64_t *ids) {
#pragma omp parallel if (n > 1)
    {
        int32_t *work = malloc(sizeof(int32_t) * 5 * V);
#pragma omp for schedule(dynamic, 4)
        for (long i = 0; i < n; i++) {
            long r = rows ? rows[i] : i;
            top_row(logits + r * V, V, k, B, work, vals + i * k, ids + i * k);
        }
        free(work);
    }
}

/* whether any lane of a mask is set: a movemask where the ISA has one (the reduction of
 * shuffles it replaces was a third of exp2_neg's cost) */
static inline int any_lane(vi m) {
#if VW == 16 && defined(__AVX512F__) && !defined(NK_PORTABLE)
    return _mm512_test_epi32_mask((__m512i)m, (__m512i)m) != 0;
#else
#if VW == 16
    v8i a = __builtin_shufflevector(m, m, 0, 1, 2, 3, 4, 5, 6, 7) | __builtin_shufflevector(m, m, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    v8i a = m;
#endif
#if defined(__AVX2__) && !defined(NK_PORTABLE)
    return _mm256_movemask_ps((__m256)a) != 0;
#else
    a |= __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3);
    a |= __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5);
    return (a[0] | a[1]) != 0;
#endif
#endif
}

/* 2^f for f in [-1/2, 1/2]: a degree-6 fit, relative error 2e-9 (an ulp is 6e-8); p(0) = 1 */
static inline vf exp2_poly(vf f) {
    vf p = splat(1.5337576956435538e-04f);
    p = p * f + splat(1.3399860363225973e-03f);
    p = p * f + splat(9.618519533915487e-03f);
    p = p * f + splat(5.550328997516871e-02f);
    p = p * f + splat(2.4022646608717138e-01f);
    p = p * f + splat(6.93147205600511e-01f);
    return p * f + splat(1.0f);
}

/* 2^t for t <= 0 (0 below -150 and for -inf), to about an ulp: 2^n * p(f), n = round(t);
 * below 2^-126, 2^n is applied as two factors so that the result rounds once to a
 * subnormal, as exp2f's does. 2^-k is exact. */
static inline vf exp2_neg(vf t) {
    vi low = t < splat(-126.0f);
    if (!any_lane(low)) {
        vi n = __builtin_convertvector(t - splat(0.5f), vi); /* t <= 0: truncation rounds half away from 0 */
        vi bits = (n + 127) << 23;
        vf s;
        memcpy(&s, &bits, sizeof s);
        return exp2_poly(t - __builtin_convertvector(n, vf)) * s;
    }
    vi below = t < splat(-150.0f);
    t = selectv(below, splat(-150.0f), t);
    vi n = __builtin_convertvector(t - splat(0.5f), vi);
    vf p = exp2_poly(t - __builtin_convertvector(n, vf));
    vi n1 = n >> 1, n2 = n - n1; /* each >= -75 */
    vf s1, s2;
    vi b1 = (n1 + 127) << 23, b2 = (n2 + 127) << 23;
    memcpy(&s1, &b1, sizeof s1);
    memcpy(&s2, &b2, sizeof s2);
    return (vf)((vi)(p * s1 * s2) & ~below);
}

/* e[j] = 2^((x[j] - m) * scale), bs[b] the float sum of block b of SB; returns the total */
static double weights_row(const float *x, long V, float m, float scale, float *e, float *bs) {
    double total = 0;
    for (long b0 = 0, b = 0; b0 < V; b0 += SB, b++) {
        long end = b0 + SB < V ? b0 + SB : V, j = b0;
        vf acc = splat(0);
        for (; j + VW <= end; j += VW) {
            vf w = exp2_neg((loadv(x + j) - splat(m)) * splat(scale));
            storev(e + j, w);
            acc += w;
        }
        float s = hsum(acc);
        for (; j < end; j++) {
            vf w = exp2_neg(splat((x[j] - m) * scale));
            e[j] = w[0];
            s += w[0];
        }
        bs[b] = s;
        total += s;
    }
    return total;
}

static float block_sum(const float *e, long b0, long end) {
    vf acc = splat(0);
    long j = b0;
    for (; j + VW <= end; j += VW) acc += loadv(e + j);
    float s = hsum(acc);
    for (; j < end; j++) s += e[j];
    return s;
}

/* The helpers of a draw past the candidates read a row's weights as e[j] * f[b], b = j / SB:
 * e relative to its block (fused_row's; f[b] = 0 for a block of no weight), or the row's
 * own (weights_row's, every f[b] 1); ssum[b] is the sum of block b of e, bs[b] = ssum[b] *
 * f[b] its weight. A weight wt is compared within block b as e against wt / f[b], in the
 * block of the token it came from (own, own_e: that token's e) against own_e itself. */
static inline float block_threshold(const float *f, long b, float wt, long own, float own_e) {
    return b == own ? own_e : wt / f[b];
}

/* zero every weight at or below wt, refresh ssum and bs; the total */
static double zero_up_to(float *e, long V, const float *f, float wt, long own, float own_e, float *ssum, float *bs) {
    double total = 0;
    for (long b0 = 0, b = 0; b0 < V; b0 += SB, b++) {
        long end = b0 + SB < V ? b0 + SB : V, j = b0;
        if (f[b] == 0) {
            bs[b] = 0;
            continue;
        }
        float t = block_threshold(f, b, wt, own, own_e);
        for (; j + VW <= end; j += VW) {
            vf w = loadv(e + j);
            storev(e + j, (vf)((vi)w & (w > splat(t))));
        }
        for (; j < end; j++) e[j] = e[j] > t ? e[j] : 0;
        ssum[b] = block_sum(e, b0, end);
        bs[b] = ssum[b] * f[b];
        total += bs[b];
    }
    return total;
}

/* Whether the tokens that weigh more than wt, with cw more, weigh less than limit: as the
 * float sum of their weight plus cw, against limit (the sum block by block, in double), but
 * decided as soon as the blocks seen settle it: their weight already reaches the limit (the
 * rest only adds), or even all of the rest (bs, each block's weight) could not reach it,
 * with a margin (1e-4) past the rounding of block sums taken in another order. The same
 * answer as the whole sum, mostly after a part of the row. */
static int above_under(const float *e, long V, const float *f, const float *bs, float wt, long own, float own_e,
                       float cw, float limit) {
    long nbk = (V + SB - 1) / SB;
    double total = 0, rest = 0;
    for (long b = 0; b < nbk; b++) rest += bs[b];
    for (long b0 = 0, b = 0; b0 < V; b0 += SB, b++) {
        rest -= bs[b];
        if (f[b] == 0) continue;
        long end = b0 + SB < V ? b0 + SB : V, j = b0;
        float t = block_threshold(f, b, wt, own, own_e);
        vf acc = splat(0);
        for (; j + VW <= end; j += VW) {
            vf w = loadv(e + j);
            acc += (vf)((vi)w & (w > splat(t)));
        }
        float s = hsum(acc);
        for (; j < end; j++) s += e[j] > t ? e[j] : 0;
        total += s * f[b];
        if ((float)total + cw >= limit) return 0;
        if (total + 1.0001 * (rest > 0 ? rest : 0) + cw < 0.9999 * limit) return 1;
    }
    return (float)total + cw < limit;
}

/* The first token (id order) whose running weight exceeds target; past the total, the last
 * token of positive weight (0 if none). */
static long locate_row(const float *e, long V, const float *f, const float *bs, double target) {
    double acc = 0;
    long b0 = 0, b = 0;
    for (; b0 < V && acc + bs[b] <= target; b0 += SB, b++) acc += bs[b];
    for (long j = b0; j < V; j++) {
        float w = e[j] * f[j / SB];
        acc += w;
        if (acc > target && w > 0) return j;
    }
    for (long j = V - 1; j > 0; j--)
        if (e[j] * f[j / SB] > 0) return j;
    return 0;
}

/* splitmix64 of (key, draw): sampler.py's seeded_uniform, bit for bit */
static inline float nk_uniform(uint64_t key, long draw) {
    uint64_t x = key + (uint64_t)(draw + 1) * 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return (float)((x ^ (x >> 31)) >> 40) / 16777216.0f;
}

/* The rest of a draw past the candidates w, cum, cids [c] (sampler.py's _draw_past_candidates):
 * rest located among the other tokens (e, f, ssum, bs: their weights as above, the
 * candidates' zeroed) in id order; a token that top_p or min_p (< 0: off) drops is rejected
 * and the row drawn again among the tokens more likely than it, candidates first (the
 * uniforms nk_uniform(key, 1, 2, ...)). z: the weight of the row. */
static long draw_past(float *e, long V, const float *f, float *ssum, float *bs, float rest, float z, const float *w,
                      const float *cum, const int64_t *cids, long c, float top_p, float min_p, uint64_t key) {
    for (long draw = 1;; draw++) {
        long pick = locate_row(e, V, f, bs, rest), own = pick / SB;
        float own_e = e[pick], wt = own_e * f[own];
        int ok = wt > 0;
        if (ok && top_p < 1) {
            float cw = 0;
            for (long q = 0; q < c; q++) cw += w[q] > wt ? w[q] : 0;
            ok = above_under(e, V, f, bs, wt, own, own_e, cw, top_p * z);
        }
        if (ok && min_p >= 0) ok = wt >= min_p;
        if (ok) return pick;
        /* every token as likely as a rejected one is dropped too: draw again above it */
        float rest_w = (float)zero_up_to(e, V, f, wt, own, own_e, ssum, bs), cw = 0;
        for (long q = 0; q < c; q++) cw += w[q] > wt ? w[q] : 0;
        float target = rounded(nk_uniform(key, draw) * (cw + rest_w));
        if (target < cw) {
            long q = 0;
            while (q < c - 1 && !(cum[q] > target)) q++;
            return cids[q];
        }
        rest = target - cw;
    }
}

/* a where a > b, else b, lane by lane (NaN in a: b): vmaxps's rule, one instruction with AVX */
static inline v8 max8(v8 a, v8 b) {
#if defined(__AVX2__) && !defined(NK_PORTABLE)
    return _mm256_max_ps(a, b);
#else
    v8i gt = a > b;
    return (v8)(((v8i)a & gt) | ((v8i)b & ~gt));
#endif
}

/* 2^t for t in [-126, 0] (a block whose weights are all normal floats): 2^n * p(f), n the
 * nearest integer (the 1.5 * 2^23 trick: t + M holds it in its low bits), p of degree 5,
 * relative error 1.7e-7 in float32. No range test per vector: the caller checked the block.
 * M is 1.5 * 2^23 + 128, so those bits shifted into the exponent are 2^(n + 1) with no bias
 * to add, and p's coefficients are halved to match: the same result, bit for bit. */
static inline vf exp2_block(vf t) {
    const float M = 12583040.0f;
    vf r = t + splat(M);
    vf f = t - (r - splat(M));
    vi bits;
    memcpy(&bits, &r, sizeof bits);
    bits <<= 23;
    vf s;
    memcpy(&s, &bits, sizeof s);
    vf p = splat(0.5f * 1.326472731307149e-03f);
    p = p * f + splat(0.5f * 9.671512991189957e-03f);
    p = p * f + splat(0.5f * 5.550733581185341e-02f);
    p = p * f + splat(0.5f * 2.4022242426872253e-01f);
    p = p * f + splat(0.5f * 6.931470036506653e-01f);
    return (p * f + splat(0.5f)) * s;
}

static inline v8 min8(v8 a, v8 b) { /* a where a < b, else b: vminps's rule */
#if defined(__AVX2__) && !defined(NK_PORTABLE)
    return _mm256_min_ps(a, b);
#else
    v8i lt = a < b;
    return (v8)(((v8i)a & lt) | ((v8i)b & ~lt));
#endif
}

/* lane q: the largest lane of v[q] (no NaN), by three rounds of pairwise maxima */
static inline v8 block_maxima8(const v8 *v) {
    v8 c[4], d[2];
    for (int q = 0; q < 4; q++)
        c[q] = max8(__builtin_shufflevector(v[2 * q], v[2 * q + 1], 0, 8, 2, 10, 4, 12, 6, 14),
                    __builtin_shufflevector(v[2 * q], v[2 * q + 1], 1, 9, 3, 11, 5, 13, 7, 15));
    for (int q = 0; q < 2; q++) /* lanes: v[4q..4q+3]'s over their halves */
        d[q] = max8(__builtin_shufflevector(c[2 * q], c[2 * q + 1], 0, 1, 8, 9, 4, 5, 12, 13),
                    __builtin_shufflevector(c[2 * q], c[2 * q + 1], 2, 3, 10, 11, 6, 7, 14, 15));
    return max8(__builtin_shufflevector(d[0], d[1], 0, 1, 2, 3, 8, 9, 10, 11),
                __builtin_shufflevector(d[0], d[1], 4, 5, 6, 7, 12, 13, 14, 15));
}

#define FUSED_AHEAD (8 * SB) /* floats: the exp work of a block hides the fetch of one 8 blocks on */

/* One read of a row for what a draw with top_k off needs first: the keys of its blocks' maxima
 * (blocks of B, B a power of two dividing SB: mk [V / B], top_row's) and its weight
 * sum_j 2^((x_j - m) * scale), m the row's largest logit: each block of SB is weighed
 * against its own largest logit mb while it is in L1 (e[j] = 2^((x_j - mb) * scale)), its
 * sum then weighed 2^((mb - m) * scale). smax, ssum: a float each per SB block. A block
 * whose weights are all normal floats (known from its smallest logit) takes exp2_block,
 * the others exp2_neg; the exp work hides the fetch of the row further on (prefetched). */
static double fused_row(const float *x, long V, long B, float scale, int32_t *mk, float *smax, float *ssum,
                        float *e) {
    float m = -INFINITY;
    for (long b0 = 0, b = 0; b0 < V; b0 += SB, b++) {
        long end = b0 + SB < V ? b0 + SB : V, j = b0;
        v8 mx = (v8){} - INFINITY, mn = (v8){} + INFINITY, any = {};
        if (B == 32 && end - b0 == SB) { /* 8 blocks of 32: their maxima reduced side by side */
            v8 bms[8];
            for (int q = 0; q < 8; q++, j += 32) {
                v8 v0 = load8(x + j), v1 = load8(x + j + 8), v2 = load8(x + j + 16), v3 = load8(x + j + 24);
                any += (v0 + v1) + (v2 + v3);
                v8 bm = max8(max8(v3, v2), max8(v1, v0)), bn = min8(min8(v3, v2), min8(v1, v0)); /* ties: the first */
                bms[q] = bm;
                mx = max8(bm, mx);
                mn = min8(bn, mn);
            }
            v8 h = block_maxima8(bms);
            v8i k;
            memcpy(&k, &h, 32);
            k ^= (k >> 31) & 0x7fffffff; /* fkey's, lane by lane */
            memcpy(mk + b0 / 32, &k, 32);
            for (int bits = mask_bits8(h == (v8){}); bits; bits &= bits - 1) { /* a zero: -0 beside +0? */
                int l = __builtin_ctz(bits);
                mk[b0 / 32 + l] = block_max_key(x + b0 + 32 * l, 32);
            }
        }
        for (; j + B <= end; j += B) { /* the full blocks of B: their maxima */
            v8 bm = load8(x + j), bn = bm;
            any += bm;
            for (long i = 8; i < B; i += 8) {
                v8 v = load8(x + j + i);
                any += v; /* NaN from a NaN (or from infinities of both signs) */
                bm = max8(v, bm);
                bn = min8(v, bn);
            }
            v8 h = max8(__builtin_shufflevector(bm, bm, 4, 5, 6, 7, 0, 1, 2, 3), bm);
            h = max8(__builtin_shufflevector(h, h, 2, 3, 0, 1, 6, 7, 4, 5), h);
            float f = h[0] > h[1] ? h[0] : h[1];
            /* a zero maximum may be -0 beside a +0: the keys decide */
            mk[j / B] = f == 0 ? block_max_key(x + j, B) : fkey(f);
            mx = max8(bm, mx);
            mn = min8(bn, mn);
        }
        if (mask_bits8(any != any)) /* maybe a NaN, which ranks above +inf: every key of the block exact */
            for (long q = b0; q + B <= j; q += B) mk[q / B] = block_max_key(x + q, B);
        float mb = mx[0], lo = mn[0];
        for (int i = 1; i < 8; i++) {
            mb = mx[i] > mb ? mx[i] : mb;
            lo = mn[i] < lo ? mn[i] : lo;
        }
        for (; j < end; j++) { /* the ragged end of the row */
            mb = x[j] > mb ? x[j] : mb;
            lo = x[j] < lo ? x[j] : lo;
        }
        smax[b] = mb;
        m = mb > m ? mb : m;
        if (mb == -INFINITY) { /* nothing to weigh in this block (and no NaN from -inf - -inf) */
            memset(e + b0, 0, sizeof(float) * (end - b0));
            ssum[b] = 0;
            continue;
        }
        vf acc = splat(0);
        j = b0;
        if ((lo - mb) * scale >= -126.0f) { /* false for a NaN too */
            for (; j + VW <= end; j += VW) {
                __builtin_prefetch(x + j + FUSED_AHEAD, 0, 3);
                vf w = exp2_block((loadv(x + j) - splat(mb)) * splat(scale));
                storev(e + j, w);
                acc += w;
            }
        } else {
            for (; j + VW <= end; j += VW) {
                __builtin_prefetch(x + j + FUSED_AHEAD, 0, 3);
                vf w = exp2_neg((loadv(x + j) - splat(mb)) * splat(scale));
                storev(e + j, w);
                acc += w;
            }
        }
        float sb = hsum(acc);
        for (; j < end; j++) sb += e[j] = exp2_neg(splat((x[j] - mb) * scale))[0];
        ssum[b] = sb;
    }
    double total = 0;
    for (long b = 0; b * SB < V; b++)
        if (ssum[b] > 0) total += ssum[b] * exp2_neg(splat((smax[b] - m) * scale))[0];
    return total;
}

/* The factors f[b] = 2^((mb - m) * scale) that make fused_row's block-relative weights the
 * row's (token j weighs e[j] * f[j / SB]), and bs[b] = ssum[b] * f[b], each block's weight:
 * they sum to fused_row's total, product for product. */
static void block_factors(const float *smax, const float *ssum, long nbk, float m, float scale, float *f, float *bs) {
    for (long b = 0; b < nbk; b++) {
        f[b] = ssum[b] > 0 ? exp2_neg(splat((smax[b] - m) * scale))[0] : 0;
        bs[b] = ssum[b] * f[b];
    }
}

/* A row whose draw is past its c candidates whatever they are: every weight is at most 1
 * (the largest), so c candidates weigh at most c; when top_p's share of the row's weight z
 * (all of it, top_p off) exceeds that and so does the first uniform's u * z, neither top-p
 * nor the draw can end inside them (min_p off: it could cut them short). Such a row (flat
 * distributions: a high temperature, random logits) draws among all its tokens in id
 * order, without finding its candidates; the same draw, exactly, as far as the
 * distribution goes (sampler.py's flat rows do the same). */
static inline int flat_row(float z, float u, long c, long V, float top_p, float min_p) {
    return min_p <= 0 && c < V && (top_p < 1 ? top_p * z > c : z > c) && rounded(u * z) >= c;
}

/* One token for each of the n rows rows[i] (NULL: i) of logits [*, V] with top_k off, and
 * z[i], the weight of its row: sampler.py's sample_rows for such rows, whole. Its first
 * uniform: u[i], or (u NULL or u[i] NaN: a seeded row) nk_uniform(keys[i], 0). A flat row
 * (flat_row) draws among all its tokens. Otherwise its c candidates (top_row, blocks of B)
 * weighted w = 2^((logit - max) * scale[i]); top_p and min_p (NULL: off) cut inside them,
 * or the first uniform lands in them: the token is a candidate; else the draw goes on past
 * them (draw_past, its later uniforms from keys[i]). Where B divides SB the row is read
 * once, for its block maxima and its block-relative weights (fused_row), which a draw past
 * the candidates walks; else weights_row weighs it. A row's token is a function of the row,
 * its settings and its uniforms alone. */
void nk_sample_rows(const float *logits, long V, const int64_t *rows, long n, long c, long B, const float *scale,
                    const float *u, const int64_t *keys, const float *top_p, const float *min_p, float *z,
                    int64_t *tokens) {
    long nbk = (V + SB - 1) / SB;
#pragma omp parallel if (n > 1)
    {
        int32_t *work = malloc(sizeof(int32_t) * 5 * V);
        float *e = malloc(sizeof(float) * (V + 4 * nbk + 3 * c)), *bs = e + V, *vals = bs + nbk, *w = vals + c,
              *cum = w + c, *sx = cum + c, *ssum = sx + nbk, *f = ssum + nbk; /* sx, ssum, f: fused_row's */
        int32_t *mk = malloc(sizeof(int32_t) * (B > 0 ? V / B + 1 : 1));
        int64_t *ids = malloc(sizeof(int64_t) * c);
        int fused = B > 0 && SB % B == 0;
        if (!fused)
            for (long b = 0; b < nbk; b++) f[b] = 1;
#pragma omp for schedule(dynamic, 1)
        for (long i = 0; i < n; i++) {
            const float *x = logits + (rows ? rows[i] : i) * V;
            float p = top_p ? top_p[i] : 1, mp = min_p ? min_p[i] : -1, zf = 0;
            float ui = u && !isnan(u[i]) ? u[i] : nk_uniform((uint64_t)keys[i], 0); /* a seeded row's own */
            if (fused) {
                zf = (float)fused_row(x, V, B, scale[i], mk, sx, ssum, e);
                if (flat_row(zf, ui, c, V, p, mp)) { /* no candidates: the draw walks every token */
                    float m = -INFINITY;
                    for (long b = 0; b < nbk; b++) m = sx[b] > m ? sx[b] : m;
                    block_factors(sx, ssum, nbk, m, scale[i], f, bs);
                    z[i] = zf;
                    tokens[i] = draw_past(e, V, f, ssum, bs, rounded(ui * zf), zf, w, cum, ids, 0, p, mp,
                                          (uint64_t)keys[i]);
                    continue;
                }
                top_row_given(x, V, c, B, work, mk, vals, ids);
            } else {
                top_row(x, V, c, B, work, vals, ids);
            }
            float m = vals[0];
            double acc = 0;
            long q0 = 0;
            for (; q0 + VW <= c; q0 += VW) /* lane by lane the same as one at a time */
                storev(w + q0, exp2_neg((loadv(vals + q0) - splat(m)) * splat(scale[i])));
            for (; q0 < c; q0++) w[q0] = exp2_neg(splat((vals[q0] - m) * scale[i]))[0];
            for (long q = 0; q < c; q++) cum[q] = (float)(acc += w[q]);
            float cand = cum[c - 1], before_last = cand - w[c - 1];
            int cut = c >= V || w[c - 1] == 0 || w[c - 1] < mp; /* the kept set ends inside the candidates */
            if (!fused) {
                zf = (float)weights_row(x, V, m, scale[i], e, bs);
                memcpy(ssum, bs, sizeof(float) * nbk);
                if (flat_row(zf, ui, c, V, p, mp)) {
                    z[i] = zf;
                    tokens[i] = draw_past(e, V, f, ssum, bs, rounded(ui * zf), zf, w, cum, ids, 0, p, mp,
                                          (uint64_t)keys[i]);
                    continue;
                }
            }
            int inside = cut || (p < 1 && before_last >= p * zf);
            float uz = rounded(ui * zf);
            z[i] = zf;
            if (!inside && uz >= cand) { /* past the candidates */
                if (fused) block_factors(sx, ssum, nbk, m, scale[i], f, bs);
                for (long q = 0; q < c; q++) e[ids[q]] = 0; /* the tokens past the candidates */
                uint64_t seen[nbk / 64 + 1];
                memset(seen, 0, sizeof seen);
                for (long q = 0; q < c; q++) { /* their blocks' sums again, once each */
                    long b = ids[q] / SB;
                    if (seen[b / 64] >> (b % 64) & 1) continue;
                    seen[b / 64] |= 1ull << (b % 64);
                    ssum[b] = block_sum(e, b * SB, (b + 1) * SB < V ? (b + 1) * SB : V);
                    bs[b] = ssum[b] * f[b];
                }
                tokens[i] = draw_past(e, V, f, ssum, bs, uz - cand, zf, w, cum, ids, c, p, mp, (uint64_t)keys[i]);
                continue;
            }
            long kept_n = 0; /* every option keeps a prefix */
            for (long q = 0; q < c; q++) kept_n += w[q] > 0 && (p >= 1 || cum[q] - w[q] < p * zf) && w[q] >= mp;
            float kept = cum[kept_n - 1], limit = inside ? kept : cand;
            float target = ui * (inside ? kept : zf);
            float t = fminf(target, nextafterf(limit, 0));
            long q = 0;
            while (q < c - 1 && !(cum[q] > t)) q++;
            tokens[i] = ids[q];
        }
        free(ids);
        free(mk);
        free(e);
        free(work);
    }
}

/* out[i]: the index of the largest of row i of x [n, V] (the first of equals; the first NaN,
 * which torch's argmax takes as the largest): torch.argmax(x, dim=1), read once a row (a
 * row's maximum is found 32 floats at a time, then its first occurrence in the block of 256
 * that holds it). */
void nk_argmax_rows(const float *x, long n, long V, int64_t *out) {
#pragma omp parallel for schedule(static) if (n * V >= (1L << 20))
    for (long i = 0; i < n; i++) {
        const float *r = x + i * V;
        float m = -INFINITY;
        long at = -1, j = 0; /* at: the block of SB holding m's first occurrence */
        int nan = 0;
        for (long b0 = 0; b0 < V && !nan; b0 += SB) {
            long end = b0 + SB < V ? b0 + SB : V;
            v8 a0 = (v8){} - INFINITY, a1 = a0, a2 = a0, a3 = a0;
            v8i bad = {};
            for (j = b0; j + 32 <= end; j += 32) {
                v8 v0 = load8(r + j), v1 = load8(r + j + 8), v2 = load8(r + j + 16), v3 = load8(r + j + 24);
                bad |= (v0 != v0) | (v1 != v1) | (v2 != v2) | (v3 != v3);
                a0 = max8(v0, a0), a1 = max8(v1, a1), a2 = max8(v2, a2), a3 = max8(v3, a3);
            }
            a0 = max8(max8(a0, a1), max8(a2, a3));
            float bm = a0[0];
            for (int l = 1; l < 8; l++) bm = a0[l] > bm ? a0[l] : bm;
            for (; j < end; j++) {
                bad[0] |= -(r[j] != r[j]);
                bm = r[j] > bm ? r[j] : bm;
            }
            nan = mask_bits8(bad) != 0;
            if (nan || bm > m || at < 0) {
                m = bm > m ? bm : m;
                at = nan || bm >= m ? b0 : at;
            }
        }
        long end = at + SB < V ? at + SB : V, k = at;
        if (nan) {
            while (r[k] == r[k]) k++; /* the block holds a NaN */
        } else {
            while (k < end - 1 && !(r[k] == m)) k++; /* m is in the block (-0 equals +0: the first) */
        }
        out[i] = k;
    }
}

/* For the n rows rows[i] (NULL: i) of logits [*, V]: lse[i], the log-sum-exp (max + log of
 * the sum of 2^((logit - max) * log2(e))), above[i], how many logits exceed picked[i], and
 * (k > 0) its k largest logits and their ids (vals, ids [n, k], top_row with blocks of B),
 * found first so that the row is in cache for the sum. */
void nk_logprobs(const float *logits, long V, const int64_t *rows, long n, const float *picked, long k, long B,
                 float *lse, int64_t *above, float *vals, int64_t *ids) {
#pragma omp parallel if (n > 1)
    {
        int32_t *work = k > 0 ? malloc(sizeof(int32_t) * 5 * V) : 0;
#pragma omp for schedule(static)
        for (long i = 0; i < n; i++) {
            const float *x = logits + (rows ? rows[i] : i) * V;
            float m = -INFINITY;
            long j = 0;
            if (k > 0) {
                top_row(x, V, k, B, work, vals + i * k, ids + i * k);
                m = vals[i * k];
            } else {
                vf mv = splat(-INFINITY);
                for (; j + VW <= V; j += VW) {
                    vf v = loadv(x + j);
                    mv = selectv(v > mv, v, mv);
                }
                for (int q = 0; q < VW; q++) m = mv[q] > m ? mv[q] : m;
                for (; j < V; j++) m = x[j] > m ? x[j] : m;
            }
            const float scale = 1.44269504088896341f, p = picked[i];
            double total = 0;
            long count = 0;
            for (long b0 = 0; b0 < V; b0 += SB) {
                long end = b0 + SB < V ? b0 + SB : V;
                vf acc = splat(0);
                vi cnt = {};
                for (j = b0; j + VW <= end; j += VW) {
                    vf v = loadv(x + j);
                    acc += exp2_neg((v - splat(m)) * splat(scale));
                    cnt -= v > splat(p);
                }
                float s = hsum(acc);
                for (int q = 0; q < VW; q++) count += cnt[q];
                for (; j < end; j++) {
                    s += exp2_neg(splat((x[j] - m) * scale))[0];
                    count += x[j] > p;
                }
                total += s;
            }
            lse[i] = m + logf((float)total);
            above[i] = count;
        }
        free(work);
    }
}
