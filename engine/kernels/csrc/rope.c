/* Rotary position embedding in place, on the CPU (engine/forward/fused.py calls it on a layer's fused
   q|k|v projection).

Each of `tokens` rows holds `heads` heads of `dim` floats, contiguous, from x + t * tok_stride
(the q heads, then the k heads; the v heads after them are not touched). Position t's angles are
cos[t * cs_stride + d] and sin[t * cs_stride + d], d < dim, each half a copy of the other as
transformers builds them. A head x becomes x * cos + rotate_half(x) * sin, with rotate_half(x) =
(-x[half:], x[:half]): the products and the sum each rounded on their own, never fused into one
multiply-add, so the result is transformers' own bit for bit. In bfloat16 (pd_rope_bf16) each
product and the sum are rounded to bfloat16 as torch's bfloat16 ops round them (computed in float32,
exact for a product of two bfloat16, then rounded to nearest even). */
#include <stdint.h>

#include "pdserve_kernels.h"
#include "vec.h"

#if defined(__clang__)
#define NO_CONTRACT
#else
#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#endif

NO_CONTRACT static void rope_head(float *x, const float *c, const float *s, int half) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    for (int d = 0; d < half; d++) {
        float a = x[d], b = x[d + half];
        float lo = a * c[d] + (-b) * s[d];
        float hi = b * c[d + half] + a * s[d + half];
        x[d] = lo;
        x[d + half] = hi;
    }
}

/* Every token's first `heads` heads through HEAD (rope_head or rope_head_bf16). */
#define EVERY_HEAD(HEAD)                                                                            \
    int half = dim / 2;                                                                             \
    _Pragma("omp parallel for schedule(static) if((int64_t)tokens * heads * dim >= PD_SPLIT_VALUES) num_threads(threads)") \
    for (int t = 0; t < tokens; t++)                                                                \
        for (int h = 0; h < heads; h++)                                                             \
            HEAD(x + t * tok_stride + (int64_t)h * dim, cos + t * cs_stride, sin + t * cs_stride, half);

void pd_rope(float *x, int64_t tok_stride, int heads, int dim, const float *cos, const float *sin,
             int64_t cs_stride, int tokens, int threads) {
    EVERY_HEAD(rope_head)
}

static inline float bf16_round(float f) { return bf16_load(bf16_store(f)); }

static void rope_head_bf16(uint16_t *x, const uint16_t *c, const uint16_t *s, int half) {
    int d = 0;
    for (; d + 16 <= half; d += 16) { /* sixteen at a time, then eight: lane by lane, the same bits */
        v16f a = bf16_load16(x + d), b = bf16_load16(x + d + half);
        v16f lo = bf16_round16(a * bf16_load16(c + d)) + bf16_round16(-b * bf16_load16(s + d));
        v16f hi = bf16_round16(b * bf16_load16(c + d + half)) + bf16_round16(a * bf16_load16(s + d + half));
        bf16_store16(x + d, lo);
        bf16_store16(x + d + half, hi);
    }
    for (; d + 8 <= half; d += 8) {
        v8f a = bf16_load8(x + d), b = bf16_load8(x + d + half);
        v8f lo = bf16_round8(a * bf16_load8(c + d)) + bf16_round8(-b * bf16_load8(s + d));
        v8f hi = bf16_round8(b * bf16_load8(c + d + half)) + bf16_round8(a * bf16_load8(s + d + half));
        bf16_store8(x + d, lo);
        bf16_store8(x + d + half, hi);
    }
    for (; d < half; d++) {
        float a = bf16_load(x[d]), b = bf16_load(x[d + half]);
        float lo = bf16_round(a * bf16_load(c[d])) + bf16_round(-b * bf16_load(s[d]));
        float hi = bf16_round(b * bf16_load(c[d + half])) + bf16_round(a * bf16_load(s[d + half]));
        x[d] = bf16_store(lo);
        x[d + half] = bf16_store(hi);
    }
}

void pd_rope_bf16(uint16_t *x, int64_t tok_stride, int heads, int dim, const uint16_t *cos, const uint16_t *sin,
                  int64_t cs_stride, int tokens, int threads) {
    EVERY_HEAD(rope_head_bf16)
}
