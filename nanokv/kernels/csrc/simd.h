/* nanokv CPU kernels: the vector width and the instruction-set mappings every file shares.
 *
 * Vector width: NK_WIDTH floats, 16 where the compiler targets AVX-512, else 8, chosen when
 * the library is compiled (-DNK_WIDTH=8 or 16 forces it: build.py's NANOKV_CPU_WIDTH). The
 * code is written once on GCC vector extensions; on a machine without AVX-512 a 16-wide
 * build runs as pairs of 8-wide instructions, which is how both widths are tested anywhere.
 *
 * Everything here is static inline: a helper inlined into its caller is compiled with it,
 * so whether GCC contracts a product and a sum into one FMA is decided the same way in
 * every file (a helper called across files would round differently from an inlined one). */
#ifndef NK_SIMD_H
#define NK_SIMD_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(NK_PORTABLE) && (defined(__AVX2__) || defined(__AVX512VNNI__) || defined(__AVXVNNI__))
#include <immintrin.h>
#endif

#ifndef NK_WIDTH
#ifdef __AVX512F__
#define NK_WIDTH 16
#else
#define NK_WIDTH 8
#endif
#endif
#if NK_WIDTH != 8 && NK_WIDTH != 16
#error "NK_WIDTH must be 8 or 16"
#endif
#define VW NK_WIDTH

typedef float vf __attribute__((vector_size(4 * VW)));
typedef float vfu __attribute__((vector_size(4 * VW), aligned(4))); /* unaligned access */
typedef int32_t vi __attribute__((vector_size(4 * VW)));
typedef uint16_t vbf __attribute__((vector_size(2 * VW), aligned(2))); /* VW bfloat16 bit patterns */
typedef float v8 __attribute__((vector_size(32)));                    /* half a 16-wide vector */
typedef float v8u __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline vf loadv(const float *p) { return *(const vfu *)p; }
static inline void storev(float *p, vf v) { *(vfu *)p = v; }
static inline vf splat(float x) { return x - (vf){}; } /* x - 0 is x, for -0 too: no add emitted */
static inline vf selectv(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); } /* m ? a : b */
static inline v8 load8(const float *p) { return *(const v8u *)p; }
static inline void store8(float *p, v8 v) { *(v8u *)p = v; }

/* The first n floats at p (n >= 8, a multiple of 8), zero past them: the tail of a row
 * whose length is a multiple of 8 but not of VW. */
static inline vf loadv_part(const float *p, long n) {
#if VW == 8
    (void)n;
    return loadv(p);
#else
    if (n >= VW) return loadv(p);
    vf v = {};
    memcpy(&v, p, 32);
    return v;
#endif
}

static inline void storev_part(float *p, vf v, long n) {
#if VW == 8
    (void)n;
    storev(p, v);
#else
    if (n >= VW) {
        storev(p, v);
        return;
    }
    memcpy(p, &v, 32);
#endif
}

static inline float hsum8(v8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

static inline float hsum(vf v) {
#if VW == 8
    return hsum8(v);
#else
    return hsum8(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
#endif
}

/* out[i] = hsum(a[i]) for 8 vectors, rounded exactly as hsum's order, with 16 shuffles
 * and adds instead of 8 separate reductions (VW 8: lanes 0-3 and 4-7 added first, then
 * (0 + 1) + (2 + 3)) */
static inline void hsum_x8(const vf *a, float *out) {
#if VW == 8
    v8 u[4];
    for (int i = 0; i < 4; i++) /* [a(2i) lo + hi, a(2i+1) lo + hi] */
        u[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    /* hadd within 128-bit lanes: [x0 + x1, x2 + x3, y0 + y1, y2 + y3] per lane */
#define HADD(x, y) (__builtin_shufflevector(x, y, 0, 2, 8, 10, 4, 6, 12, 14) + __builtin_shufflevector(x, y, 1, 3, 9, 11, 5, 7, 13, 15))
    v8 h0 = HADD(u[0], u[1]), h1 = HADD(u[2], u[3]);
    v8 h = HADD(h0, h1); /* [a0, a2, a4, a6 | a1, a3, a5, a7] */
#undef HADD
    store8(out, __builtin_shufflevector(h, h, 0, 4, 1, 5, 2, 6, 3, 7));
#else
    for (int i = 0; i < 8; i++) out[i] = hsum(a[i]);
#endif
}

/* exp for any x (clamped to [-87, 88]): 2^n * p(f), n = round(x / ln2); for vectors of
 * floats VT with lanes ITYPE (VW wide, and 8 wide for the gate/up epilogue) */
#define DEFINE_EXP(NAME, VT, IT)                                                            \
    static inline VT NAME(VT x) {                                                           \
        const VT lo = (VT){} - 87.0f, hi = (VT){} + 88.0f;                                  \
        IT below = x < lo, above = x > hi;                                                  \
        x = (VT)(((IT)x & ~below) | ((IT)lo & below));                                      \
        x = (VT)(((IT)x & ~above) | ((IT)hi & above));                                      \
        VT t = x * 1.44269504088896341f;                                                    \
        IT neg = t < (VT){};                                                                \
        VT half = (VT)((((IT)((VT){} + 0.5f)) & ~neg) | ((IT)((VT){} - 0.5f) & neg));       \
        IT n = __builtin_convertvector(t + half, IT); /* round half away from zero */       \
        VT nf = __builtin_convertvector(n, VT);                                             \
        VT f = x - nf * 0.693145751953125f - nf * 1.428606765330187045e-06f;                \
        VT p = (VT){} + 1.0f / 5040;                                                        \
        p = p * f + 1.0f / 720;                                                             \
        p = p * f + 1.0f / 120;                                                             \
        p = p * f + 1.0f / 24;                                                              \
        p = p * f + 1.0f / 6;                                                               \
        p = p * f + 0.5f;                                                                   \
        p = p * f + 1.0f;                                                                   \
        p = p * f + 1.0f;                                                                   \
        IT e = n + 127; /* n in [-126, 127] after the clamp */                              \
        IT bits = e << 23;                                                                  \
        VT scale;                                                                           \
        memcpy(&scale, &bits, sizeof scale);                                                \
        return p * scale;                                                                   \
    }
DEFINE_EXP(exp_any, vf, vi)
#if VW == 8
#define exp8 exp_any
#else
DEFINE_EXP(exp8, v8, v8i)
#endif

typedef int8_t v8q8 __attribute__((vector_size(8), aligned(1)));

/* 8 int8 values at p widened to float32. GCC 12 scalarizes __builtin_convertvector from
 * int8 (a movsx and a cvtsi2ss per value, measured 3x slower than the float32 cache), so
 * the AVX2 sign extension is spelled out. */
static inline __attribute__((always_inline)) v8 widen8(const char *p) {
#if defined(__AVX2__) && !defined(NK_PORTABLE)
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    return __builtin_convertvector(*(const v8q8 *)p, v8);
#endif
}

/* the lanes of m that are set, as the low 8 bits of an int (lane 0 the lowest) */
static inline int mask_bits8(v8i m) {
#if defined(__AVX2__) && !defined(NK_PORTABLE)
    return _mm256_movemask_ps((__m256)m);
#else
    int bits = 0;
    for (int l = 0; l < 8; l++) bits |= (m[l] != 0) << l;
    return bits;
#endif
}

/* a where a > b, else b, lane by lane (NaN in a: b): vmaxps's rule, one instruction with AVX */
static inline v8 max8(v8 a, v8 b) {
#if defined(__AVX2__) && !defined(NK_PORTABLE)
    return _mm256_max_ps(a, b);
#else
    v8i gt = a > b;
    return (v8)(((v8i)a & gt) | ((v8i)b & ~gt));
#endif
}

static inline v8 min8(v8 a, v8 b) { /* a where a < b, else b: vminps's rule */
#if defined(__AVX2__) && !defined(NK_PORTABLE)
    return _mm256_min_ps(a, b);
#else
    v8i lt = a < b;
    return (v8)(((v8i)a & lt) | ((v8i)b & ~lt));
#endif
}

/* whether any lane of a mask is set: a movemask where the ISA has one (the reduction of
 * shuffles it replaces was a third of exp2_neg's cost) */
static inline int any_lane(vi m) {
#if VW == 16 && defined(__AVX512F__) && !defined(NK_PORTABLE)
    return _mm512_test_epi32_mask((__m512i)m, (__m512i)m) != 0;
#else
#if VW == 16
    v8i a = __builtin_shufflevector(m, m, 0, 1, 2, 3, 4, 5, 6, 7) | __builtin_shufflevector(m, m, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    v8i a = m;
#endif
#if defined(__AVX2__) && !defined(NK_PORTABLE)
    return _mm256_movemask_ps((__m256)a) != 0;
#else
    a |= __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3);
    a |= __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5);
    return (a[0] | a[1]) != 0;
#endif
#endif
}

#endif
