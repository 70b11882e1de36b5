/* nanokv CPU kernels: GEMMs on weights packed once at load time (float32, bfloat16 or int8;
 * the gate/up one with SiLU * up in its epilogue), paged attention that reads the KV pages in
 * place through the block tables, RMSNorm with the residual add, q/k norm with rotary, the
 * sampler's row kernels, and a whole decoder layer chaining them in one call. Activations,
 * the KV cache and every accumulation are float32.
 *
 * Built at first use by nanokv/kernels/build.py with the machine's C compiler
 * (-O3 -march=native -fopenmp), every .c file of this folder into one shared library,
 * and called through ctypes (ffi.py) on tensors' data pointers. Parallel regions run on the
 * kernels' own threads (pool.c), not on OpenMP: torch's ops keep libgomp's.
 *
 *   simd.h        vector width, vector types, loads/stores, sums, exp: the ISA mappings
 *   common.h      this header: the library's entry points and the structs ffi.py mirrors
 *   gemm.h        what the two GEMM files share (the call's struct, epilogues, panel walk)
 *   gemm.c        GEMMs on float32, bfloat16 and int8w panels; nk_linear, nk_embed
 *   gemm_int8.c   int8 panels: activations quantized, int8 dot products (VNNI, AVX2, C)
 *   attention.c   paged attention: one query at a time (decodes) and prefill tiles
 *   norm_rope.c   RMSNorm (+ residual add), q/k norm + rotary
 *   kv_store.c    new K/V into their cache slots (float32, or int8 quantized)
 *   layer.c       one decoder layer in one call
 *   sampler.c     top candidates, the full-vocabulary draw, argmax, logprobs
 *   runtime.c     the build's vector width
 *   pool.c        the kernels' threads: nk_parallel, nk_next, the thread count
 *
 * A GEMM output element is summed in a fixed order (sequential over K), whatever the
 * batch size, the row's position in the batch, the thread count or the vector width (its
 * lanes are output columns). Reductions across lanes (attention dot products, RMSNorm's sum
 * of squares) keep a fixed order for a given width, but a 16-wide build adds 16 partial
 * sums where an 8-wide one adds 8. */
#ifndef NK_COMMON_H
#define NK_COMMON_H

#include "simd.h"

#define NR 16          /* output columns per packed weight panel, at either width */
#define NV (NR / VW)   /* vectors per panel row */

enum { NK_F32 = 0, NK_BF16 = 1, NK_INT8 = 2, NK_INT8W = 3 };

typedef _Float16 nk_half; /* the (scale, zero) pairs of an int8 KV cache */

/* functions one file defines for another: in the library, not exported from it */
#define NK_INTERNAL __attribute__((visibility("hidden")))

/* ---- pool.c: parallel regions ----
 * nk_parallel(n, chunk, parallel, fn, ctx) runs fn(ctx, team) on the calling thread and on
 * the pool's workers that join; each takes chunks of items with
 *     for (long b, e; nk_next(team, &b, &e);) for (long i = b; i < e; i++) ...
 * and may set up per-thread scratch before its first nk_next (nk_team_id: 0 the caller,
 * 1.. a worker). parallel == 0 (too little work to share): the caller alone. Once nk_next
 * returns 0 the task must not touch ctx (the region may have ended). */
struct nk_team;
typedef void (*nk_task)(void *ctx, struct nk_team *team);
NK_INTERNAL void nk_parallel(long n, long chunk, int parallel, nk_task fn, void *ctx);
NK_INTERNAL int nk_next(struct nk_team *team, long *begin, long *end);
NK_INTERNAL int nk_team_id(const struct nk_team *team);
NK_INTERNAL long nk_chunk(long n); /* items per chunk: a few chunks per thread, for balance */

/* ---- the entry points (ffi.py gives ctypes their signatures) ---- */

/* gemm.c, gemm_int8.c */
void nk_linear(const float *x, long M, long K, const void *w, int fmt, long N, const float *bias, float *out);
void nk_linear_silu_mul(const float *x, long M, long K, const void *w, int fmt, long I, const float *bias,
                        float *out);
void nk_embed(const int64_t *ids, long T, const void *w, int fmt, long K, float *out);
long nk_panel_bytes(int fmt, long K);
long nk_q8_padded_k(long K);
const char *nk_int8_isa(void);

/* attention.c, kv_store.c */
void nk_paged_attention(const float *q, const void *kc, const void *vc, const nk_half *ks, const nk_half *vs,
                        const int32_t *tables, long width, const int32_t *rows, const int32_t *ctx, long T, long Hq,
                        long Hkv, long D, long bs, float scale, long max_len, float *out);
void nk_store_kv(const float *k, long k_stride, const float *v, long v_stride, const int64_t *slots, long T,
                 long Hkv, long D, void *kc, void *vc, nk_half *ks, nk_half *vs);

/* norm_rope.c */
void nk_rmsnorm(const float *x, float *residual, long M, long H, const float *w, float eps, float *out);
void nk_qk_norm_rope(const float *qkv, long T, long Hq, long Hkv, long D, const float *qw,
                     const float *kw, float eps, const float *cos, const float *sin, float *q,
                     float *k);

/* sampler.c (mask, W, midx: token masks read where each row is read; see nk_top_candidates) */
void nk_top_candidates(const float *logits, long V, const int64_t *rows, long n, long k, long B, float *vals,
                       int64_t *ids, const uint32_t *mask, long W, const int64_t *midx);
void nk_sample_rows(const float *logits, long V, const int64_t *rows, long n, long c, long B, const float *scale,
                    const float *u, const int64_t *keys, const float *top_p, const float *min_p, float *z,
                    int64_t *tokens, const uint32_t *mask, long W, const int64_t *midx);
void nk_argmax_rows(const float *x, long n, long V, int64_t *out, const int64_t *rows, const uint32_t *mask, long W,
                    const int64_t *midx);
void nk_logprobs(const float *logits, long V, const int64_t *rows, long n, const float *picked, long k, long B,
                 float *lse, int64_t *above, float *vals, int64_t *ids, const uint32_t *mask, long W,
                 const int64_t *midx);

/* runtime.c, pool.c */
int nk_width(void);
void nk_set_threads(int n); /* the calling thread's later regions' thread count (itself included) */
int nk_threads(void);
int nk_pool_workers(void);  /* workers started so far */
void nk_pool_stats(long *regions, long *stalls);
void nk_pool_test(long n, long chunk, long regions, int32_t *runs, int32_t *tids, long inner, int hold);

/* layer.c: one whole decoder layer (Llama family, one rank); its two structs are ffi.py's
 * NkLayer and NkStep, field for field */
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

void nk_decoder_layer(const struct nk_layer *l, const struct nk_step *s, const float *x, float *residual,
                      int first, int last, float *out);
void nk_decoder_layers(const struct nk_layer *layers, long n, const struct nk_step *s, const float *x,
                       float *residual, float *out);

#endif
