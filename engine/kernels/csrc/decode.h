/* The decode kernel's vector pieces (paged_decode.c and decode_amx.c include it): eight dot products'
   lanes summed together, the prefetch, and a bfloat16 pool's paths where the CPU has AVX-512:
   - scores by vdpbf16ps (AVX512_BF16), straight from the pool: nothing widened or staged;
   - values widened in registers and summed in float32 (AVX-512F).
   SmolLM2's shape, 16 rows of 257 keys, 30 layers, 2 threads (2026-12-04, Xeon host, C harness):
   scores by vdpbf16ps where keys were widened into pairs first: 6.6 -> 6.2 ms a step from a pool
   larger than the caches, 4.1 -> 3.5 ms in cache. */
#ifndef PDSERVE_DECODE_H
#define PDSERVE_DECODE_H

#include <stdint.h>
#include <string.h>

#include "vec.h"

#define GROUP 8 /* keys whose dot products with one query head are summed across lanes together */
#define VGROUP 16 /* keys a call of values_bf16 takes in (its sums loaded and stored once a call) */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

static inline void prefetch_span(const void *start, int64_t span) { /* into L2 (prefetcht1) */
    for (int64_t b = 0; b < span; b += 64) __builtin_prefetch((const char *)start + b, 0, 2);
}

#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

/* Lane e of the result: the sum of a_e's eight lanes, as ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)).
   Pairwise sums of two vectors at a time (vhaddps' pattern), then the halves: 14 shuffles and adds
   for eight sums, where one at a time takes 32. */
static inline v8f sum_lanes8(v8f a0, v8f a1, v8f a2, v8f a3, v8f a4, v8f a5, v8f a6, v8f a7) {
#define PAIRS(x, y) (SHUFFLE(x, y, 0, 2, 8, 10, 4, 6, 12, 14) + SHUFFLE(x, y, 1, 3, 9, 11, 5, 7, 13, 15))
    v8f lo = PAIRS(PAIRS(a0, a1), PAIRS(a2, a3)), hi = PAIRS(PAIRS(a4, a5), PAIRS(a6, a7));
#undef PAIRS
    return SHUFFLE(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15);
}

static inline float sum_lanes(v8f a) { /* one vector's lanes, summed as sum_lanes8 sums each */
    float l[8];
    memcpy(l, &a, sizeof l);
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

/* decode_amx.c: a row's bfloat16 scores on AMX tiles */
void decode_amx_scores(const uint16_t *q, int64_t q_head, const uint16_t *k, int64_t blk_stride, int64_t tok_stride,
                       int64_t head_stride, const int64_t *table, int block_size, int64_t first, int64_t len,
                       int kv_heads, int groups, int dim, float scale, float *sc, int64_t span, uint32_t *qb,
                       float *cbuf);

#if defined(__AVX512F__)
#define LANES16 1
static inline v8f low8(v16f x) { return __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7); }
static inline v8f high8(v16f x) { return __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15); }
#else
#define LANES16 0
#endif

#if defined(__AVX512BF16__)
#define DOT_BF16 1
/* The scores of NH (1 to 3) query heads sharing a KV head against m <= GROUP keys (kp[e]: key e's
   KV head; kp[m..] any valid key, their scores not stored): q0 the first head's bfloat16 q (heads
   q_head apart), dim a multiple of 32; head h's scores to s + h * s_stride. Lane l of key e's sum
   takes dimensions 2l + 1, then 2l, of each 32 in turn (vdpbf16ps: two float32 FMAs of exact
   products, nearest even, subnormals flushed); the sum's 16 lanes are folded (l + 8 onto l) and
   summed as sum_lanes8 sums, then scaled. Each key's 64-byte pieces are loaded once for all NH
   heads; 24 sums side by side hide the FMAs' latency. */
ALWAYS_INLINE void scores_dot(int nh, const uint16_t *q0, int64_t q_head, int dim, const uint16_t *const *kp,
                              int m, float scale, float *s, int64_t s_stride) {
    __m512 a[3][GROUP];
    for (int h = 0; h < nh; h++)
        for (int e = 0; e < GROUP; e++) a[h][e] = _mm512_setzero_ps();
    for (int c = 0; c < dim / 32; c++) {
        __m512bh x[3];
        for (int h = 0; h < nh; h++) x[h] = (__m512bh)_mm512_loadu_si512(q0 + h * q_head + 32 * c);
        for (int e = 0; e < GROUP; e++) {
            __m512bh key = (__m512bh)_mm512_loadu_si512(kp[e] + 32 * c);
            for (int h = 0; h < nh; h++) a[h][e] = _mm512_dpbf16_ps(a[h][e], x[h], key);
        }
    }
    for (int h = 0; h < nh; h++) {
        v8f folded[GROUP];
        for (int e = 0; e < GROUP; e++) {
            v16f lanes;
            memcpy(&lanes, &a[h][e], sizeof lanes);
            folded[e] = low8(lanes) + high8(lanes);
        }
        v8f sums = sum_lanes8(folded[0], folded[1], folded[2], folded[3], folded[4], folded[5], folded[6],
                              folded[7]) * scale;
        if (m == GROUP) {
            store8(s + h * s_stride, sums);
        } else {
            float l[GROUP];
            memcpy(l, &sums, sizeof l);
            memcpy(s + h * s_stride, l, sizeof(float) * (size_t)m);
        }
    }
}
#else
#define DOT_BF16 0
/* Never called (paged_decode.c takes it only where DOT_BF16): a definition so that builds without
   AVX512-BF16 link; the OpenMP region keeps the untaken call, so an undefined one fails the load. */
ALWAYS_INLINE void scores_dot(int nh, const uint16_t *q0, int64_t q_head, int dim, const uint16_t *const *kp,
                              int m, float scale, float *s, int64_t s_stride) {
    (void)nh, (void)q0, (void)q_head, (void)dim, (void)kp, (void)m, (void)scale, (void)s, (void)s_stride;
    __builtin_trap();
}
#endif

#if LANES16
/* The value sums of NH (1 to 4) query heads sharing a KV head over m keys of a bfloat16 pool,
   widened in registers: 32 values (64 bytes) loaded as 16 pairs, the even dimensions their bits
   shifted up, the odd ones their low half cleared (both exact), so each 32-dimension piece of a
   head's sums is held as [16 even | 16 odd] (`acc`; put back in order at the end). Lane by
   lane, in key order: the same bits as widening first. NZ (1 or 2) pieces a call, at dimension d0.
   pf: where not NULL, pf[e] (where not NULL) is prefetched into L2 as key e is taken in (dim values:
   a later key of the same KV head), so the misses spread over the work. */
ALWAYS_INLINE void values_bf16(int nh, int nz, float *acc, int dim, int d0, const uint16_t *const *vp, int m,
                               const float *w, int64_t w_stride, const uint16_t *const *pf) {
    const v16u low_cleared = (v16u){0} + 0xFFFF0000u;
    v16f x[4][4]; /* at most 4 x 2 pieces' 16 sums + 4 widened + a broadcast: 22 of the 32 registers */
    for (int h = 0; h < nh; h++)
        for (int z = 0; z < 2 * nz; z++) x[h][z] = f32_load16(acc + h * dim + d0 + 16 * z);
    for (int e = 0; e < m; e++) {
        if (pf && pf[e]) prefetch_span(pf[e], (int64_t)dim * (int64_t)sizeof(uint16_t));
        v16f wide[4];
        for (int z = 0; z < nz; z++) {
            v16u u;
            memcpy(&u, vp[e] + d0 + 32 * z, sizeof u);
            v16u even = u << 16, odd = u & low_cleared;
            memcpy(&wide[2 * z], &even, sizeof even);
            memcpy(&wide[2 * z + 1], &odd, sizeof odd);
        }
        for (int h = 0; h < nh; h++) {
            v16f we = splat16(w + h * w_stride + e);
            for (int z = 0; z < 2 * nz; z++) x[h][z] += we * wide[z];
        }
    }
    for (int h = 0; h < nh; h++)
        for (int z = 0; z < 2 * nz; z++) store16(acc + h * dim + d0 + 16 * z, x[h][z]);
}
#else
/* Never called (paged_decode.c takes it only where LANES16): defined so builds without AVX-512 link. */
ALWAYS_INLINE void values_bf16(int nh, int nz, float *acc, int dim, int d0, const uint16_t *const *vp, int m,
                               const float *w, int64_t w_stride, const uint16_t *const *pf) {
    (void)nh, (void)nz, (void)acc, (void)dim, (void)d0, (void)vp, (void)m, (void)w, (void)w_stride, (void)pf;
    __builtin_trap();
}
#endif

#endif
