/* RMSNorm (+ residual add) and q/k norm + rotary. */
#include "common.h"

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
struct rmsnorm_call {
    const float *x;
    float *residual;
    long H;
    const float *w;
    float eps;
    float *out;
};

static void rmsnorm_task(void *ctx, struct nk_team *team) {
    const struct rmsnorm_call *c = ctx;
    long H = c->H;
    for (long m0, m1; nk_next(team, &m0, &m1);)
        for (long m = m0; m < m1; m++) {
            const float *xr = c->x + m * H;
            if (c->residual) {
                float *rr = c->residual + m * H;
                long i = 0;
                for (; i + VW <= H; i += VW) storev(rr + i, loadv(xr + i) + loadv(rr + i));
                for (; i < H; i++) rr[i] = xr[i] + rr[i];
                xr = rr;
            }
            rmsnorm_row(xr, H, c->w, c->eps, c->out + m * H);
        }
}

void nk_rmsnorm(const float *x, float *residual, long M, long H, const float *w, float eps, float *out) {
    struct rmsnorm_call c = {x, residual, H, w, eps, out};
    nk_parallel(M, nk_chunk(M), M * H >= 32768, rmsnorm_task, &c);
}

/* x [D] -> out [D]: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1) */
static inline void rope_row(const float *x, const float *c, const float *s, long D, float *out) {
    long half = D / 2;
    for (long i = 0; i < half; i++) out[i] = x[i] * c[i] + (-x[i + half]) * s[i];
    for (long i = half; i < D; i++) out[i] = x[i] * c[i] + x[i - half] * s[i];
}

/* qkv [T, (Hq + 2 Hkv) D] rows -> q [T, Hq, D], k [T, Hkv, D]: per-head RMSNorm when
 * qw / kw are given (Qwen3), then rotary with this token's cos, sin [T, D]. */
struct rope_call {
    const float *qkv;
    long Hq, Hkv, D;
    const float *qw, *kw;
    float eps;
    const float *cos, *sin;
    float *q, *k;
};

static void rope_task(void *ctx, struct nk_team *team) {
    const struct rope_call *a = ctx;
    long Hq = a->Hq, Hkv = a->Hkv, D = a->D, width = (Hq + 2 * Hkv) * D;
    float tmp[D];
    for (long t0, t1; nk_next(team, &t0, &t1);)
        for (long t = t0; t < t1; t++) {
            const float *c = a->cos + t * D, *s = a->sin + t * D;
            for (long h = 0; h < Hq + Hkv; h++) {
                const float *x = a->qkv + t * width + h * D;
                const float *w = h < Hq ? a->qw : a->kw;
                float *o = h < Hq ? a->q + (t * Hq + h) * D : a->k + (t * Hkv + h - Hq) * D;
                if (w) {
                    rmsnorm_row(x, D, w, a->eps, tmp);
                    x = tmp;
                }
                rope_row(x, c, s, D, o);
            }
        }
}

void nk_qk_norm_rope(const float *qkv, long T, long Hq, long Hkv, long D, const float *qw,
                     const float *kw, float eps, const float *cos, const float *sin, float *q,
                     float *k) {
    struct rope_call a = {qkv, Hq, Hkv, D, qw, kw, eps, cos, sin, q, k};
    nk_parallel(T, nk_chunk(T), T * (Hq + Hkv) * D >= 32768, rope_task, &a);
}

#pragma GCC pop_options
