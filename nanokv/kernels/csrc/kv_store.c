/* New K/V rows into their cache slots: copied, or quantized to int8 per (token, KV head). */
#include "common.h"

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
