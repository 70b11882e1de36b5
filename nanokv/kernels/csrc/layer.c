/* ---- one whole decoder layer (Llama family, one rank) in one call -----------------------
 * The same steps as the Python layer, kernel after kernel, without going back to Python
 * between them: per-step overhead is most of a small model's decode step otherwise. */
#include "common.h"

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

/* layers [n], one after another, in one call: x -> out (the first layer reads x, the others
 * out, in place), residual as nk_decoder_layer keeps it; the last one with s->keep. A
 * decode step then crosses from Python into C once, not once per layer. */
void nk_decoder_layers(const struct nk_layer *layers, long n, const struct nk_step *s, const float *x,
                       float *residual, float *out) {
    for (long i = 0; i < n; i++) nk_decoder_layer(&layers[i], s, i ? out : x, residual, i == 0, i == n - 1, out);
}
