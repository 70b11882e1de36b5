/* nanokv CPU kernels (float32): GEMMs on weights packed once at load time (the gate/up
 * one with SiLU * up in its epilogue), paged attention that reads the KV pages in place
 * through the block tables, RMSNorm with the residual add, q/k norm with rotary, and a
 * whole decoder layer chaining them in one call.
 *
 * Built at first use by nanokv/kernels/__init__.py with the machine's C compiler
 * (-O3 -march=native -fopenmp) and called through ctypes on tensors' data pointers.
 * OpenMP resolves to the libgomp torch already loaded, so both share one thread pool.
 *
 * A GEMM output element is summed in a fixed order (sequential over K), whatever the
 * batch size, the row's position in the batch or the thread count.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  /* unaligned access */
typedef int32_t v8i __attribute__((vector_size(32)));

#define NR 16 /* output columns per packed weight panel */

static inline v8 load8(const float *p) { return *(const v8u *)p; }
static inline void store8(float *p, v8 v) { *(v8u *)p = v; }
static inline v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }
static inline v8 select8(v8i m, v8 a, v8 b) { return (v8)(((v8i)a & m) | ((v8i)b & ~m)); } /* m ? a : b */

/* exp for any x (clamped to [-87, 88]): 2^n * p(f), n = round(x / ln2) */
static inline v8 exp_any(v8 x) {
    const v8 lo = splat(-87.0f), hi = splat(88.0f);
    v8i below = x < lo, above = x > hi;
    x = (v8)(((v8i)x & ~below) | ((v8i)lo & below));
    x = (v8)(((v8i)x & ~above) | ((v8i)hi & above));
    v8 t = x * splat(1.44269504088896341f);
    v8i neg = t < splat(0.0f);
    v8 half = (v8)(((v8i)splat(0.5f) & ~neg) | ((v8i)splat(-0.5f) & neg));
    v8i n = __builtin_convertvector(t + half, v8i); /* round half away from zero */
    v8 nf = __builtin_convertvector(n, v8);
    v8 f = x - nf * splat(0.693145751953125f) - nf * splat(1.428606765330187045e-06f);
    v8 p = splat(1.0f / 5040);
    p = p * f + splat(1.0f / 720);
    p = p * f + splat(1.0f / 120);
    p = p * f + splat(1.0f / 24);
    p = p * f + splat(1.0f / 6);
    p = p * f + splat(0.5f);
    p = p * f + splat(1.0f);
    p = p * f + splat(1.0f);
    v8i e = n + 127; /* n in [-126, 127] after the clamp */
    v8i bits = e << 23;
    v8 scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* ---- GEMM: out[M, N] = x[M, K] @ W^T (+ bias) -----------------------------------------
 * wp is W packed in panels of NR output columns: wp[p][k][j] = W[p * NR + j][k] (zero
 * padded past N). One panel (K * 64 bytes) stays in L1/L2 while every row block of x
 * streams past it; x itself stays in L2 for the small M this is used for. */

/* a0[r], a1[r] = x[r] . (the panel's columns 0-7, 8-15), r < MR, summed over k in order;
 * pf: the next panel, prefetched a line per k (NULL: nothing to prefetch). Two copies of
 * the k loop, so that the hot one carries no prefetch test (measured: 25-30% faster). */
#define ACCUMULATE_K(MR)                                                                    \
    {                                                                                       \
        v8 w0 = load8(wp + k * NR), w1 = load8(wp + k * NR + 8);                            \
        for (int r = 0; r < MR; r++) {                                                      \
            v8 xb = splat(x[r * K + k]);                                                    \
            a0[r] += xb * w0;                                                               \
            a1[r] += xb * w1;                                                               \
        }                                                                                   \
    }
#define ACCUMULATE(MR)                                                                      \
    v8 a0[MR], a1[MR];                                                                      \
    for (int r = 0; r < MR; r++) a0[r] = a1[r] = splat(0.0f);                               \
    if (pf) {                                                                               \
        _Pragma("GCC unroll 4") for (long k = 0; k < K; k++) {                              \
            __builtin_prefetch(pf + k * NR, 0, 3);                                          \
            ACCUMULATE_K(MR)                                                                \
        }                                                                                   \
    } else {                                                                                \
        _Pragma("GCC unroll 4") for (long k = 0; k < K; k++) ACCUMULATE_K(MR)               \
    }

#define KERNEL_ARGS                                                                         \
    const float *restrict x, long K, const float *restrict wp, const float *pf,            \
        float *restrict out, long ldo, int ncols, const float *restrict bias

/* plain GEMM tile: out[r][0, ncols) = a0|a1 (+ bias) */
#define DEFINE_GEMM_KERNEL(MR)                                                              \
    static void gemm_##MR(KERNEL_ARGS) {                                                    \
        ACCUMULATE(MR)                                                                      \
        for (int r = 0; r < MR; r++) {                                                      \
            float *o = out + r * ldo;                                                       \
            if (ncols == NR) {                                                              \
                store8(o, bias ? a0[r] + load8(bias) : a0[r]);                              \
                store8(o + 8, bias ? a1[r] + load8(bias + 8) : a1[r]);                      \
                continue;                                                                   \
            }                                                                               \
            float tmp[NR];                                                                  \
            store8(tmp, a0[r]);                                                             \
            store8(tmp + 8, a1[r]);                                                         \
            for (int j = 0; j < ncols; j++) o[j] = bias ? tmp[j] + bias[j] : tmp[j];        \
        }                                                                                   \
    }

/* Gate/up tile with SiLU(gate) * up in the epilogue: lanes 0-7 of the panel are gate
 * rows, lanes 8-15 the matching up rows (bias packed the same way), so one tile computes
 * both halves and the [M, 2I] intermediate is never written. */
#define DEFINE_GLU_KERNEL(MR)                                                               \
    static void glu_##MR(KERNEL_ARGS) {                                                     \
        ACCUMULATE(MR)                                                                      \
        for (int r = 0; r < MR; r++) {                                                      \
            v8 g = a0[r], u = a1[r];                                                        \
            if (bias) {                                                                     \
                g += load8(bias);                                                           \
                u += load8(bias + 8);                                                       \
            }                                                                               \
            v8 o = g / (splat(1.0f) + exp_any(-g)) * u;                                     \
            if (ncols == 8) {                                                               \
                store8(out + r * ldo, o);                                                   \
            } else {                                                                        \
                for (int j = 0; j < ncols; j++) out[r * ldo + j] = o[j];                    \
            }                                                                               \
        }                                                                                   \
    }

DEFINE_GEMM_KERNEL(1)
DEFINE_GEMM_KERNEL(2)
DEFINE_GEMM_KERNEL(3)
DEFINE_GEMM_KERNEL(4)
DEFINE_GEMM_KERNEL(5)
DEFINE_GEMM_KERNEL(6)
DEFINE_GLU_KERNEL(1)
DEFINE_GLU_KERNEL(2)
DEFINE_GLU_KERNEL(3)
DEFINE_GLU_KERNEL(4)
DEFINE_GLU_KERNEL(5)
DEFINE_GLU_KERNEL(6)

typedef void (*tile_fn)(KERNEL_ARGS);
static const tile_fn GEMM[7] = {0, gemm_1, gemm_2, gemm_3, gemm_4, gemm_5, gemm_6};
static const tile_fn GLU[7] = {0, glu_1, glu_2, glu_3, glu_4, glu_5, glu_6};

#define MC 192 /* rows of x per pass over the weights: the block of x stays in L2 */

/* Every packed panel against every row of x: panel p writes output columns
 * [p * cols, p * cols + cols) of out [M, n] (cols = 16 for a GEMM, 8 for gate/up) and
 * reads bias + p * NR. Panels are split across threads; the first row block of a panel
 * streams in the next panel (weights come from memory at decode batch sizes), the
 * others find this one in cache. */
static void run_panels(const tile_fn *fn, const float *x, long M, long K, const float *wp, long n, long cols,
                       const float *bias, float *out) {
    long panels = (n + cols - 1) / cols;
#pragma omp parallel
    for (long m0 = 0; m0 < M; m0 += MC) {
        long m1 = m0 + MC < M ? m0 + MC : M;
#pragma omp for schedule(static) nowait
        for (long p = 0; p < panels; p++) {
            const float *w = wp + p * K * NR;
            int ncols = (int)(n - p * cols < cols ? n - p * cols : cols);
            const float *b = bias ? bias + p * NR : 0;
            const float *pf = p + 1 < panels ? w + K * NR : 0;
            long m = m0;
            for (; m + 6 <= m1; m += 6, pf = 0) fn[6](x + m * K, K, w, pf, out + m * n + p * cols, n, ncols, b);
            if (m < m1) fn[m1 - m](x + m * K, K, w, pf, out + m * n + p * cols, n, ncols, b);
        }
    }
}

/* out[M, N] = x[M, K] @ W^T (+ bias [N]) */
void nk_linear(const float *x, long M, long K, const float *wp, long N, const float *bias, float *out) {
    run_panels(GEMM, x, M, K, wp, N, NR, bias, out);
}

/* out[M, I] = silu(x Wg^T + bg) * (x Wu^T + bu); wp, bias from pack_gate_up */
void nk_linear_silu_mul(const float *x, long M, long K, const float *wp, long I, const float *bias, float *out) {
    run_panels(GLU, x, M, K, wp, I, 8, bias, out);
}

/* ---- paged decode attention ----------------------------------------------------------- */

static inline float hsum(v8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* Pages sit anywhere in the pool, so the hardware prefetcher cannot guess the next one:
 * while a page is read, the next page of the table is prefetched, spread over the work
 * on this one: each inner iteration requests its share, a few lines (a burst of a whole
 * page of prefetches stalls on the miss buffers; measured: 20-30% more bandwidth). */
static inline void prefetch_page(const float *page, long floats) {
    for (long i = 0; i < floats; i += 16) __builtin_prefetch(page + i, 0, 3);
}

/* Scores of query heads [h0 * G, h1 * G) against the first L cached keys:
 * s[(h - h0) * G + g][t] = scale * q[h * G + g] . k_t[h]. Pages are read whole and in
 * order (KV heads h0..h1 of a row are adjacent); the next page is prefetched meanwhile. */
static void scores(const float *q, long G, long D, long h0, long h1, const float *kc,
                   const int32_t *table, long L, long bs, long row_stride, float scale, float *s) {
    for (long t0 = 0; t0 < L; t0 += bs) {
        const float *page = kc + (long)table[t0 / bs] * bs * row_stride;
        long n = L - t0 < bs ? L - t0 : bs;
        const float *next = t0 + bs < L ? kc + (long)table[t0 / bs + 1] * bs * row_stride : 0;
        long t = 0;
        for (; t + 4 <= n; t += 4) {
            const float *r0 = page + t * row_stride;
            long iters = (h1 - h0) * G, share = (4 * row_stride + 16 * iters - 1) / (16 * iters) * 16, done = 0;
            for (long h = h0; h < h1; h++) {
                const float *k0 = r0 + h * D, *k1 = k0 + row_stride;
                const float *k2 = k1 + row_stride, *k3 = k2 + row_stride;
                for (long g = 0; g < G; g++) {
                    if (next && done < 4 * row_stride) { /* this iteration's share of the next page */
                        long len = 4 * row_stride - done < share ? 4 * row_stride - done : share;
                        prefetch_page(next + t * row_stride + done, len);
                        done += len;
                    }
                    const float *qg = q + (h * G + g) * D;
                    v8 a0 = splat(0), a1 = splat(0), a2 = splat(0), a3 = splat(0);
                    for (long d = 0; d < D; d += 8) {
                        v8 qv = load8(qg + d);
                        a0 += qv * load8(k0 + d);
                        a1 += qv * load8(k1 + d);
                        a2 += qv * load8(k2 + d);
                        a3 += qv * load8(k3 + d);
                    }
                    float *sg = s + ((h - h0) * G + g) * L + t0 + t;
                    sg[0] = hsum(a0) * scale;
                    sg[1] = hsum(a1) * scale;
                    sg[2] = hsum(a2) * scale;
                    sg[3] = hsum(a3) * scale;
                }
            }
        }
        for (; t < n; t++) {
            for (long h = h0; h < h1; h++) {
                const float *k0 = page + t * row_stride + h * D;
                for (long g = 0; g < G; g++) {
                    v8 a0 = splat(0);
                    for (long d = 0; d < D; d += 8) a0 += load8(q + (h * G + g) * D + d) * load8(k0 + d);
                    s[((h - h0) * G + g) * L + t0 + t] = hsum(a0) * scale;
                }
            }
        }
    }
}

/* acc[(h - h0) * G + g] = sum_t p[(h - h0) * G + g][t] v_t[h]; a page (in L1 after its
 * first pass) is read once from memory, the next one prefetched meanwhile. */
static void weighted_values(const float *s, long G, long D, long h0, long h1, const float *vc,
                            const int32_t *table, long L, long bs, long row_stride, float *acc) {
    long rows = (h1 - h0) * G;
    memset(acc, 0, sizeof(float) * rows * D);
    for (long t0 = 0; t0 < L; t0 += bs) {
        const float *page = vc + (long)table[t0 / bs] * bs * row_stride;
        long n = L - t0 < bs ? L - t0 : bs;
        const float *next = t0 + bs < L ? vc + (long)table[t0 / bs + 1] * bs * row_stride : 0;
        for (long r = 0; r < rows; r++) {
            /* this row's share of the next page, a line per value row read */
            const float *pf = 0, *pf_end = 0;
            if (next) {
                long share = (bs * row_stride + 16 * rows - 1) / (16 * rows) * 16; /* whole lines */
                long from = r * share, to = from + share < bs * row_stride ? from + share : bs * row_stride;
                if (from < to) pf = next + from, pf_end = next + to;
            }
            const float *sg = s + r * L + t0;
            const float *vh = page + (h0 + r / G) * D;
            float *ag = acc + r * D;
            for (long d0 = 0; d0 < D; d0 += 32) { /* up to 4 accumulators in registers over the page */
                long w = D - d0 < 32 ? D - d0 : 32;
                v8 a0 = load8(ag + d0), a1 = w > 8 ? load8(ag + d0 + 8) : splat(0);
                v8 a2 = w > 16 ? load8(ag + d0 + 16) : splat(0), a3 = w > 24 ? load8(ag + d0 + 24) : splat(0);
                for (long j = 0; j < n; j++) {
                    const float *vr = vh + j * row_stride + d0;
                    if (pf < pf_end) {
                        __builtin_prefetch(pf, 0, 3);
                        pf += 16;
                    }
                    v8 p = splat(sg[j]);
                    a0 += p * load8(vr);
                    if (w > 8) a1 += p * load8(vr + 8);
                    if (w > 16) a2 += p * load8(vr + 16);
                    if (w > 24) a3 += p * load8(vr + 24);
                }
                store8(ag + d0, a0);
                if (w > 8) store8(ag + d0 + 8, a1);
                if (w > 16) store8(ag + d0 + 16, a2);
                if (w > 24) store8(ag + d0 + 24, a3);
            }
            if (pf < pf_end) prefetch_page(pf, pf_end - pf); /* what the reads did not cover */
        }
    }
}

/* softmax of s[0, L) in place; returns 1 / sum */
static float softmax_row(float *s, long L) {
    float mx = -INFINITY;
    for (long t = 0; t < L; t++) mx = s[t] > mx ? s[t] : mx;
    v8 acc = splat(0);
    long t = 0;
    for (; t + 8 <= L; t += 8) {
        v8 e = exp_any(load8(s + t) - splat(mx));
        store8(s + t, e);
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
 * rows, up to 6 keys x 16 rows of accumulators. The softmax then runs down the keys with
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

/* st[t][r] = scale * k_t . q_r for NB keys t (rows at row_stride) and the 16 rows of panel w */
static inline __attribute__((always_inline)) void score_block(const float *keys, long row_stride, long D,
                                                              const float *w, float scale, float *o, long Rp,
                                                              const int NB) {
    v8 a0[KB], a1[KB];
    for (int i = 0; i < NB; i++) a0[i] = a1[i] = splat(0);
    for (long d = 0; d < D; d++) {
        v8 w0 = load8(w + d * 16), w1 = load8(w + d * 16 + 8);
        for (int i = 0; i < NB; i++) {
            v8 b = splat(keys[i * row_stride + d]);
            a0[i] += b * w0;
            a1[i] += b * w1;
        }
    }
    for (int i = 0; i < NB; i++) {
        store8(o + i * Rp, a0[i] * splat(scale));
        store8(o + i * Rp + 8, a1[i] * splat(scale));
    }
}

/* st[t][r] = scale * k_t . q_r for the n keys of one page, r < Rp */
static void page_scores(const float *keys, long n, long row_stride, long D, const float *qt, long Rp,
                        float scale, float *st) {
    for (long p = 0; p < Rp / 16; p++)
        for (long t = 0; t < n; t += KB) {
#define SCORE_BLOCK(NB) score_block(keys + t * row_stride, row_stride, D, qt + p * D * 16, scale, st + t * Rp + p * 16, Rp, NB)
            SPECIALIZE(n - t, SCORE_BLOCK)
#undef SCORE_BLOCK
        }
}

/* out rows 0..NB-1 (orow), dims [d0, d0 + 8 * halves), += P V over the page's nk keys (p:
 * P^T at the page's first key and the block's first row, stride Rp); the first page starts
 * from zero */
static inline __attribute__((always_inline)) void value_block(const float *p, long Rp, const float *page, long nk,
                                                              long row_stride, float *const *orow, int first,
                                                              long d0, int halves, const int NB) {
    v8 a0[KB], a1[KB];
    for (int i = 0; i < NB; i++) {
        a0[i] = first ? splat(0) : load8(orow[i] + d0);
        a1[i] = first || halves < 2 ? splat(0) : load8(orow[i] + d0 + 8);
    }
    if (halves == 2) {
        for (long j = 0; j < nk; j++) {
            const float *vr = page + j * row_stride + d0, *pj = p + j * Rp;
            v8 w0 = load8(vr), w1 = load8(vr + 8);
            for (int i = 0; i < NB; i++) {
                v8 b = splat(pj[i]);
                a0[i] += b * w0;
                a1[i] += b * w1;
            }
        }
    } else {
        for (long j = 0; j < nk; j++) {
            v8 w0 = load8(page + j * row_stride + d0);
            for (int i = 0; i < NB; i++) a0[i] += splat(p[j * Rp + i]) * w0;
        }
    }
    for (int i = 0; i < NB; i++) {
        store8(orow[i] + d0, a0[i]);
        if (halves == 2) store8(orow[i] + d0 + 8, a1[i]);
    }
}

/* one prefill tile (queries t0..t0+n-1, contexts c0..c0+n-1) against KV head h;
 * s: L * Rp floats, qt: Rp * D floats (Rp = R rounded up to 16) */
static void attend_tile(const float *q, const float *kc, const float *vc, const int32_t *table, long t0,
                        long n, long c0, long h, long Hq, long G, long D, long bs, long row_stride,
                        float scale, float *out, float *s, float *qt) {
    const float *qr[TILE_ROWS];
    float *orow[TILE_ROWS];
    long R = n * G, L = c0 + n - 1, Rp = (R + 15) / 16 * 16;
    for (long i = 0; i < n; i++)
        for (long g = 0; g < G; g++) {
            qr[i * G + g] = q + ((t0 + i) * Hq + h * G + g) * D;
            orow[i * G + g] = out + ((t0 + i) * Hq + h * G + g) * D;
        }
    pack_rows(qr, R, D, qt);
    for (long k0 = 0; k0 < L; k0 += bs) {
        long nk = L - k0 < bs ? L - k0 : bs;
        page_scores(kc + (long)table[k0 / bs] * bs * row_stride + h * D, nk, row_stride, D, qt, Rp, scale,
                    s + k0 * Rp);
    }
    /* softmax down the keys, 8 rows per vector: row r sees the first c0 + r / G keys */
    float inv[TILE_ROWS];
    for (long r0 = 0; r0 < Rp; r0 += 8) {
        v8i seen;
        for (int i = 0; i < 8; i++) seen[i] = (int32_t)(c0 + (r0 + i) / G);
        v8 mx = splat(-INFINITY), sum = splat(0);
        for (long t = 0; t < L; t++) {
            v8 x = load8(s + t * Rp + r0);
            v8i live = (v8i){0, 0, 0, 0, 0, 0, 0, 0} + (int32_t)t < seen;
            mx = select8(live & (x > mx), x, mx);
        }
        for (long t = 0; t < L; t++) {
            v8i live = (v8i){0, 0, 0, 0, 0, 0, 0, 0} + (int32_t)t < seen;
            v8 e = exp_any(load8(s + t * Rp + r0) - mx);
            e = select8(live, e, splat(0));
            store8(s + t * Rp + r0, e);
            sum += e;
        }
        for (int i = 0; i < 8 && r0 + i < R; i++) inv[r0 + i] = 1.0f / sum[i];
    }
    /* O = P V, a page at a time; the sums go back to the output rows between pages */
    for (long k0 = 0; k0 < L; k0 += bs) {
        const float *page = vc + (long)table[k0 / bs] * bs * row_stride + h * D;
        long nk = L - k0 < bs ? L - k0 : bs;
        for (long r0 = 0; r0 < R; r0 += KB)
            for (long d0 = 0; d0 < D; d0 += 16) {
#define VALUE_BLOCK(NB) value_block(s + k0 * Rp + r0, Rp, page, nk, row_stride, orow + r0, k0 == 0, d0, D - d0 >= 16 ? 2 : 1, NB)
                SPECIALIZE(R - r0, VALUE_BLOCK)
#undef VALUE_BLOCK
            }
    }
    for (long r = 0; r < R; r++) {
        v8 f = splat(inv[r]);
        for (long d = 0; d < D; d += 8) store8(orow[r] + d, load8(orow[r] + d) * f);
    }
}

/* Paged attention, one query token per row: query t (q [T, Hq, D]) belongs to the
 * sequence in row rows[t] of tables [B, width] and sees that sequence's first ctx[t]
 * cached tokens (a decode: the whole context; a prefill token at position p: p + 1, which
 * is causal masking). Caches [num_blocks, bs, Hkv, D]; out [T, Hq, D]. Keys and values
 * are read in place. Runs of consecutive prompt tokens of one sequence form tiles that
 * share their key/value reads (attend_tile); other queries (decodes) go one by one, all
 * heads at once. D must be a multiple of 8 (and at most 512), Hq a multiple of Hkv. */
void nk_paged_attention(const float *q, const float *kc, const float *vc, const int32_t *tables,
                        long width, const int32_t *rows, const int32_t *ctx, long T, long Hq,
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
        /* longest first: the runner orders sequences shortest first, and a long item
         * left for last keeps the other threads waiting at the barrier */
#pragma omp for schedule(dynamic, 1)
        for (long j = 0; j < num_items; j++) {
            long k = num_items - 1 - j;
            long t = items[4 * k], n = items[4 * k + 1], h0 = items[4 * k + 2], h1 = items[4 * k + 3];
            long L = ctx[t];
            const int32_t *table = tables + (long)rows[t] * width;
            if (n > 1) {
                attend_tile(q, kc, vc, table, t, n, L, h0, Hq, G, D, bs, row_stride, scale, out, s, qt);
                continue;
            }
            float *ot = out + (t * Hq + h0 * G) * D;
            if (L <= 0) {
                memset(ot, 0, sizeof(float) * (h1 - h0) * G * D);
                continue;
            }
            scores(q + t * Hq * D, G, D, h0, h1, kc, table, L, bs, row_stride, scale, s);
            for (long r = 0; r < (h1 - h0) * G; r++) {
                float inv = softmax_row(s + r * L, L);
                for (long j = 0; j < L; j++) s[r * L + j] *= inv;
            }
            weighted_values(s, G, D, h0, h1, vc, table, L, bs, row_stride, ot);
        }
        free(s);
        free(qt);
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
    v8 acc = splat(0);
    long i = 0;
    for (; i + 8 <= H; i += 8) {
        v8 v = load8(x + i);
        acc += v * v;
    }
    float ss = hsum(acc);
    for (; i < H; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)H + eps);
    i = 0;
    for (; i + 8 <= H; i += 8) store8(out + i, load8(w + i) * (load8(x + i) * splat(r)));
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
            for (; i + 8 <= H; i += 8) store8(rr + i, load8(xr + i) + load8(rr + i));
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

/* ---- one whole decoder layer (Llama family, one rank) in one call -----------------------
 * The same steps as the Python layer, kernel after kernel, without going back to Python
 * between them: per-step overhead is most of a small model's decode step otherwise. */
struct nk_layer {
    long H, Hq, Hkv, D, I, bs;
    float eps, scale;
    const float *input_norm, *post_norm, *q_norm, *k_norm; /* q/k norms may be NULL */
    const float *qkv, *qkv_bias, *o, *o_bias, *gate_up, *gate_up_bias, *down, *down_bias;
    float *k_cache, *v_cache; /* [num_blocks, bs, Hkv, D] */
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
    nk_linear(s->normed, T, H, l->qkv, qkv_width, l->qkv_bias, s->qkv);
    nk_qk_norm_rope(s->qkv, T, l->Hq, l->Hkv, l->D, l->q_norm, l->k_norm, l->eps, s->cos, s->sin, s->q, s->k);
    for (long t = 0; t < T; t++) { /* new K/V into their cache slots */
        memcpy(l->k_cache + s->slots[t] * kv, s->k + t * kv, sizeof(float) * kv);
        memcpy(l->v_cache + s->slots[t] * kv, s->qkv + t * qkv_width + (l->Hq + l->Hkv) * l->D, sizeof(float) * kv);
    }
    nk_paged_attention(s->q, l->k_cache, l->v_cache, s->tables, s->width, s->rows, s->ctx, T, l->Hq, l->Hkv,
                       l->D, l->bs, l->scale, s->max_len, s->attn);
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
    nk_linear(s->attn, T, q_dim, l->o, H, l->o_bias, s->o);
    nk_rmsnorm(s->o, residual, T, H, l->post_norm, l->eps, s->normed);
    nk_linear_silu_mul(s->normed, T, H, l->gate_up, l->I, l->gate_up_bias, s->act);
    nk_linear(s->act, T, l->I, l->down, H, l->down_bias, out);
}
