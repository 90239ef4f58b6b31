/* Rotary position embedding in place, on the CPU (engine/fused.py calls it on a layer's fused
   q|k|v projection).

Each of `tokens` rows holds `heads` heads of `dim` floats, contiguous, from x + t * tok_stride
(the q heads, then the k heads; the v heads after them are not touched). Position t's angles are
cos[t * cs_stride + d] and sin[t * cs_stride + d], d < dim, each half a copy of the other as
transformers builds them. A head x becomes x * cos + rotate_half(x) * sin, with rotate_half(x) =
(-x[half:], x[:half]): the products and the sum each rounded on their own, never fused into one
multiply-add, so the result is transformers' own bit for bit. */
#include <stdint.h>

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

void pd_rope(float *x, int64_t tok_stride, int heads, int dim, const float *cos, const float *sin,
             int64_t cs_stride, int tokens, int threads) {
    int half = dim / 2;
    _Pragma("omp parallel for schedule(static) if(tokens >= 64) num_threads(threads)")
    for (int t = 0; t < tokens; t++)
        for (int h = 0; h < heads; h++)
            rope_head(x + t * tok_stride + (int64_t)h * dim, cos + t * cs_stride, sin + t * cs_stride, half);
}
