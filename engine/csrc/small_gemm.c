/* y = x @ W^T + bias for a few rows of x, on the CPU (engine/dense.py calls it for up to
   SMALL_ROWS rows; oneDNN takes larger products, where it is faster).

W is packed once into panels of 16 output columns, each panel K-major: panel p holds
W[16p .. 16p + 15, k] for k = 0 .. K - 1 contiguously (`sg_pack`, zeros past N). A job is one
panel times a tile of up to six rows: twelve 8-lane sums stay in registers while the panel streams
through once, so a decode step reads each weight once per six rows. Past two rows the panel's
first tile also prefetches the next panel, so its read from memory overlaps the later tiles'
arithmetic instead of following it (at sixteen rows this took the 210 linears of SmolLM2 from
52 to 44 ms; one or two rows are paced by memory alone and gain nothing). Each
output is a plain sum over k in order (split into even and odd k for one or two rows, to keep
more sums in flight), so a row's result does not depend on the other rows. */
#include <stdint.h>
#include <stddef.h>
#include <string.h>

#include "vec.h"

void sg_pack(const float *w, int64_t n, int64_t k, float *out) {
    int64_t panels = (n + 15) / 16;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t j = 0; j < k; j++)
            for (int c = 0; c < 16; c++) {
                int64_t row = p * 16 + c;
                out[(p * k + j) * 16 + c] = row < n ? w[row * k + j] : 0.0f;
            }
}

static inline void store_rows(v8f (*a)[2], int rows, const float *bias, float *y, int64_t ldy, int n0,
                              int cols) {
    for (int r = 0; r < rows; r++) {
        float sums[16];
        memcpy(sums, &a[r][0], sizeof a[r][0]);
        memcpy(sums + 8, &a[r][1], sizeof a[r][1]);
        float *yr = y + (int64_t)r * ldy + n0;
        for (int c = 0; c < cols; c++) yr[c] = sums[c] + (bias ? bias[n0 + c] : 0.0f);
    }
}

#define TILE(R)                                                                                     \
    static void tile##R(const float *x, int64_t ldx, const float *w, int k, const float *bias,      \
                        float *y, int64_t ldy, int n0, int cols, const float *pf) {                 \
        v8f a[R][2], odd[R][2];                                                                     \
        for (int r = 0; r < R; r++) a[r][0] = a[r][1] = odd[r][0] = odd[r][1] = (v8f){0};           \
        int j = 0;                                                                                  \
        for (; R <= 2 && j + 1 < k; j += 2) {                                                       \
            v8f w0 = f32_load8(w + j * 16), w1 = f32_load8(w + j * 16 + 8);                         \
            v8f u0 = f32_load8(w + j * 16 + 16), u1 = f32_load8(w + j * 16 + 24);                   \
            for (int r = 0; r < R; r++) {                                                           \
                v8f b = splat(x + r * ldx + j), c = splat(x + r * ldx + j + 1);                     \
                a[r][0] += b * w0;                                                                  \
                a[r][1] += b * w1;                                                                  \
                odd[r][0] += c * u0;                                                                \
                odd[r][1] += c * u1;                                                                \
            }                                                                                       \
        }                                                                                           \
        for (; j < k; j++) {                                                                        \
            if (pf) __builtin_prefetch(pf + j * 16, 0, 1);                                          \
            v8f w0 = f32_load8(w + j * 16), w1 = f32_load8(w + j * 16 + 8);                         \
            for (int r = 0; r < R; r++) {                                                           \
                v8f b = splat(x + r * ldx + j);                                                     \
                a[r][0] += b * w0;                                                                  \
                a[r][1] += b * w1;                                                                  \
            }                                                                                       \
        }                                                                                           \
        for (int r = 0; r < R; r++) {                                                               \
            a[r][0] += odd[r][0];                                                                   \
            a[r][1] += odd[r][1];                                                                   \
        }                                                                                           \
        store_rows(a, R, bias, y, ldy, n0, cols);                                                   \
    }
TILE(1)
TILE(2)
TILE(3)
TILE(4)
TILE(5)
TILE(6)

/* x [m][ldx], panels from sg_pack, bias [n] or NULL, y [m][ldy]. */
void sg_gemm(const float *x, int64_t ldx, const float *panels, const float *bias, float *y,
             int64_t ldy, int m, int n, int k, int threads) {
    int count = (n + 15) / 16, tiles = (m + 5) / 6;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int job = 0; job < count * tiles; job++) {
        int p = job / tiles, m0 = (job % tiles) * 6;
        int rows = m - m0 < 6 ? m - m0 : 6, n0 = p * 16, cols = n - n0 < 16 ? n - n0 : 16;
        const float *w = panels + (int64_t)p * k * 16, *xt = x + (int64_t)m0 * ldx;
        float *yt = y + (int64_t)m0 * ldy;
        const float *pf = m0 == 0 && m > 2 && p + 1 < count ? w + (int64_t)k * 16 : NULL;
        switch (rows) {
        case 1: tile1(xt, ldx, w, k, bias, yt, ldy, n0, cols, pf); break;
        case 2: tile2(xt, ldx, w, k, bias, yt, ldy, n0, cols, pf); break;
        case 3: tile3(xt, ldx, w, k, bias, yt, ldy, n0, cols, pf); break;
        case 4: tile4(xt, ldx, w, k, bias, yt, ldy, n0, cols, pf); break;
        case 5: tile5(xt, ldx, w, k, bias, yt, ldy, n0, cols, pf); break;
        default: tile6(xt, ldx, w, k, bias, yt, ldy, n0, cols, pf); break;
        }
    }
}
