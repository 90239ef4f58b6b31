/* Greedy sampling's argmax over logit rows, on the CPU (engine/sampler.py, engine/model_runner.py):
   the index torch's `argmax(dim=-1)` gives — the first of the largest values, or the first NaN where
   a row has one — eight lanes at a time, the rows shared among threads (torch's runs a 16-row,
   49k-vocabulary batch on one thread: 0.45 ms a step here). Float32 rows, or bfloat16 ones widened
   as they are read (exactly: the argmax of the rows converted to float32, without converting them). */
#include <stdint.h>
#include <string.h>

#include "pdserve_kernels.h"
#include "vec.h"

#define ARGMAX_NAME argmax_row
#define T float
#define LOAD8(p) f32_load8(p)
#define LOAD(x) (x)
#include "argmax_row.h"

#define ARGMAX_NAME argmax_row_bf16
#define T uint16_t
#define LOAD8(p) bf16_load8(p)
#define LOAD(x) bf16_load(x)
#include "argmax_row.h"

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
