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
