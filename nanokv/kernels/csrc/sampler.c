/* The sampler's row kernels (nanokv/layers/sampler.py): top candidates, the full-vocabulary
 * draw with top_k off, argmax and logprobs' statistics. */
#include "common.h"

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

/* ---- token masks: vLLM's packed bitmask (bit b of word w allows token 32 * w + b), applied
 * where a row is read: a banned token reads as -inf, a bit test per token in the same pass
 * (no pass that writes -inf first). m: the row's words, NULL for a row without a mask;
 * offsets j are from the row's start. The kernels see exactly the logits the tensor-ops
 * path's masked_fill leaves. */

/* row r's mask words: mask + idx[r] * W, or NULL (no mask, or idx[r] < 0) */
static inline const uint32_t *row_mask(const uint32_t *mask, long W, const int64_t *idx, long r) {
    return mask && idx[r] >= 0 ? mask + idx[r] * W : 0;
}

static inline v8 mask8(v8 v, const uint32_t *m, long j) { /* j: a multiple of 8 */
    if (!m) return v;
    int32_t bits = (int32_t)(m[j >> 5] >> (j & 31) & 0xff);
    if (bits == 0xff) return v;
    const v8i lanes = {1, 2, 4, 8, 16, 32, 64, 128};
    v8i keep = (((v8i){} + bits) & lanes) != 0;
    return (v8)(((v8i)v & keep) | ((v8i)((v8){} - INFINITY) & ~keep));
}

static inline v8 mload8(const float *x, const uint32_t *m, long j) { return mask8(load8(x + j), m, j); }

static inline vf mloadv(const float *x, const uint32_t *m, long j) { /* j: a multiple of VW */
    vf v = loadv(x + j);
    if (!m) return v;
    int32_t bits = (int32_t)(m[j >> 5] >> (j & 31) & ((1u << VW) - 1));
    if (bits == (1 << VW) - 1) return v;
#if VW == 8
    const vi lanes = {1, 2, 4, 8, 16, 32, 64, 128};
#else
    const vi lanes = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768};
#endif
    vi keep = (((vi){} + bits) & lanes) != 0;
    return selectv(keep, v, splat(-INFINITY));
}

static inline float mat(const float *x, const uint32_t *m, long j) {
    return !m || (m[j >> 5] >> (j & 31) & 1) ? x[j] : -INFINITY;
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

/* the largest key of x[j0, j0 + B) (masked by m) */
static inline int32_t block_max_key(const float *x, const uint32_t *mw, long j0, long B) {
    v8i m = {};
    m -= 0x7fffffff;
    m -= 1; /* INT32_MIN in every lane */
    for (long j = j0; j < j0 + B; j += 8) {
        v8i b = (v8i)mload8(x, mw, j);
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
static void top_row_given(const float *x, const uint32_t *m, long V, long k, long B, int32_t *work,
                          const int32_t *given, float *vals, int64_t *ids);

static void top_row(const float *x, const uint32_t *m, long V, long k, long B, int32_t *work, float *vals,
                    int64_t *ids) {
    top_row_given(x, m, V, k, B, work, 0, vals, ids);
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
 * streams past. m: the row's mask words (NULL: none). */
static void top_row_given(const float *x, const uint32_t *m, long V, long k, long B, int32_t *work,
                          const int32_t *given, float *vals, int64_t *ids) {
    struct cand *best;
    if (B) {
        long nb = V / B, pool = (k + 1) * B, P = 0; /* pool: k blocks and the ragged end (< B) */
        int32_t *sk = work, *sid = sk + nb, *pk = sid + nb, *pid = pk + pool, *tmp = pid + pool,
                *mk = tmp + (nb > pool ? nb : pool); /* mk: nb ints, if not given */
        best = (struct cand *)(mk + nb);
        if (!given) {
            for (long b = 0; b < nb; b++) mk[b] = block_max_key(x, m, b * B, B);
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
                v8i v = (v8i)mload8(x, m, j0 + j);
                v ^= (v >> 31) & 0x7fffffff; /* fkey's, lane by lane */
                for (int bits = mask_bits8(v >= t); bits; bits &= bits - 1) {
                    int l = __builtin_ctz(bits);
                    pk[P] = v[l];
                    pid[P++] = (int32_t)(j0 + j + l);
                }
            }
        }
        for (long j = nb * B; j < V; j++) { /* the ragged end */
            int32_t kj = fkey(mat(x, m, j));
            pk[P] = kj;
            pid[P] = (int32_t)j;
            P += kj >= t;
        }
        select_best(pk, pid, P, k, tmp, best);
    } else {
        int32_t *pk = work, *tmp = work + V; /* V ints each */
        best = (struct cand *)(work + 2 * V);
        for (long j = 0; j < V; j++) pk[j] = fkey(mat(x, m, j));
        select_best(pk, 0, V, k, tmp, best);
    }
    for (long i = 0; i < k; i++) {
        vals[i] = unkey(best[i].key);
        ids[i] = best[i].id;
    }
}

struct top_candidates_call {
    const float *logits;
    long V;
    const int64_t *rows;
    long n;
    long k;
    long B;
    float *vals;
    int64_t *ids;
    const uint32_t *mask;
    long W;
    const int64_t *midx;
};

static void top_candidates_task(void *arg, struct nk_team *team) {
    const struct top_candidates_call *a = arg;
    const float *logits = a->logits;
    long V = a->V;
    const int64_t *rows = a->rows;
    long k = a->k;
    long B = a->B;
    float *vals = a->vals;
    int64_t *ids = a->ids;
    const uint32_t *mask = a->mask;
    long W = a->W;
    const int64_t *midx = a->midx;
    int32_t *work = malloc(sizeof(int32_t) * 5 * V);
    for (long i0, i1; nk_next(team, &i0, &i1);)
        for (long i = i0; i < i1; i++) {
            long r = rows ? rows[i] : i;
            top_row(logits + r * V, row_mask(mask, W, midx, r), V, k, B, work, vals + i * k, ids + i * k);
        }
    free(work);
}

/* vals, ids [n, k]: the k largest logits of each row rows[i] of logits [*, V] (rows NULL:
 * row i), largest first, ties lower id first. B: the block size (0: no blocks). Token masks
 * (every entry point's last three arguments): logits row r reads through the W words
 * mask + midx[r] * W where midx[r] >= 0 (mask NULL: none). */
void nk_top_candidates(const float *logits, long V, const int64_t *rows, long n, long k, long B, float *vals,
                       int64_t *ids, const uint32_t *mask, long W, const int64_t *midx) {
    struct top_candidates_call a = {logits, V, rows, n, k, B, vals, ids, mask, W, midx};
    nk_parallel(n, 4, n > 1, top_candidates_task, &a);
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
static double weights_row(const float *x, const uint32_t *mw, long V, float m, float scale, float *e, float *bs) {
    double total = 0;
    for (long b0 = 0, b = 0; b0 < V; b0 += SB, b++) {
        long end = b0 + SB < V ? b0 + SB : V, j = b0;
        vf acc = splat(0);
        for (; j + VW <= end; j += VW) {
            vf w = exp2_neg((mloadv(x, mw, j) - splat(m)) * splat(scale));
            storev(e + j, w);
            acc += w;
        }
        float s = hsum(acc);
        for (; j < end; j++) {
            vf w = exp2_neg(splat((mat(x, mw, j) - m) * scale));
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
static double fused_row(const float *x, const uint32_t *mw, long V, long B, float scale, int32_t *mk, float *smax,
                        float *ssum, float *e) {
    float m = -INFINITY;
    for (long b0 = 0, b = 0; b0 < V; b0 += SB, b++) {
        long end = b0 + SB < V ? b0 + SB : V, j = b0;
        v8 mx = (v8){} - INFINITY, mn = (v8){} + INFINITY, any = {};
        if (B == 32 && end - b0 == SB) { /* 8 blocks of 32: their maxima reduced side by side */
            v8 bms[8];
            for (int q = 0; q < 8; q++, j += 32) {
                v8 v0 = mload8(x, mw, j), v1 = mload8(x, mw, j + 8), v2 = mload8(x, mw, j + 16),
                   v3 = mload8(x, mw, j + 24);
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
                mk[b0 / 32 + l] = block_max_key(x, mw, b0 + 32 * l, 32);
            }
        }
        for (; j + B <= end; j += B) { /* the full blocks of B: their maxima */
            v8 bm = mload8(x, mw, j), bn = bm;
            any += bm;
            for (long i = 8; i < B; i += 8) {
                v8 v = mload8(x, mw, j + i);
                any += v; /* NaN from a NaN (or from infinities of both signs) */
                bm = max8(v, bm);
                bn = min8(v, bn);
            }
            v8 h = max8(__builtin_shufflevector(bm, bm, 4, 5, 6, 7, 0, 1, 2, 3), bm);
            h = max8(__builtin_shufflevector(h, h, 2, 3, 0, 1, 6, 7, 4, 5), h);
            float f = h[0] > h[1] ? h[0] : h[1];
            /* a zero maximum may be -0 beside a +0: the keys decide */
            mk[j / B] = f == 0 ? block_max_key(x, mw, j, B) : fkey(f);
            mx = max8(bm, mx);
            mn = min8(bn, mn);
        }
        if (mask_bits8(any != any)) /* maybe a NaN, which ranks above +inf: every key of the block exact */
            for (long q = b0; q + B <= j; q += B) mk[q / B] = block_max_key(x, mw, q, B);
        float mb = mx[0], lo = mn[0];
        for (int i = 1; i < 8; i++) {
            mb = mx[i] > mb ? mx[i] : mb;
            lo = mn[i] < lo ? mn[i] : lo;
        }
        for (; j < end; j++) { /* the ragged end of the row */
            float xj = mat(x, mw, j);
            mb = xj > mb ? xj : mb;
            lo = xj < lo ? xj : lo;
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
                vf w = exp2_block((mloadv(x, mw, j) - splat(mb)) * splat(scale));
                storev(e + j, w);
                acc += w;
            }
        } else {
            for (; j + VW <= end; j += VW) {
                __builtin_prefetch(x + j + FUSED_AHEAD, 0, 3);
                vf w = exp2_neg((mloadv(x, mw, j) - splat(mb)) * splat(scale));
                storev(e + j, w);
                acc += w;
            }
        }
        float sb = hsum(acc);
        for (; j < end; j++) sb += e[j] = exp2_neg(splat((mat(x, mw, j) - mb) * scale))[0];
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

struct sample_rows_call {
    const float *logits;
    long V;
    const int64_t *rows;
    long n;
    long c;
    long B;
    const float *scale;
    const float *u;
    const int64_t *keys;
    const float *top_p;
    const float *min_p;
    float *z;
    int64_t *tokens;
    const uint32_t *mask;
    long W;
    const int64_t *midx;
};

static void sample_rows_task(void *arg, struct nk_team *team) {
    const struct sample_rows_call *a = arg;
    const float *logits = a->logits;
    long V = a->V;
    const int64_t *rows = a->rows;
    long c = a->c;
    long B = a->B;
    const float *scale = a->scale;
    const float *u = a->u;
    const int64_t *keys = a->keys;
    const float *top_p = a->top_p;
    const float *min_p = a->min_p;
    float *z = a->z;
    int64_t *tokens = a->tokens;
    const uint32_t *mask = a->mask;
    long W = a->W;
    const int64_t *midx = a->midx;
    long nbk = (V + SB - 1) / SB;
    int32_t *work = malloc(sizeof(int32_t) * 5 * V);
    float *e = malloc(sizeof(float) * (V + 4 * nbk + 3 * c)), *bs = e + V, *vals = bs + nbk, *w = vals + c,
          *cum = w + c, *sx = cum + c, *ssum = sx + nbk, *f = ssum + nbk; /* sx, ssum, f: fused_row's */
    int32_t *mk = malloc(sizeof(int32_t) * (B > 0 ? V / B + 1 : 1));
    int64_t *ids = malloc(sizeof(int64_t) * c);
    int fused = B > 0 && SB % B == 0;
    if (!fused)
        for (long b = 0; b < nbk; b++) f[b] = 1;
    for (long i0, i1; nk_next(team, &i0, &i1);)
        for (long i = i0; i < i1; i++) {
            long r = rows ? rows[i] : i;
            const float *x = logits + r * V;
            const uint32_t *mw = row_mask(mask, W, midx, r);
            float p = top_p ? top_p[i] : 1, mp = min_p ? min_p[i] : -1, zf = 0;
            float ui = u && !isnan(u[i]) ? u[i] : nk_uniform((uint64_t)keys[i], 0); /* a seeded row's own */
            if (fused) {
                zf = (float)fused_row(x, mw, V, B, scale[i], mk, sx, ssum, e);
                if (flat_row(zf, ui, c, V, p, mp)) { /* no candidates: the draw walks every token */
                    float m = -INFINITY;
                    for (long b = 0; b < nbk; b++) m = sx[b] > m ? sx[b] : m;
                    block_factors(sx, ssum, nbk, m, scale[i], f, bs);
                    z[i] = zf;
                    tokens[i] = draw_past(e, V, f, ssum, bs, rounded(ui * zf), zf, w, cum, ids, 0, p, mp,
                                          (uint64_t)keys[i]);
                    continue;
                }
                top_row_given(x, mw, V, c, B, work, mk, vals, ids);
            } else {
                top_row(x, mw, V, c, B, work, vals, ids);
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
                zf = (float)weights_row(x, mw, V, m, scale[i], e, bs);
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
                    int64_t *tokens, const uint32_t *mask, long W, const int64_t *midx) {
    struct sample_rows_call a = {logits, V, rows, n, c, B, scale, u, keys, top_p, min_p, z, tokens, mask, W, midx};
    nk_parallel(n, 1, n > 1, sample_rows_task, &a);
}

struct argmax_rows_call {
    const float *x;
    long n;
    long V;
    int64_t *out;
    const int64_t *rows;
    const uint32_t *mask;
    long W;
    const int64_t *midx;
};

static void argmax_rows_task(void *arg, struct nk_team *team) {
    const struct argmax_rows_call *a = arg;
    const float *x = a->x;
    long V = a->V;
    int64_t *out = a->out;
    const int64_t *rows = a->rows;
    const uint32_t *mask = a->mask;
    long W = a->W;
    const int64_t *midx = a->midx;
    for (long i0, i1; nk_next(team, &i0, &i1);)
        for (long i = i0; i < i1; i++) {
            long ri = rows ? rows[i] : i;
            const float *r = x + ri * V;
            const uint32_t *mw = row_mask(mask, W, midx, ri);
            float m = -INFINITY;
            long at = -1, j = 0; /* at: the block of SB holding m's first occurrence */
            int nan = 0;
            for (long b0 = 0; b0 < V && !nan; b0 += SB) {
                long end = b0 + SB < V ? b0 + SB : V;
                v8 a0 = (v8){} - INFINITY, a1 = a0, a2 = a0, a3 = a0;
                v8i bad = {};
                for (j = b0; j + 32 <= end; j += 32) {
                    if (mw && mw[j >> 5] == 0) continue; /* 32 times -inf: changes neither */
                    v8 v0 = mload8(r, mw, j), v1 = mload8(r, mw, j + 8), v2 = mload8(r, mw, j + 16),
                       v3 = mload8(r, mw, j + 24);
                    bad |= (v0 != v0) | (v1 != v1) | (v2 != v2) | (v3 != v3);
                    a0 = max8(v0, a0), a1 = max8(v1, a1), a2 = max8(v2, a2), a3 = max8(v3, a3);
                }
                a0 = max8(max8(a0, a1), max8(a2, a3));
                float bm = a0[0];
                for (int l = 1; l < 8; l++) bm = a0[l] > bm ? a0[l] : bm;
                for (; j < end; j++) {
                    float rj = mat(r, mw, j);
                    bad[0] |= -(rj != rj);
                    bm = rj > bm ? rj : bm;
                }
                nan = mask_bits8(bad) != 0;
                if (nan || bm > m || at < 0) {
                    m = bm > m ? bm : m;
                    at = nan || bm >= m ? b0 : at;
                }
            }
            long end = at + SB < V ? at + SB : V, k = at;
            if (nan) {
                while (mat(r, mw, k) == mat(r, mw, k)) k++; /* the block holds a NaN */
            } else {
                while (k < end - 1 && !(mat(r, mw, k) == m)) k++; /* m is in the block (-0 equals +0: the first) */
            }
            out[i] = k;
        }
}

/* out[i]: the index of the largest of row rows[i] (NULL: i) of x [*, V] (the first of equals;
 * the first NaN, which torch's argmax takes as the largest): torch.argmax(x, dim=1), read once
 * a row (a row's maximum is found 32 floats at a time, then its first occurrence in the block
 * of 256 that holds it). Masked (mask, W, midx: nk_top_candidates'), 32 banned tokens (a word
 * of zeros) are not read at all. */
void nk_argmax_rows(const float *x, long n, long V, int64_t *out, const int64_t *rows, const uint32_t *mask, long W,
                    const int64_t *midx) {
    struct argmax_rows_call a = {x, n, V, out, rows, mask, W, midx};
    nk_parallel(n, nk_chunk(n), n * V >= (1L << 20), argmax_rows_task, &a);
}

struct logprobs_call {
    const float *logits;
    long V;
    const int64_t *rows;
    long n;
    const float *picked;
    long k;
    long B;
    float *lse;
    int64_t *above;
    float *vals;
    int64_t *ids;
    const uint32_t *mask;
    long W;
    const int64_t *midx;
};

static void logprobs_task(void *arg, struct nk_team *team) {
    const struct logprobs_call *a = arg;
    const float *logits = a->logits;
    long V = a->V;
    const int64_t *rows = a->rows;
    const float *picked = a->picked;
    long k = a->k;
    long B = a->B;
    float *lse = a->lse;
    int64_t *above = a->above;
    float *vals = a->vals;
    int64_t *ids = a->ids;
    const uint32_t *mask = a->mask;
    long W = a->W;
    const int64_t *midx = a->midx;
    int32_t *work = k > 0 ? malloc(sizeof(int32_t) * 5 * V) : 0;
    for (long i0, i1; nk_next(team, &i0, &i1);)
        for (long i = i0; i < i1; i++) {
            long r = rows ? rows[i] : i;
            const float *x = logits + r * V;
            const uint32_t *mw = row_mask(mask, W, midx, r);
            float m = -INFINITY;
            long j = 0;
            if (k > 0) {
                top_row(x, mw, V, k, B, work, vals + i * k, ids + i * k);
                m = vals[i * k];
            } else {
                vf mv = splat(-INFINITY);
                for (; j + VW <= V; j += VW) {
                    vf v = mloadv(x, mw, j);
                    mv = selectv(v > mv, v, mv);
                }
                for (int q = 0; q < VW; q++) m = mv[q] > m ? mv[q] : m;
                for (; j < V; j++) m = mat(x, mw, j) > m ? mat(x, mw, j) : m;
            }
            const float scale = 1.44269504088896341f, p = picked[i];
            double total = 0;
            long count = 0;
            for (long b0 = 0; b0 < V; b0 += SB) {
                long end = b0 + SB < V ? b0 + SB : V;
                vf acc = splat(0);
                vi cnt = {};
                for (j = b0; j + VW <= end; j += VW) {
                    vf v = mloadv(x, mw, j);
                    acc += exp2_neg((v - splat(m)) * splat(scale));
                    cnt -= v > splat(p);
                }
                float s = hsum(acc);
                for (int q = 0; q < VW; q++) count += cnt[q];
                for (; j < end; j++) {
                    float xj = mat(x, mw, j);
                    s += exp2_neg(splat((xj - m) * scale))[0];
                    count += xj > p;
                }
                total += s;
            }
            lse[i] = m + logf((float)total);
            above[i] = count;
        }
    free(work);
}

/* For the n rows rows[i] (NULL: i) of logits [*, V]: lse[i], the log-sum-exp (max + log of
 * the sum of 2^((logit - max) * log2(e))), above[i], how many logits exceed picked[i], and
 * (k > 0) its k largest logits and their ids (vals, ids [n, k], top_row with blocks of B),
 * found first so that the row is in cache for the sum. */
void nk_logprobs(const float *logits, long V, const int64_t *rows, long n, const float *picked, long k, long B,
                 float *lse, int64_t *above, float *vals, int64_t *ids, const uint32_t *mask, long W,
                 const int64_t *midx) {
    struct logprobs_call a = {logits, V, rows, n, picked, k, B, lse, above, vals, ids, mask, W, midx};
    nk_parallel(n, nk_chunk(n), n > 1, logprobs_task, &a);
}
