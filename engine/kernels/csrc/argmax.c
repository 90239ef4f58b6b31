/* Greedy sampling's argmax over logit rows, on the CPU (engine/sampler.py, engine/model_runner.py):
   the index torch's `argmax(dim=-1)` gives — the first of the largest values, or the first NaN where
   a row has one — eight lanes at a time, the rows shared among threads (torch's runs a 16-row,
   49k-vocabulary batch on one thread: 0.45 ms a step here). Float32 rows, or bfloat16 ones widened
   as they are read (exactly: the argmax of the rows converted to float32, without converting them). */
#include <stdint.h>
#include <string.h>

#include "pdserve_kernels.h"
#include "vec.h"

#define F32_LOAD(x) (x)

#define DEFINE_ARGMAX_ROW(NAME, T, LOAD8, LOAD)                                                     \
    static int64_t NAME(const T *x, int n) {                                                        \
        int i = 0;                                                                                  \
        float best = LOAD(x[0]);                                                                    \
        int64_t at = 0;                                                                             \
        if (n >= 16) { /* lane l keeps the first largest of x[l], x[l + 8], ...; then the lanes compared */ \
            v8f top = LOAD8(x);                                                                     \
            v8i where = {0, 1, 2, 3, 4, 5, 6, 7}, index = where, nan = (v8i){0};                    \
            for (i = 8; i + 8 <= n; i += 8) {                                                       \
                v8f v = LOAD8(x + i);                                                               \
                index += 8;                                                                         \
                v8i more = v > top;                                                                 \
                nan |= v != v;                                                                      \
                top = select8(more, v, top);                                                        \
                where = (more & index) | (~more & where);                                           \
            }                                                                                       \
            nan |= top != top;                                                                      \
            int64_t any_nan = 0;                                                                    \
            for (int l = 0; l < 8; l++) any_nan |= nan[l];                                          \
            if (any_nan) { /* torch takes the first NaN */                                          \
                for (int j = 0; j < n; j++)                                                         \
                    if (LOAD(x[j]) != LOAD(x[j])) return j;                                         \
            }                                                                                       \
            float lanes[8];                                                                         \
            memcpy(lanes, &top, sizeof lanes);                                                      \
            best = lanes[0], at = where[0];                                                         \
            for (int l = 1; l < 8; l++)                                                             \
                if (lanes[l] > best || (lanes[l] == best && where[l] < at)) best = lanes[l], at = where[l]; \
        } else {                                                                                    \
            i = 1;                                                                                  \
            if (best != best) return 0;                                                             \
        }                                                                                           \
        for (; i < n; i++) {                                                                        \
            float xi = LOAD(x[i]);                                                                  \
            if (xi != xi) return i;                                                                 \
            if (xi > best) best = xi, at = i;                                                       \
        }                                                                                           \
        return at;                                                                                  \
    }

DEFINE_ARGMAX_ROW(argmax_row, float, f32_load8, F32_LOAD)
DEFINE_ARGMAX_ROW(argmax_row_bf16, uint16_t, bf16_load8, bf16_load)

/* x [rows][stride] float32, n columns; out [rows] int64. */
void pd_argmax(const float *x, int64_t stride, int rows, int n, int64_t *out, int threads) {
    _Pragma("omp parallel for schedule(static) if((int64_t)rows * n >= 65536) num_threads(threads)")
    for (int r = 0; r < rows; r++) out[r] = argmax_row(x + r * stride, n);
}

/* The same for bfloat16 rows. */
void pd_argmax_bf16(const uint16_t *x, int64_t stride, int rows, int n, int64_t *out, int threads) {
    _Pragma("omp parallel for schedule(static) if((int64_t)rows * n >= 65536) num_threads(threads)")
    for (int r = 0; r < rows; r++) out[r] = argmax_row_bf16(x + r * stride, n);
}
