/* GEMMs on float32, bfloat16 and int8w panels (int8 ones: gemm_int8.c), the calls of every
 * format, and embedding rows read from the packed panels. */
#include "gemm.h"

/* rows per register tile (float32 / bfloat16 weights): 6 x 2 accumulators of 16 ymm
 * registers at width 8; 8 x 1 of 32 zmm at width 16 (not tuned on AVX-512 hardware) */
#define MR (VW == 16 ? 8 : 6)

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

/* ---- the calls --------------------------------------------------------------------------- */

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
    nk_gemm_q8(&g, glu);
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
struct embed_call {
    const int64_t *ids;
    const void *w;
    int fmt;
    long K;
    float *out;
};

static void embed_task(void *ctx, struct nk_team *team) {
    const struct embed_call *c = ctx;
    const int64_t *ids = c->ids;
    const void *w = c->w;
    int fmt = c->fmt;
    long K = c->K, panel_bytes = nk_panel_bytes(fmt, K), nb = nk_q8_padded_k(K) / QB;
    float *out = c->out;
    for (long t0, t1; nk_next(team, &t0, &t1);)
        for (long t = t0; t < t1; t++) {
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
                    const int8_t *q =
                        (const int8_t *)panel + (k / QB) * Q8_BLOCK_BYTES + (k % QB) / 4 * 64 + j * 4 + k % 4;
                    o[k] = (float)*q * scale;
                }
            }
        }
}

void nk_embed(const int64_t *ids, long T, const void *w, int fmt, long K, float *out) {
    struct embed_call c = {ids, w, fmt, K, out};
    nk_parallel(T, nk_chunk(T), T * K >= 65536, embed_task, &c);
}
