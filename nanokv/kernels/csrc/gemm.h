/* What gemm.c and gemm_int8.c share: one call's struct, the tile signature, the epilogues
 * and the walk over the panels.
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
#ifndef NK_GEMM_H
#define NK_GEMM_H

#include "common.h"

/* ---- GEMM: out[M, N] = x[M, K] @ W^T (+ bias) -----------------------------------------
 * W is packed in panels of NR output columns (zero padded past N), one panel's K rows
 * contiguous: float32 wp[p][k][j] = W[p * NR + j][k], bfloat16 the same in 16-bit words
 * (columns in the order of load_bf16_row), int8 in blocks of 32 k (below). One panel
 * stays in L1/L2 while every row block of x streams past it; x itself stays in L2 for the
 * small M this is used for. */

#define MC 192                /* rows of x per pass over the weights: the block of x stays in L2 */

/* One call: what every tile of it reads. */
struct gemm {
    const float *x;                    /* float32 activations [M, K] */
    const int8_t *qx; const float *sx; /* int8 weights: x quantized, [M, Kp] and [M, Kp / QB] */
    const int32_t *ox;                 /* and 128 * each block's sum of qx, [M, Kp / QB] */
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

/* ---- int8 weights ----------------------------------------------------------------------
 * Panel layout: K is padded to Kp, a multiple of QB = 32; for each block of 32 k, 8 groups
 * of 4 k, each 16 columns x 4 bytes (column j's 4 weights adjacent: what a VNNI dot product
 * reads); after the last block, the 16 column scales (float32). An activation row is
 * quantized in blocks of QB, each with its own scale. Nothing else is stored: every byte of
 * a panel is read at batch 1, where reading is the whole cost. */
#define QB 32
#define Q8_BLOCK_BYTES (QB * NR)

/* Every packed panel against every row of x: panel p writes output columns
 * [p * cols, p * cols + cols) of out and reads bias + p * NR. Panels are split across
 * threads in chunks of consecutive panels; within a chunk the first row block of a panel
 * streams in the next panel (weights come from memory at decode batch sizes), the others
 * find this one in cache. A single row prefetches nothing: its panels go by one read each,
 * in order, which the hardware prefetcher follows better alone (measured: batch-1 int8
 * decode 10-20% faster without; a batch of 16, 5-20% slower). */
struct panels_call {
    const tile_fn *fn;
    int mr;
    const struct gemm *g;
    long panels;
};

static void panels_task(void *ctx, struct nk_team *team) {
    const struct panels_call *c = ctx;
    const struct gemm *g = c->g;
    const tile_fn *fn = c->fn;
    long panels = c->panels, M = g->M, mr = c->mr;
    for (long p0, p1; nk_next(team, &p0, &p1);)
        for (long m0 = 0; m0 < M; m0 += MC) {
            long m1 = m0 + MC < M ? m0 + MC : M;
            for (long p = p0; p < p1; p++) {
                const char *w = g->w + p * g->panel_bytes;
                int ncols = (int)(g->n - p * g->cols < g->cols ? g->n - p * g->cols : g->cols);
                const float *b = g->bias ? g->bias + p * NR : 0;
                const char *pf = M > 1 && p + 1 < panels ? w + g->panel_bytes : 0;
                float *o = g->out + p * g->cols;
                long m = m0;
                for (; m + mr <= m1; m += mr, pf = 0) fn[mr](g, m, w, pf, o + m * g->n, ncols, b);
                if (m < m1) fn[m1 - m](g, m, w, pf, o + m * g->n, ncols, b);
            }
        }
}

static void run_panels(const tile_fn *fn, int mr, const struct gemm *g) {
    struct panels_call c = {fn, mr, g, (g->n + g->cols - 1) / g->cols};
    nk_parallel(c.panels, nk_chunk(c.panels), 1, panels_task, &c);
}

/* gemm_int8.c: the int8 GEMM of one call (g as nk_linear fills it; Kp, qx, sx its own) */
NK_INTERNAL void nk_gemm_q8(struct gemm *g, int glu);

#endif
