/* RMSNorm rows on the CPU, bit for bit torch's `F.rms_norm` on float32 (engine/forward/dense.py's fused
   norms call it; a load-time probe checks the bits before any norm uses it).

out = x * (1 / sqrt(mean(x * x) + eps)) * weight, each product, sum and quotient rounded on its
own (never fused into a multiply-add), the squares summed in the order torch's CPU sum kernel sums
a contiguous row: eight-lane vectors in four interleaved accumulators, cascaded every sixteen
steps, a remainder of whole vectors into the first, the four added in order, then the row's
scalar tail, then the eight lanes in order.

In bfloat16 (pd_rms_norm_bf16), as transformers' Llama-style norms compute it: the row widened to
float32, normalized as above, rounded to bfloat16, then times the bfloat16 weight (a float32
product rounded to bfloat16, as torch's bfloat16 multiply rounds it). */
#include <math.h>
#include <stdint.h>

#include "pdserve_kernels.h"
#include "vec.h"

#if defined(__clang__)
#define NO_CONTRACT
#else
#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#endif

static inline int ceil_log2(int64_t x) {
    int r = 0;
    while (((int64_t)1 << r) < x) r++;
    return r;
}

NO_CONTRACT static float sum_squares(const float *x, int n) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    int64_t vecs = n / 8, groups = vecs / 4;
    int level_power = ceil_log2(groups) / 4 > 4 ? ceil_log2(groups) / 4 : 4;
    int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;
    v8f acc[4][4];
    for (int l = 0; l < 4; l++)
        for (int k = 0; k < 4; k++) acc[l][k] = (v8f){0};
    int64_t i = 0;
    while (i + level_step <= groups) {
        for (int64_t j = 0; j < level_step; j++, i++)
            for (int k = 0; k < 4; k++) {
                v8f v = f32_load8(x + (i * 4 + k) * 8);
                acc[0][k] += v * v;
            }
        for (int l = 1; l < 4; l++) {
            for (int k = 0; k < 4; k++) {
                acc[l][k] += acc[l - 1][k];
                acc[l - 1][k] = (v8f){0};
            }
            if ((i & (level_mask << (l * level_power))) != 0) break;
        }
    }
    for (; i < groups; i++)
        for (int k = 0; k < 4; k++) {
            v8f v = f32_load8(x + (i * 4 + k) * 8);
            acc[0][k] += v * v;
        }
    for (int l = 1; l < 4; l++)
        for (int k = 0; k < 4; k++) acc[0][k] += acc[l][k];
    for (int64_t g = groups * 4; g < vecs; g++) {
        v8f v = f32_load8(x + g * 8);
        acc[0][0] += v * v;
    }
    v8f total = acc[0][0];
    for (int k = 1; k < 4; k++) total += acc[0][k];
    float sum = 0.0f;
    for (int64_t d = vecs * 8; d < n; d++) {
        float sq = x[d] * x[d];
        sum += sq;
    }
    float lanes[8];
    store8(lanes, total);
    for (int l = 0; l < 8; l++) sum += lanes[l];
    return sum;
}

NO_CONTRACT static void norm_row(const float *x, const float *w, float eps, float *out, int n) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    float r = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
    for (int d = 0; d < n; d++) {
        float y = x[d] * r;
        out[d] = y * w[d];
    }
}

void pd_rms_norm(const float *x, int64_t x_stride, const float *w, float eps, float *out, int64_t out_stride,
                 int rows, int n, int threads) {
    _Pragma("omp parallel for schedule(static) if((int64_t)rows * n >= PD_SPLIT_VALUES) num_threads(threads)")
    for (int r = 0; r < rows; r++) norm_row(x + r * x_stride, w, eps, out + r * out_stride, n);
}

NO_CONTRACT static void norm_row_bf16(const uint16_t *x, const uint16_t *w, float eps, uint16_t *out, int n) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    float wide[n]; /* the row widened: a hidden size's floats on the stack */
    int d = 0;
    for (; d + 8 <= n; d += 8) store8(wide + d, bf16_load8(x + d));
    for (; d < n; d++) wide[d] = bf16_load(x[d]);
    float r = 1.0f / sqrtf(sum_squares(wide, n) / (float)n + eps);
    v8f rv = (v8f){0} + r;
    for (d = 0; d + 8 <= n; d += 8) bf16_store8(out + d, bf16_load8(w + d) * bf16_round8(f32_load8(wide + d) * rv));
    for (; d < n; d++) {
        float y = bf16_load(bf16_store(wide[d] * r));
        out[d] = bf16_store(bf16_load(w[d]) * y);
    }
}

void pd_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, float eps, uint16_t *out,
                      int64_t out_stride, int rows, int n, int threads) {
    _Pragma("omp parallel for schedule(static) if((int64_t)rows * n >= PD_SPLIT_VALUES) num_threads(threads)")
    for (int r = 0; r < rows; r++) norm_row_bf16(x + r * x_stride, w, eps, out + r * out_stride, n);
}

/* A residual add and the next norm in one pass over each row (the decoder's x = x + h; norm(x)):
   sum = x + y as torch adds them (float32; in bfloat16 the float32 sum of the widened values,
   rounded to nearest even), written to `sum`, then that row normalized into `out` as above. Rows of
   x, y, sum and out are `n` contiguous values, x_stride / y_stride / n apart. */
void pd_add_rms_norm(const float *x, int64_t x_stride, const float *y, int64_t y_stride, const float *w, float eps,
                     float *sum, float *out, int rows, int n, int threads) {
    _Pragma("omp parallel for schedule(static) if((int64_t)rows * n >= PD_SPLIT_VALUES) num_threads(threads)")
    for (int r = 0; r < rows; r++) {
        const float *a = x + r * x_stride, *b = y + r * y_stride;
        float *s = sum + (int64_t)r * n;
        for (int d = 0; d < n; d++) s[d] = a[d] + b[d];
        norm_row(s, w, eps, out + (int64_t)r * n, n);
    }
}

void pd_add_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *y, int64_t y_stride,
                          const uint16_t *w, float eps, uint16_t *sum, uint16_t *out, int rows, int n, int threads) {
    _Pragma("omp parallel for schedule(static) if((int64_t)rows * n >= PD_SPLIT_VALUES) num_threads(threads)")
    for (int r = 0; r < rows; r++) {
        const uint16_t *a = x + r * x_stride, *b = y + r * y_stride;
        uint16_t *s = sum + (int64_t)r * n;
        int d = 0;
        for (; d + 8 <= n; d += 8) bf16_store8(s + d, bf16_load8(a + d) + bf16_load8(b + d));
        for (; d < n; d++) s[d] = bf16_store(bf16_load(a[d]) + bf16_load(b[d]));
        norm_row_bf16(s, w, eps, out + (int64_t)r * n, n);
    }
}
