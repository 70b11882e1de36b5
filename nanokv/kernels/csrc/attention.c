/* Paged attention: every query reads its sequence's K/V pages in place through the block
 * table, float32 or int8 pages; decodes one query at a time, runs of prompt tokens as
 * prefill tiles that share their key and value reads. nk_paged_attention at the end. */
#include "common.h"

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

struct attention_call {
    const float *q;
    const void *kc, *vc;
    const nk_half *ks, *vs;
    const int32_t *tables, *rows, *ctx;
    long width, Hq, Hkv, D, bs, max_len;
    float scale;
    float *out;
    const long *items;
    long num_items;
};

static void attention_task(void *arg, struct nk_team *team) {
    const struct attention_call *a = arg;
    const float *q = a->q;
    const void *kc = a->kc, *vc = a->vc;
    const nk_half *ks = a->ks, *vs = a->vs;
    const int32_t *tables = a->tables, *rows = a->rows, *ctx = a->ctx;
    long width = a->width, Hq = a->Hq, Hkv = a->Hkv, D = a->D, bs = a->bs, max_len = a->max_len;
    long G = Hq / Hkv, row_stride = Hkv * D, num_items = a->num_items;
    const long *items = a->items;
    float scale = a->scale, *out = a->out;
    long rows_max = Hq > TILE_ROWS ? Hq : TILE_ROWS;
    float *s = malloc(sizeof(float) * rows_max * (max_len > 0 ? max_len : 1));
    float *qt = malloc(sizeof(float) * TILE_ROWS * D);
    float *wide = ks ? malloc(sizeof(float) * bs * (row_stride + 2 * Hkv)) : 0; /* an int8 page widened, its pairs */
    /* longest first: the runner orders sequences shortest first, and a long item
     * left for last keeps the other threads waiting for it */
    for (long j0, j1; nk_next(team, &j0, &j1);)
        for (long j = j0; j < j1; j++) {
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
    long G = Hq / Hkv;
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
    if (num_items < 4 * nk_threads() && singles == num_items && Hkv > 1) {
        /* a few long decodes: one item per (query, KV head) keeps every thread busy */
        num_items = 0;
        for (long t = 0; t < T; t++)
            for (long h = 0; h < Hkv; h++) {
                long *it = items + 4 * num_items++;
                it[0] = t, it[1] = 1, it[2] = h, it[3] = h + 1;
            }
    }
    struct attention_call c = {q, kc, vc, ks, vs, tables, rows, ctx, width, Hq, Hkv, D, bs, max_len, scale, out,
                               items, num_items};
    nk_parallel(num_items, 1, 1, attention_task, &c);
    free(items);
}
