/* 8- and 16-lane float vectors for pdserve's CPU kernels, in GCC/Clang vector extensions (so they
   build for any target: AVX2 registers on x86-64, two NEON registers on arm64; 16 lanes in one
   AVX-512 register or two narrower ones) and the scalar helpers they share: bfloat16 widening and
   rounding, half-float widening, a vector exp for softmax. */
#ifndef PDSERVE_VEC_H
#define PDSERVE_VEC_H

/* A row-wise small op (RMSNorm, rotary) goes over the threads from this many values. Below it a
   second thread's fork and join cost about what its half of the work saves on a quiet host (a
   256-row prompt chunk's norm: 19 us on one thread, 14 on two), and on a host whose cores are
   oversubscribed every join waits for a descheduled thread (a 512-token bfloat16 prompt's small ops
   1.8 s on two threads against 0.06 s on one, AMD Zen 4, load average 16). */
#define PD_SPLIT_VALUES (1 << 18)

#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

static inline float bf16_load(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bf16_store(float f) { /* round to nearest even */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline v8f f32_load8(const float *p) {
    v8f x;
    memcpy(&x, p, sizeof x);
    return x;
}

/* Eight unsigned 16-bit lanes zero-extended to 32 bits. GCC 12 compiles the vector extension's
   conversion as two half-width widenings and an insert; one vpmovzxwd from memory where the CPU has
   it (the decode kernel's widening of a bfloat16 pool: 25% of its time before, 2026-12-03). */
static inline v8u widen_u16x8(const uint16_t *p) {
#if defined(__AVX2__)
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return (v8u)w;
#else
    v8h h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, v8u);
#endif
}

/* N bfloat16 widened (exactly: their bits shifted up), and N floats rounded to bfloat16 (nearest
   even, as bf16_store), kept as floats or stored: for a vector VF of N floats (VU, VH its unsigned
   32- and 16-bit lanes). Lane by lane, so a lane's bits do not depend on N. */
#define BF16_VECTORS(N, VF, VU, VH)                                                                 \
    static inline VF bf16_load##N(const uint16_t *p) {                                              \
        VU u = widen_u16x##N(p) << 16;                                                              \
        VF x;                                                                                       \
        memcpy(&x, &u, sizeof x);                                                                   \
        return x;                                                                                   \
    }                                                                                               \
    static inline VU bf16_rounded_bits##N(VF x) {                                                   \
        VU u;                                                                                       \
        memcpy(&u, &x, sizeof u);                                                                   \
        return u + 0x7FFFu + ((u >> 16) & 1u);                                                      \
    }                                                                                               \
    static inline VF bf16_round##N(VF x) {                                                          \
        VU u = bf16_rounded_bits##N(x) & 0xFFFF0000u;                                               \
        memcpy(&x, &u, sizeof x);                                                                   \
        return x;                                                                                   \
    }                                                                                               \
    static inline void bf16_store##N(uint16_t *p, VF x) {                                           \
        VH h = __builtin_convertvector(bf16_rounded_bits##N(x) >> 16, VH);                          \
        memcpy(p, &h, sizeof h);                                                                    \
    }
BF16_VECTORS(8, v8f, v8u, v8h)

/* Eight IEEE half floats widened (exactly): one instruction where the CPU converts them (F16C). */
#if defined(__F16C__)
static inline v8f f16_load8(const uint16_t *p) {
    __m256 wide = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    v8f x;
    memcpy(&x, &wide, sizeof x);
    return x;
}
#else
static inline float f16_load(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31u, mant = h & 1023u, u;
    if (exp == 0) { /* zero or subnormal: mant * 2^-24, exact in float */
        float f = (float)mant * 0x1p-24f;
        return sign ? -f : f;
    }
    u = sign | (exp == 31 ? 0x7F800000u | mant << 13 : (exp + 112) << 23 | mant << 13);
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline v8f f16_load8(const uint16_t *p) {
    v8f x;
    for (int l = 0; l < 8; l++) x[l] = f16_load(p[l]);
    return x;
}
#endif

static inline void store8(float *p, v8f x) { memcpy(p, &x, sizeof x); }

static inline float hsum(v8f x) {
    float lanes[8];
    memcpy(lanes, &x, sizeof lanes);
    return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}

/* lanes of a where mask is set (all ones), of b elsewhere */
static inline v8f select8(v8i mask, v8f a, v8f b) { return (v8f)(((v8i)a & mask) | ((v8i)b & ~mask)); }

/* a > b ? a : b lane by lane (so a NaN in b comes through): vmaxps is exactly that, in one op where
   the compiler's select takes a compare and two logic ops */
static inline v8f vmax(v8f a, v8f b) {
#if defined(__AVX__)
    return (v8f)_mm256_max_ps((__m256)a, (__m256)b);
#else
    return select8(a > b, a, b);
#endif
}

/* Sixteen floats: a pair of AVX2 registers, or one AVX-512 register where the CPU has them. Every
   op is lane by lane, so a lane's bits do not depend on the width it was computed at. */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline v16f f32_load16(const float *p) {
    v16f x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline void store16(float *p, v16f x) { memcpy(p, &x, sizeof x); }

static inline v16f splat16(const float *p) { /* a broadcast from memory, folded into the FMA */
    float s = *p;
    return (v16f){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s};
}

typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

static inline v16u widen_u16x16(const uint16_t *p) { /* one instruction with AVX-512, two halves elsewhere */
    v16u u;
#if defined(__AVX512F__)
    u = (v16u)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
#else
    v8u half[2] = {widen_u16x8(p), widen_u16x8(p + 8)};
    memcpy(&u, half, sizeof u);
#endif
    return u;
}

BF16_VECTORS(16, v16f, v16u, v16h)

static inline v16f select16(v16i mask, v16f a, v16f b) { return (v16f)(((v16i)a & mask) | ((v16i)b & ~mask)); }

static inline v16f vmax16(v16f a, v16f b) { /* as vmax */
#if defined(__AVX512F__)
    return (v16f)_mm512_max_ps((__m512)a, (__m512)b);
#else
    return select16(a > b, a, b);
#endif
}

/* e^x for x <= 0, a vector VF of floats (VI its ints) at once, to about one ulp: Cephes' expf, with
   n = round(x / ln 2) by the float magic-number trick (round to nearest even, so |r| <= ln 2 / 2 as
   Cephes' floor(. + 0.5)) */
#define EXP_NONPOS(NAME, VF, VI, VMAX)                                                              \
    static inline VF NAME(VF x) {                                                                  \
        const VF magic = (VF){0} + 12582912.0f; /* 1.5 * 2^23 */                                   \
        x = VMAX(x, (VF){0} - 87.0f);           /* e^-87 is still a normal float */                \
        VF n = (x * 1.44269504088896341f + magic) - magic;                                         \
        VF r = x - n * 0.693359375f + n * 2.12194440e-4f;                                          \
        VF z = r * r;                                                                              \
        VF p = (VF){0} + 1.9875691500e-4f;                                                         \
        p = p * r + 1.3981999507e-3f;                                                              \
        p = p * r + 8.3334519073e-3f;                                                              \
        p = p * r + 4.1665795894e-2f;                                                              \
        p = p * r + 1.6666665459e-1f;                                                              \
        p = p * r + 5.0000001201e-1f;                                                              \
        p = p * z + r + 1.0f;                                                                      \
        VI bits = (__builtin_convertvector(n, VI) + 127) << 23;                                    \
        return p * (VF)bits;                                                                       \
    }
EXP_NONPOS(exp_nonpos8, v8f, v8i, vmax)
EXP_NONPOS(exp_nonpos16, v16f, v16i, vmax16)

static inline float exp_nonpos(float x) { /* the same, for the tail of a row */
    float lanes[8] = {x};
    v8f v;
    memcpy(&v, lanes, sizeof v);
    v = exp_nonpos8(v);
    memcpy(lanes, &v, sizeof v);
    return lanes[0];
}

/* One float in every lane, read straight from memory (vbroadcastss m32 on x86: no shuffle uop to
   compete with the FMAs). */
static inline v8f splat(const float *p) {
    float s = *p;
    return (v8f){s, s, s, s, s, s, s, s};
}

#endif
