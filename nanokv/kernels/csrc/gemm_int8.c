/* The int8 GEMM (NK_INT8): activations quantized per row in blocks of QB, exact int32 dot
 * products per block on whatever the compiler targets (AVX512-VNNI, AVX-VNNI, AVX2, plain
 * C: all give the same integers and the same floats), panel layout in gemm.h. */
#include "gemm.h"
#ifndef NK_Q8PF
#define NK_Q8PF 1
#endif

#if !defined(NK_PORTABLE) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q8_VNNI512
#define Q8_ISA "avx512vnni"
#define Q8_OFFSET 1 /* weights taken as unsigned (w + 128): what the dot product multiplies */
#define MRQ 8
#elif !defined(NK_PORTABLE) && defined(__AVXVNNI__)
#define Q8_AVXVNNI
#define Q8_ISA "avxvnni"
#define Q8_OFFSET 1
#define MRQ 3 /* 16 ymm registers: 3 rows x (2 int32 + 2 float32 accumulators) and the weights */
#elif !defined(NK_PORTABLE) && defined(__AVX2__) && defined(__FMA__) && defined(__FMA__)
#define Q8_AVX2
#define Q8_ISA "avx2"
#define Q8_OFFSET 0
#define MRQ 3 /* 4 rows spill (measured: 1.6x slower) */
#else
#define Q8_GENERIC
#ifdef NK_INT8_OFFSET /* the VNNI paths' arithmetic in plain C (weights + 128, activation sums): tests */
#define Q8_ISA "generic-offset"
#define Q8_OFFSET 1
#else
#define Q8_ISA "generic"
#define Q8_OFFSET 0
#endif
#define MRQ 4
#endif

long nk_q8_padded_k(long K) { return (K + QB - 1) / QB * QB; }

/* x [K] -> q [Kp] (zero padded), s [Kp / QB], o [Kp / QB]: s = max |x| / 127 over the
 * block, q = rint(x * (127 / max |x|)) (0 for an all-zero block), o = 128 * the block's sum
 * of q: a VNNI dot product multiplies unsigned bytes by signed ones, so it takes the weights
 * as w + 128 and o comes off its sum */
static void quantize_row(const float *x, long K, long Kp, int8_t *q, float *s, int32_t *o) {
    for (long b = 0; b < Kp / QB; b++) {
        long k0 = b * QB, n = K - k0 < QB ? K - k0 : QB;
        float amax = 0.0f;
        for (long i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[k0 + i]));
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        s[b] = amax / 127.0f;
        int32_t sum = 0;
        for (long i = 0; i < QB; i++) {
            float v = i < n ? rintf(x[k0 + i] * inv) : 0.0f;
            v = fminf(fmaxf(v, -127.0f), 127.0f);
            q[k0 + i] = (int8_t)(int)v;
            sum += (int)v;
        }
        o[b] = 128 * sum;
    }
}

/* One int8 tile: rows [m, m + ROWS) against one panel. Per block of QB k: exact int32 dot
 * products of the rows with the panel's 16 columns, then f = fma(block scale, float(sum), f);
 * every instruction set below computes the same integers and the same fused multiply-adds,
 * so all give the same floats. Q8_TILE_BEGIN / Q8_TILE_END are the shared parts. */
#define Q8_TILE_BEGIN                                                                       \
    long Kp = g->Kp, nb = Kp / QB;                                                          \
    const int8_t *qx = g->qx + m * Kp;                                                      \
    const float *sx = g->sx + m * nb;                                                       \
    const int32_t *ox = g->ox + m * nb;                                                     \
    float f[MRQ][NR];                                                                       \
    (void)ox;

/* f[r] * column scale, then the GEMM or gate/up epilogue */
static inline __attribute__((always_inline)) void q8_store(const float (*f)[NR], const char *wp, long nb, float *out,
                                                           long ldo, int ncols, const float *bias, const int ROWS,
                                                           const int glu) {
    const float *scale = (const float *)(wp + nb * Q8_BLOCK_BYTES);
    for (int r = 0; r < ROWS; r++) {
        vf a[NV];
        for (int v = 0; v < NV; v++) a[v] = loadv(f[r] + v * VW) * loadv(scale + v * VW);
        if (glu)
            store_glu_row(a, out + r * ldo, ncols, bias);
        else
            store_gemm_row(a, out + r * ldo, ncols, bias);
    }
}

static inline __attribute__((always_inline)) void q8_tile(const struct gemm *g, long m, const char *wp,
                                                          const char *pf, float *out, int ncols,
                                                          const float *bias, const int ROWS, const int glu) {
    Q8_TILE_BEGIN
#if defined(Q8_VNNI512)
    /* the weights as unsigned bytes (w + 128: the sign bit flipped), the activations' 128 *
     * block sums off each row's sum */
    __m512 fa[MRQ];
    const __m512i flip = _mm512_set1_epi8(-128);
    for (int r = 0; r < ROWS; r++) fa[r] = _mm512_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const char *wb = wp + b * Q8_BLOCK_BYTES;
        __m512i a[MRQ];
        for (int r = 0; r < ROWS; r++) a[r] = _mm512_set1_epi32(-ox[r * nb + b]);
        for (int q = 0; q < QB / 4; q++) {
            if (pf) __builtin_prefetch(pf + b * Q8_BLOCK_BYTES + q * 64, 0, 3);
            __m512i w = _mm512_xor_si512(_mm512_loadu_si512((const void *)(wb + q * 64)), flip);
            for (int r = 0; r < ROWS; r++) {
                int32_t xq;
                memcpy(&xq, qx + r * Kp + b * QB + q * 4, 4);
                a[r] = _mm512_dpbusd_epi32(a[r], w, _mm512_set1_epi32(xq));
            }
        }
        for (int r = 0; r < ROWS; r++)
            fa[r] = _mm512_fmadd_ps(_mm512_set1_ps(sx[r * nb + b]), _mm512_cvtepi32_ps(a[r]), fa[r]);
    }
    for (int r = 0; r < ROWS; r++) _mm512_storeu_ps(f[r], fa[r]);
#elif defined(Q8_AVXVNNI) || defined(Q8_AVX2)
    __m256 fa[MRQ][2];
    for (int r = 0; r < ROWS; r++) fa[r][0] = fa[r][1] = _mm256_setzero_ps();
#ifdef Q8_AVX2
    const __m256i ones = _mm256_set1_epi16(1);
#else
    const __m256i flip = _mm256_set1_epi8(-128);
#endif
    for (long b = 0; b < nb; b++) {
        const char *wb = wp + b * Q8_BLOCK_BYTES;
        __m256i a[MRQ][2];
        for (int r = 0; r < ROWS; r++) a[r][0] = a[r][1] = _mm256_set1_epi32(Q8_OFFSET ? -ox[r * nb + b] : 0);
        for (int q = 0; q < QB / 4; q++) { /* unrolled, GCC spills the accumulators */
            if (pf) __builtin_prefetch(pf + b * Q8_BLOCK_BYTES + q * 64, 0, 3);
            __m256i w0 = _mm256_loadu_si256((const __m256i *)(wb + q * 64));
            __m256i w1 = _mm256_loadu_si256((const __m256i *)(wb + q * 64 + 32));
#ifdef Q8_AVXVNNI
            w0 = _mm256_xor_si256(w0, flip), w1 = _mm256_xor_si256(w1, flip); /* w + 128, unsigned */
#endif
#ifdef Q8_AVX2
            /* maddubs multiplies unsigned by signed bytes: |w| by x with w's sign, adjacent
             * pairs summed to int16 (at most 2 * 127 * 127: no saturation), then pairs of those */
            __m256i u0 = _mm256_abs_epi8(w0), u1 = _mm256_abs_epi8(w1);
#endif
            for (int r = 0; r < ROWS; r++) {
                int32_t xq;
                memcpy(&xq, qx + r * Kp + b * QB + q * 4, 4);
                __m256i xv = _mm256_set1_epi32(xq);
#ifdef Q8_AVX2
                a[r][0] = _mm256_add_epi32(a[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(u0, _mm256_sign_epi8(xv, w0)), ones));
                a[r][1] = _mm256_add_epi32(a[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(u1, _mm256_sign_epi8(xv, w1)), ones));
#else
                a[r][0] = _mm256_dpbusd_avx_epi32(a[r][0], w0, xv);
                a[r][1] = _mm256_dpbusd_avx_epi32(a[r][1], w1, xv);
#endif
            }
        }
        for (int r = 0; r < ROWS; r++) {
            __m256 s = _mm256_set1_ps(sx[r * nb + b]);
            fa[r][0] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(a[r][0]), fa[r][0]);
            fa[r][1] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(a[r][1]), fa[r][1]);
        }
    }
    for (int r = 0; r < ROWS; r++) _mm256_storeu_ps(f[r], fa[r][0]), _mm256_storeu_ps(f[r] + 8, fa[r][1]);
#else
    typedef int32_t vq __attribute__((vector_size(64)));
    typedef int32_t vqu __attribute__((vector_size(64), aligned(1)));
    memset(f, 0, sizeof f);
    for (long b = 0; b < nb; b++) {
        const char *wb = wp + b * Q8_BLOCK_BYTES;
        vq a[MRQ];
        for (int r = 0; r < ROWS; r++) a[r] = (vq){} - (Q8_OFFSET ? ox[r * nb + b] : 0);
        for (int q = 0; q < QB / 4; q++) {
            if (pf) __builtin_prefetch(pf + b * Q8_BLOCK_BYTES + q * 64, 0, 3);
            vq w = *(const vqu *)(wb + q * 64);
            for (int i = 0; i < 4; i++) {
                vq wi = (w << (24 - 8 * i)) >> 24; /* byte i of each column, sign-extended */
                if (Q8_OFFSET) wi += 128;          /* the VNNI paths' unsigned weights */
                for (int r = 0; r < ROWS; r++) a[r] += wi * (int32_t)qx[r * Kp + b * QB + q * 4 + i];
            }
        }
        for (int r = 0; r < ROWS; r++)
            for (int j = 0; j < NR; j++) f[r][j] = fmaf(sx[r * nb + b], (float)a[r][j], f[r][j]);
    }
#endif
    q8_store((const float (*)[NR])f, wp, nb, out, g->n, ncols, bias, ROWS, glu);
}

#define DEFINE_Q8_TILES(ROWS)                                                               \
    static void gemm_q8_##ROWS(const struct gemm *g, long m, const char *w, const char *pf, float *out, \
                               int ncols, const float *bias) {                              \
        q8_tile(g, m, w, pf, out, ncols, bias, ROWS, 0);                                    \
    }                                                                                       \
    static void glu_q8_##ROWS(const struct gemm *g, long m, const char *w, const char *pf, float *out, \
                              int ncols, const float *bias) {                               \
        q8_tile(g, m, w, pf, out, ncols, bias, ROWS, 1);                                    \
    }
DEFINE_Q8_TILES(1)
DEFINE_Q8_TILES(2)
DEFINE_Q8_TILES(3)
#if MRQ == 3
#define Q8_TILES(name) {0, name##_1, name##_2, name##_3}
#elif MRQ == 4
DEFINE_Q8_TILES(4)
#define Q8_TILES(name) {0, name##_1, name##_2, name##_3, name##_4}
#else
DEFINE_Q8_TILES(4)
DEFINE_Q8_TILES(5)
DEFINE_Q8_TILES(6)
DEFINE_Q8_TILES(7)
DEFINE_Q8_TILES(8)
#define Q8_TILES(name) {0, name##_1, name##_2, name##_3, name##_4, name##_5, name##_6, name##_7, name##_8}
#endif
static const tile_fn GEMM_Q8[MRQ + 1] = Q8_TILES(gemm_q8), GLU_Q8[MRQ + 1] = Q8_TILES(glu_q8);

struct quantize_call {
    const float *x;
    long K, Kp;
    int8_t *qx;
    float *sx;
    int32_t *ox;
};

static void quantize_task(void *ctx, struct nk_team *team) {
    const struct quantize_call *c = ctx;
    long K = c->K, Kp = c->Kp, nb = Kp / QB;
    for (long m0, m1; nk_next(team, &m0, &m1);)
        for (long m = m0; m < m1; m++) quantize_row(c->x + m * K, K, Kp, c->qx + m * Kp, c->sx + m * nb, c->ox + m * nb);
}

/* x quantized row by row (quantize_row), then every panel against every row */
void nk_gemm_q8(struct gemm *g, int glu) {
    long M = g->M, K = g->K;
    g->Kp = nk_q8_padded_k(K);
    long nb = g->Kp / QB;
    int8_t *qx = malloc(M * g->Kp + 1);
    float *sx = malloc(sizeof(float) * (M * nb + 1));
    int32_t *ox = malloc(sizeof(int32_t) * (M * nb + 1));
    struct quantize_call c = {g->x, K, g->Kp, qx, sx, ox};
    nk_parallel(M, nk_chunk(M), M * K >= 32768, quantize_task, &c);
    g->qx = qx, g->sx = sx, g->ox = ox;
    run_panels(glu ? GLU_Q8 : GEMM_Q8, MRQ, g);
    free(qx);
    free(sx);
    free(ox);
}

const char *nk_int8_isa(void) { return Q8_ISA; }
