/* A bfloat16 greedy LM head that reads half its bytes: a first pass over an int8 copy of the head on
   AMX-INT8 tiles bounds every logit, and only the panels whose columns can still be a row's largest
   are rerun exactly (amx_gemm.c's amx_greedy_panels: the bits pd_amx_gemm would write, rounded to
   bfloat16, the first on a tie). The token is the unfused head's, bit for bit; not an approximation.

A decode step's head is bound by its weights' stream: a 262,144 x 640 bfloat16 head is 335 MB a
step, ~12 ms at the ~25 GB/s two cores of host E read (docs/engine_speed.md, "The greedy head").
The int8 copy is 168 MB.

The bound. Column j of the head, W_j (bfloat16), is kept as W~_j = s_j q_j, q_j int8, s_j = max|W_j|
/ 127; E_j = W_j - W~_j is measured at packing (e1_j = max|E_j|, e2_j = |E_j|_2, with n2_j = |W_j|_2).
A row x (bfloat16) is split into two int8 parts, x~ = s_x (q1 + q2 / 128), |x - x~| about s_x / 256
an element. The tiles give d1 = q1 . q_j and d2 = q2 . q_j exactly (int32), so
A_j = s_x s_j (d1 + d2 / 128) = x~ . W~_j. The unfused head's float32 sum L_j (K exact products
summed in float32 on the tiles, bfloat16 subnormals flushed) then has

    |L_j - A_j| <= |x - x~|_2 n2_j + min(|x~|_1 e1_j, |x~|_2 e2_j) + g |x|_2 n2_j + t = D_j

(Cauchy-Schwarz and Hoelder; g = 2K 2^-24 / (1 - 2K 2^-24) the float32 sum's rounding, t = K 2^-125
(1 + max|x| + max|W|) for the flushed subnormals), and A_j, D_j computed in float32 get a relative
slack of 2^-20 of the products' size and 2^-18 of D_j. With R the GEMM's rounding to bfloat16 (nearest
even, monotone) the row's token j* (the first largest R(L)) has, for every column i,
R(A_j* + D_j*) >= R(L_j*) >= R(L_i) >= R(A_i - D_i): every column tied at the row's largest value is
in the set {j : R(A_j + D_j) >= max_i R(A_i - D_i)}. The rerun takes every panel (16 columns) that
holds one such column for any row, computes those panels exactly for all the rows, and keeps each
row's first largest: a superset of the set, exact values, so the same token.

Per call: the rows staged as two int8 tile sets, each thread a share of the panels, two at a time
(tiles 0-3 the sums of q1 and q2 by each panel, 4-5 the rows, 6-7 the panels); per panel and row the
largest A + D of its 16 columns ([rows][panels] floats, 1 MiB at 16 rows of a 262k head) and per row
the running largest A - D. Where more than `most` of the panels would be rerun, it returns 2 and
the caller runs the exact fused head instead (pd_bf16_greedy), as it does for a row it does not bound
(a value that is not finite, or a row of zeros). */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pdserve_kernels.h"
#include "amx.h"
#include "vec.h"
#include "greedy_lanes.h"

#if HAVE_AMX && defined(__AMX_INT8__) && defined(__AVX512F__)
#define HAVE_I8 1
#else
#define HAVE_I8 0
#endif

#define I8_ROWS 16     /* a decode step's rows: one row tile */
#define I8_MAX_K 65536 /* d1, d2 exact in int32: K 127 127 < 2^31 */

static inline int64_t k64(int64_t k) { return (k + 63) / 64 * 64; }

/* v rounded up to a float. */
static inline float up(double v) {
    float f = (float)v;
    return (double)f < v ? nextafterf(f, INFINITY) : f;
}

int pd_i8_head_ready(void) { return HAVE_I8 && amx_permitted(); }

/* panels (pd_amx_pack's layout of a [n][k] bfloat16 head) -> q, [ceil(n / 16)][k64(k) / 64][16][16][4]
   int8 (AMX-INT8's B tiles: panel p's step c, row k4, column col, e = W~[16 p + col][64 c + 4 k4 + e]),
   and cols [5][16 ceil(n / 16)] floats: s_j, n2_j, e1_j, e2_j (rounded up), and 0 for a column, -inf for
   the last panel's padding. Returns 0; -1 where a weight is not finite or k is out of range. */
int pd_i8_head_pack(const uint16_t *panels, int64_t n, int64_t k, int8_t *q, float *cols) {
    if (k < 1 || k > I8_MAX_K || n < 1) return -1;
    int64_t kp = (k + 31) / 32 * 32, kq = k64(k), np = (n + 15) / 16, width = np * 16;
    int bad = 0;
    _Pragma("omp parallel for schedule(static) reduction(|:bad)")
    for (int64_t p = 0; p < np; p++) {
        memset(q + p * kq * 16, 0, (size_t)(kq * 16));
        for (int c = 0; c < 16; c++) {
            int64_t j = 16 * p + c;
            double m = 0, n2 = 0, e1 = 0, e2 = 0;
            for (int64_t kk = 0; kk < k; kk++) {
                float w = bf16_load(panels[((p * (kp / 2) + kk / 2) * 16 + c) * 2 + (kk & 1)]);
                if (!isfinite(w)) bad = 1;
                m = fabs(w) > m ? fabs(w) : m;
            }
            float s = (float)(m / 127);
            for (int64_t kk = 0; kk < k && m > 0; kk++) {
                double w = bf16_load(panels[((p * (kp / 2) + kk / 2) * 16 + c) * 2 + (kk & 1)]);
                double v = nearbyint(w / s);
                v = v > 127 ? 127 : v < -127 ? -127 : v;
                double e = fabs(w - (double)s * v); /* s * v: 24 + 7 bits, exact in a double */
                q[((p * (kq / 64) + kk / 64) * 16 + (kk % 64) / 4) * 64 + c * 4 + kk % 4] = (int8_t)v;
                n2 += w * w, e2 += e * e, e1 = e > e1 ? e : e1;
            }
            cols[j] = m > 0 ? s : 0;
            cols[width + j] = up(sqrt(n2) * (1 + 0x1p-40));
            cols[2 * width + j] = up(e1);
            cols[3 * width + j] = up(sqrt(e2) * (1 + 0x1p-40));
            cols[4 * width + j] = j < n ? 0.0f : -INFINITY;
        }
    }
    return bad ? -1 : 0;
}

#if HAVE_I8
typedef struct {
    float s, c1, c2, c3, t; /* s_x; |x - x~|_2 + g |x|_2; |x~|_1; |x~|_2; the flushed subnormals' t */
} row_bound;

/* Row r of x split into two int8 parts, staged as A tiles (a1, a2: step c's 16 rows of 64 at
   + c 1024 + r 64), and its bound's terms. Returns 0; 1 where the row is not bounded here. */
static int stage_row(const uint16_t *x, int64_t k, double wmax, int r, int8_t *a1, int8_t *a2, row_bound *b) {
    double xmax = 0;
    for (int64_t kk = 0; kk < k; kk++) {
        float v = bf16_load(x[kk]);
        if (!isfinite(v)) return 1;
        xmax = fabs(v) > xmax ? fabs(v) : xmax;
    }
    if (xmax == 0) return 1;
    float s = (float)(xmax / 127);
    double ex = 0, x1 = 0, x2 = 0, xx = 0;
    for (int64_t kk = 0; kk < k; kk++) {
        double v = bf16_load(x[kk]), h = nearbyint(v / s);
        h = h > 127 ? 127 : h < -127 ? -127 : h;
        double l = nearbyint((v - (double)s * h) * 128 / s);
        l = l > 127 ? 127 : l < -127 ? -127 : l;
        double t = (double)s * (h + l / 128); /* 24 + 15 bits: exact */
        a1[(kk / 64) * 1024 + r * 64 + kk % 64] = (int8_t)h;
        a2[(kk / 64) * 1024 + r * 64 + kk % 64] = (int8_t)l;
        ex += (v - t) * (v - t), x1 += fabs(t), x2 += t * t, xx += v * v;
    }
    double g = 2.0 * k * 0x1p-24 / (1 - 2.0 * k * 0x1p-24), slack = 1 + 0x1p-30;
    *b = (row_bound){s, up((sqrt(ex) + g * sqrt(xx)) * slack), up(x1 * slack), up(sqrt(x2) * slack),
                     up((double)k * 0x1p-125 * (1 + xmax + wmax))};
    return 0;
}

/* Tile (p, c) of the int8 copy: panel p's values of k 64 c .. 64 c + 63. */
#define QPANEL(p, c) (q + ((int64_t)(p) * (kq / 64) + (int64_t)(c)) * 1024)

/* Panels [lo, hi) of one thread: each row's largest A + D per panel into upper[r][p], and its
   running largest A - D into low[r]. */
static void first_pass(const int8_t *a1, const int8_t *a2, const int8_t *q, const float *cols, int64_t width,
                       const row_bound *rb, int rows, int64_t kq, int64_t np, int64_t lo, int64_t hi, float *upper,
                       v16f *low) {
    int32_t sums[4][16][16];
    /* the pair's tiles `ahead` k-steps on prefetched as each step runs (the next pair's first steps
       near the end of this one), and the first steps at the start, as amx_gemm.c's decode path does */
    amx_stream stream = amx_stream_start(q, kq * 16, kq / 64, 2, lo, hi); /* a panel: kq / 64 tiles */
    for (int64_t p0 = lo; p0 < hi; p0 += 2) {
        int cnt = hi - p0 < 2 ? 1 : 2;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < kq / 64; c++) {
            amx_prefetch_ahead(&stream, p0, c);
            _tile_loadd(4, a1 + c * 1024, 64);
            _tile_loadd(5, a2 + c * 1024, 64);
            _tile_loadd(6, QPANEL(p0, c), 64);
            _tile_dpbssd(0, 4, 6);
            _tile_dpbssd(2, 5, 6);
            if (cnt > 1) {
                _tile_loadd(7, QPANEL(p0 + 1, c), 64);
                _tile_dpbssd(1, 4, 7);
                _tile_dpbssd(3, 5, 7);
            }
        }
        _tile_stored(0, sums[0], 64);
        _tile_stored(2, sums[2], 64);
        if (cnt > 1) {
            _tile_stored(1, sums[1], 64);
            _tile_stored(3, sums[3], 64);
        }
        for (int i = 0; i < cnt; i++) {
            int64_t j = (p0 + i) * 16;
            __m512 s = _mm512_loadu_ps(cols + j), n2 = _mm512_loadu_ps(cols + width + j);
            __m512 e1 = _mm512_loadu_ps(cols + 2 * width + j), e2 = _mm512_loadu_ps(cols + 3 * width + j);
            __m512 pad = _mm512_loadu_ps(cols + 4 * width + j);
            for (int r = 0; r < rows; r++) {
                const row_bound *b = rb + r;
                __m512 d1 = _mm512_cvtepi32_ps(_mm512_loadu_si512(sums[i][r]));
                __m512 d2 = _mm512_cvtepi32_ps(_mm512_loadu_si512(sums[2 + i][r]));
                __m512 sx = _mm512_mul_ps(s, _mm512_set1_ps(b->s));
                __m512 a = _mm512_mul_ps(_mm512_fmadd_ps(d2, _mm512_set1_ps(1.0f / 128), d1), sx);
                __m512 size = _mm512_mul_ps(_mm512_fmadd_ps(_mm512_abs_ps(d2), _mm512_set1_ps(1.0f / 128),
                                                            _mm512_abs_ps(d1)), sx);
                __m512 d = _mm512_fmadd_ps(_mm512_set1_ps(b->c1), n2,
                                           _mm512_min_ps(_mm512_mul_ps(_mm512_set1_ps(b->c2), e1),
                                                         _mm512_mul_ps(_mm512_set1_ps(b->c3), e2)));
                d = _mm512_add_ps(d, _mm512_set1_ps(b->t));
                d = _mm512_fmadd_ps(size, _mm512_set1_ps(0x1p-20f), _mm512_mul_ps(d, _mm512_set1_ps(1 + 0x1p-18f)));
                upper[r * np + p0 + i] = _mm512_reduce_max_ps(_mm512_add_ps(_mm512_add_ps(a, d), pad));
                v16f l = (v16f)_mm512_add_ps(_mm512_sub_ps(a, d), pad);
                low[r] = vmax16(low[r], l);
            }
        }
    }
}
#undef QPANEL
#endif

/* x [rows][k] bfloat16 (rows x_stride apart, 1 <= rows <= 16) -> tokens [rows], the argmax of each row of
   pd_amx_gemm's output over `panels` (the first on a tie), by the int8 copy (q, cols: pd_i8_head_pack's;
   wmax: the head's largest |weight|) and a rerun of the candidate panels; upper: rows * ceil(n / 16)
   floats of scratch. *reread: the panels rerun (-1 where none was tried). Returns 0; 1 where a row's
   output has a NaN; 2 where the pass does not decide (a row it does not bound, or more than most x the
   panels to rerun: the caller takes the exact head); -1 where AMX-INT8 is not here or an argument is out
   of range; -2 out of memory. No bias (a head with one does not take this path). */
int pd_bf16_greedy_i8(const uint16_t *x, int64_t x_stride, const uint16_t *panels, const int8_t *q, const float *cols,
                      int rows, int64_t n, int64_t k, double wmax, double most, float *upper, int64_t *tokens,
                      int64_t *reread, int threads) {
    *reread = -1;
#if HAVE_I8
    if (!amx_ready() || rows < 1 || rows > I8_ROWS || k < 1 || k > I8_MAX_K || n < 1 || n >= INT32_MAX) return -1;
    threads = threads < 1 ? 1 : threads;
    int64_t kq = k64(k), np = (n + 15) / 16;
    int8_t *a = aligned_alloc(64, (size_t)(2 * kq * 16));
    row_bound *rb = malloc(sizeof(row_bound) * (size_t)rows);
    v16f *low = aligned_alloc(64, sizeof(v16f) * (size_t)threads * I8_ROWS);
    int32_t *list = malloc(sizeof(int32_t) * (size_t)np);
    uint8_t *mark = calloc((size_t)np, 1);
    int rc = a && rb && low && list && mark ? 0 : -2;
    if (rc == 0) memset(a, 0, (size_t)(2 * kq * 16));
    for (int r = 0; rc == 0 && r < rows; r++)
        if (stage_row(x + r * x_stride, k, wmax, r, a, a + kq * 16, rb + r)) rc = 2;
    for (int64_t i = 0; rc == 0 && i < (int64_t)threads * I8_ROWS; i++) low[i] = (v16f)_mm512_set1_ps(-INFINITY);
    if (rc == 0) {
        _Pragma("omp parallel num_threads(threads)")
        {
            int t = omp_get_thread_num(), count = omp_get_num_threads();
            amx_configure();
            first_pass(a, a + kq * 16, q, cols, np * 16, rb, rows, kq, np, np * t / count, np * (t + 1) / count,
                       upper, low + (int64_t)t * I8_ROWS);
            _tile_release();
        }
    }
    int64_t count = 0;
    for (int r = 0; rc == 0 && r < rows; r++) {
        v16f best = low[r];
        for (int t = 1; t < threads; t++) best = vmax16(best, low[(int64_t)t * I8_ROWS + r]);
        float tau = _mm512_reduce_max_ps((__m512)best);
        if (!(tau > -INFINITY) || isnan(tau)) {
            rc = 2;
            break;
        }
        v16f floor = bf16_round16((v16f)_mm512_set1_ps(tau));
        int64_t p = 0;
        for (; p + 16 <= np; p += 16) {
            v16f u = f32_load16(upper + r * np + p);
            __mmask16 keep = _mm512_cmp_ps_mask((__m512)bf16_round16(u), (__m512)floor, _CMP_GE_OQ) |
                             _mm512_cmp_ps_mask((__m512)u, (__m512)u, _CMP_UNORD_Q); /* NaN: keep, conservatively */
            for (; keep; keep &= keep - 1) mark[p + __builtin_ctz(keep)] = 1;
        }
        for (; p < np; p++) {
            float u = upper[r * np + p];
            if (isnan(u) || bf16_load(bf16_store(u)) >= floor[0]) mark[p] = 1;
        }
    }
    for (int64_t p = 0; rc == 0 && p < np; p++)
        if (mark[p]) list[count++] = (int32_t)p;
    if (rc == 0) {
        *reread = count;
        if ((double)count > most * (double)np) rc = 2;
        else rc = amx_greedy_panels(x, x_stride, panels, rows, n, k, list, count, tokens, threads);
    }
    free(a), free(rb), free(low), free(list), free(mark);
    return rc;
#else
    (void)x, (void)x_stride, (void)panels, (void)q, (void)cols, (void)rows, (void)n, (void)k, (void)wmax, (void)most;
    (void)upper, (void)tokens, (void)threads;
    return -1;
#endif
}
