/* y = x @ W^T + bias for a few rows of x, on the CPU (engine/forward/dense.py calls it for up to
   SMALL_ROWS rows; oneDNN takes larger products, where it is faster).

W is packed once into panels of 16 output columns, each panel K-major: panel p holds
W[16p .. 16p + 15, k] for k = 0 .. K - 1 contiguously (`pd_f32_pack`, zeros past N). A job is one
panel times a tile of up to TILE_ROWS rows (six with AVX2: twelve 8-lane sums stay in registers
while the panel streams through once; eight with AVX-512, one 16-lane sum a row), so a decode step
reads each weight from memory once and from cache once per tile. The rows are split into tiles as
even as they go (16 rows on AVX2: 5 + 5 + 6, not 6 + 6 + 4: a 4-row tile keeps too few sums in
flight to hide the multiply-add's latency).

The next panel is read ahead while this one computes, and every tile of the panel reads its share,
spread evenly over its k: that keeps the demand on memory level instead of bursting in the first
tile. Against the first tile alone doing all the reading, SmolLM2's 120 packed linears at 16 rows
went from 26.1 to 19.0 ms (2 threads, 130 to 179 GFLOP/s, the host's peak being about 205).

The threads split the jobs evenly, each a contiguous run of panels, and a thread that finishes its
run takes jobs from the back of another's (pd_f32_gemm): at 16 rows the two threads of this 2-core host
stream ~27 GB/s of weights between them, and their shares of memory bandwidth are often unequal (a
neighbour on the host), so a static split left one thread waiting at the barrier for the other:
measured per thread over the 120 linears, 26-31 ms against 44-51 ms.

Each output is a plain sum over k in order (one fused multiply-add per k), whatever the tile, thread
or vector width, so a row's result depends neither on the other rows nor on how many there are
(batch-invariant, bit for bit), and AVX2 and AVX-512 builds give the same bits. pd_f32_greedy relies on
it: it reruns single rows of a product and takes their bits as the full product's. */
#include <stdint.h>
#include <stddef.h>
#include <math.h>
#include <string.h>

#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "pdserve_kernels.h"
#include "vec.h"

void pd_f32_pack(const float *w, int64_t n, int64_t k, float *out) {
    int64_t panels = (n + 15) / 16;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t j = 0; j < k; j++)
            for (int c = 0; c < 16; c++) {
                int64_t row = p * 16 + c;
                out[(p * k + j) * 16 + c] = row < n ? w[row * k + j] : 0.0f;
            }
}

static inline void store_row(const float sums[16], const float *bias, float *yr, int n0, int cols) {
    for (int c = 0; c < cols; c++) yr[n0 + c] = sums[c] + (bias ? bias[n0 + c] : 0.0f);
}

/* A tile of R rows times one panel of weights of type WT (float, or IEEE half as uint16_t: the greedy
   head's first pass), widened by LOAD; PF_K: how many k one cache line of the panel holds. Every k,
   one line of the next panel every pf_every lines' worth of k is read ahead from pf. */
/* A tile function's name and parameters (TILE below, per vector width). */
#define TILE_HEAD(R, NAME, WT)                                                                      \
    static void NAME##R(const float *x, int64_t ldx, const WT *w, int k, const float *bias,        \
                        float *y, int64_t ldy, int n0, int cols, const WT *pf, int pf_every)

/* In a tile's k loop: LINES lines of the next panels from pf, every pf_every lines' worth of k. */
#define READ_AHEAD(PF_K, LINES)                                                                     \
    if (pf && --countdown == 0) {                                                                   \
        for (int l = 0; l < LINES; l++) __builtin_prefetch(pf + 16 * PF_K * l, 0, 1);               \
        pf += 16 * PF_K * LINES;                                                                    \
        countdown = pf_every * PF_K;                                                                \
    }

#if defined(__AVX512F__)
/* AVX-512: a panel's 16 columns are one register, a row's sums one more: half the multiply-adds of
   AVX2's two registers per row; and a job takes two neighbouring panels (below), 8 rows x 2 panels
   of sums in 16 of the 32 registers. Tiles of up to 8 rows (16 rows: 8 + 8). Measured on a 2-core
   Xeon with AVX-512 (2026-12-03; 16 rows, 2 threads): in cache (a 7 MB weight, again and again) 234-245
   GFLOP/s one panel a job, 270-286 two; streaming a 424 MB weight from memory, 17.7-18.4 GB/s one
   panel a job, 18.5-18.9 two (one row: 29-31 against 32.5 GB/s). Tiles of 12 or 16 rows, one panel,
   were slower than 8 (SmolLM2's 113 MB head read again and again, partly from the L3: 5.9 and
   6.2-6.4 ms against 5.6; 16 rows in one tile read the next panel ahead over one tile's k, not
   two). */
#define TILE_ROWS 8
static inline v16f f16_load16(const uint16_t *p) {
    __m512 wide = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    v16f x;
    memcpy(&x, &wide, sizeof x);
    return x;
}

#define TILE(R, NAME, WT, LOAD, PF_K)                                                               \
    TILE_HEAD(R, NAME, WT) {                                                                        \
        v16f a[R];                                                                                  \
        for (int r = 0; r < R; r++) a[r] = (v16f){0};                                               \
        int countdown = pf_every * PF_K;                                                            \
        for (int j = 0; j < k; j++) {                                                               \
            READ_AHEAD(PF_K, 1)                                                                     \
            v16f w0 = LOAD##16(w + j * 16);                                                         \
            for (int r = 0; r < R; r++) a[r] += splat16(x + r * ldx + j) * w0;                      \
        }                                                                                           \
        for (int r = 0; r < R; r++) {                                                               \
            float sums[16];                                                                         \
            memcpy(sums, &a[r], sizeof sums);                                                       \
            store_row(sums, bias, y + (int64_t)r * ldy, n0, cols);                                  \
        }                                                                                           \
    }
#define TILES(NAME, WT, LOAD, PF_K)                                                                 \
    TILE(1, NAME, WT, LOAD, PF_K) TILE(2, NAME, WT, LOAD, PF_K) TILE(3, NAME, WT, LOAD, PF_K)       \
    TILE(4, NAME, WT, LOAD, PF_K) TILE(5, NAME, WT, LOAD, PF_K) TILE(6, NAME, WT, LOAD, PF_K)       \
    TILE(7, NAME, WT, LOAD, PF_K) TILE(8, NAME, WT, LOAD, PF_K)
#define TILE_CASES(NAME, ARGS)                                                                      \
    case 1: NAME##1 ARGS; break; case 2: NAME##2 ARGS; break; case 3: NAME##3 ARGS; break;          \
    case 4: NAME##4 ARGS; break; case 5: NAME##5 ARGS; break; case 6: NAME##6 ARGS; break;          \
    case 7: NAME##7 ARGS; break; default: NAME##8 ARGS; break;

/* Two neighbouring panels at once (w, and w + 16 k): each row's broadcast feeds two multiply-adds,
   so a k takes 2 panel loads and R broadcasts for 2R multiply-adds, where one panel takes 1 + R
   for R. The next two panels are read ahead, two lines at a time. */
#define PANELS_PER_JOB 2
#define TILE2(R, NAME, WT, LOAD, PF_K)                                                              \
    static void NAME##R(const float *x, int64_t ldx, const WT *w, int k, const float *bias,        \
                        float *y, int64_t ldy, int n0, int cols, int cols2, const WT *pf,           \
                        int pf_every) {                                                             \
        v16f a[R], b[R];                                                                            \
        const WT *w2 = w + (int64_t)k * 16;                                                         \
        for (int r = 0; r < R; r++) a[r] = b[r] = (v16f){0};                                        \
        int countdown = pf_every * PF_K;                                                            \
        for (int j = 0; j < k; j++) {                                                               \
            READ_AHEAD(PF_K, 2)                                                                     \
            v16f w0 = LOAD##16(w + j * 16), w1 = LOAD##16(w2 + j * 16);                             \
            for (int r = 0; r < R; r++) {                                                           \
                v16f s = splat16(x + r * ldx + j);                                                  \
                a[r] += s * w0;                                                                     \
                b[r] += s * w1;                                                                     \
            }                                                                                       \
        }                                                                                           \
        for (int r = 0; r < R; r++) {                                                               \
            float sums[16];                                                                         \
            memcpy(sums, &a[r], sizeof sums);                                                       \
            store_row(sums, bias, y + (int64_t)r * ldy, n0, cols);                                  \
            memcpy(sums, &b[r], sizeof sums);                                                       \
            store_row(sums, bias, y + (int64_t)r * ldy, n0 + 16, cols2);                            \
        }                                                                                           \
    }
#define TILES2(NAME, WT, LOAD, PF_K)                                                                \
    TILE2(1, NAME, WT, LOAD, PF_K) TILE2(2, NAME, WT, LOAD, PF_K) TILE2(3, NAME, WT, LOAD, PF_K)    \
    TILE2(4, NAME, WT, LOAD, PF_K) TILE2(5, NAME, WT, LOAD, PF_K) TILE2(6, NAME, WT, LOAD, PF_K)    \
    TILE2(7, NAME, WT, LOAD, PF_K) TILE2(8, NAME, WT, LOAD, PF_K)
TILES2(pair_tile, float, f32_load, 1)
TILES2(half_pair_tile, uint16_t, f16_load, 2)
#else
/* AVX2 (or NEON): a row's 16 sums are two 8-lane registers; six rows' twelve fill the 16 registers
   with the panel's two and a broadcast. */
#define TILE_ROWS 6
#define TILE(R, NAME, WT, LOAD, PF_K)                                                               \
    TILE_HEAD(R, NAME, WT) {                                                                        \
        v8f a[R][2];                                                                                \
        for (int r = 0; r < R; r++) a[r][0] = a[r][1] = (v8f){0};                                   \
        int countdown = pf_every * PF_K;                                                            \
        for (int j = 0; j < k; j++) {                                                               \
            READ_AHEAD(PF_K, 1)                                                                     \
            v8f w0 = LOAD##8(w + j * 16), w1 = LOAD##8(w + j * 16 + 8);                             \
            for (int r = 0; r < R; r++) {                                                           \
                v8f b = splat(x + r * ldx + j);                                                     \
                a[r][0] += b * w0;                                                                  \
                a[r][1] += b * w1;                                                                  \
            }                                                                                       \
        }                                                                                           \
        for (int r = 0; r < R; r++) {                                                               \
            float sums[16];                                                                         \
            memcpy(sums, &a[r][0], sizeof a[r][0]);                                                 \
            memcpy(sums + 8, &a[r][1], sizeof a[r][1]);                                             \
            store_row(sums, bias, y + (int64_t)r * ldy, n0, cols);                                  \
        }                                                                                           \
    }
#define TILES(NAME, WT, LOAD, PF_K)                                                                 \
    TILE(1, NAME, WT, LOAD, PF_K) TILE(2, NAME, WT, LOAD, PF_K) TILE(3, NAME, WT, LOAD, PF_K)       \
    TILE(4, NAME, WT, LOAD, PF_K) TILE(5, NAME, WT, LOAD, PF_K) TILE(6, NAME, WT, LOAD, PF_K)
#define TILE_CASES(NAME, ARGS)                                                                      \
    case 1: NAME##1 ARGS; break; case 2: NAME##2 ARGS; break; case 3: NAME##3 ARGS; break;          \
    case 4: NAME##4 ARGS; break; case 5: NAME##5 ARGS; break; default: NAME##6 ARGS; break;
#define PANELS_PER_JOB 1
#endif
TILES(tile, float, f32_load, 1)
TILES(half_tile, uint16_t, f16_load, 2)

#define RUN_TILE(NAME) switch (rows) { TILE_CASES(NAME, (xt, ldx, w, k, bias, yt, ldy, n0, cols, pf, tiles)) }
#define RUN_PAIR(NAME) switch (rows) { TILE_CASES(NAME, (xt, ldx, w, k, bias, yt, ldy, n0, cols, cols2, pf, tiles)) }
/* RUN(NAME) on this job's panels, float32 ones, or half-float ones (half_NAME) where `half` is set */
#define ON_PANELS(RUN, NAME)                                                                        \
    if (half) {                                                                                     \
        const uint16_t *w = (const uint16_t *)panels + (int64_t)p * k * 16, *pf = reads_ahead ? w + next : NULL; \
        RUN(half_##NAME)                                                                            \
    } else {                                                                                        \
        const float *w = (const float *)panels + (int64_t)p * k * 16, *pf = reads_ahead ? w + next : NULL; \
        RUN(NAME)                                                                                   \
    }

/* Job `job` (PANELS_PER_JOB panels from panel job / tiles * PANELS_PER_JOB, tile job % tiles) on
   float32 panels, or on half-float ones where `half` is set; `ahead`: read the next panels ahead
   while these compute (the thread's next job is most likely theirs). */
static void run_job(const float *x, int64_t ldx, const void *panels, int half, const float *bias, float *y,
                    int64_t ldy, int m, int n, int k, int count, int tiles, int job, int ahead) {
    int p = job / tiles * PANELS_PER_JOB, t = job % tiles;
    int m0 = t * m / tiles, rows = (t + 1) * m / tiles - m0; /* tiles as even as m allows */
    int n0 = p * 16, cols = n - n0 < 16 ? n - n0 : 16;
    const float *xt = x + (int64_t)m0 * ldx;
    float *yt = y + (int64_t)m0 * ldy;
    /* tile t of these panels reads ahead lines [t * span / tiles, ...) of the next, span lines in
       all, evenly over its k; one or two rows are paced by memory alone and read ahead nothing */
    int64_t span = (int64_t)PANELS_PER_JOB * k;
    int64_t next = span * 16 + t * span / tiles * 16;
    int reads_ahead = ahead && m > 2 && p + PANELS_PER_JOB < count;
#if PANELS_PER_JOB == 2
    if (p + 1 < count) {
        int cols2 = n - n0 - 16 < 16 ? n - n0 - 16 : 16;
        ON_PANELS(RUN_PAIR, pair_tile)
        return;
    }
#endif
    ON_PANELS(RUN_TILE, tile)
}

/* A range of jobs [front, back) in one word, so that its owner taking from the front and a thief
   taking from the back never both get the same job. Takes up to `most` jobs; returns how many,
   the first at *first. */
static inline int take(uint64_t *range, int from_back, int most, int *first) {
    uint64_t seen = __atomic_load_n(range, __ATOMIC_RELAXED);
    for (;;) {
        uint32_t front = (uint32_t)(seen >> 32), back = (uint32_t)seen;
        if (front >= back) return 0;
        uint32_t got = back - front < (uint32_t)most ? back - front : (uint32_t)most;
        uint64_t want = from_back ? (seen & ~(uint64_t)UINT32_MAX) | (back - got) : seen + ((uint64_t)got << 32);
        if (__atomic_compare_exchange_n(range, &seen, want, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            *first = (int)(from_back ? back - got : front);
            return (int)got;
        }
    }
}

/* y = x @ W^T + bias from float32 panels (`half` 0) or half-float ones (`half` 1).

   Each thread owns an even, contiguous share of the jobs (panel by panel, so the panel it reads
   ahead is its own next) and works through it from the front; a thread that runs out takes jobs
   from the back of another's share. On a host whose cores are not equally fast at the moment (a
   neighbour on one, or the two threads' shares of memory bandwidth unequal) the threads then finish
   together instead of the faster one waiting at the barrier. */
static void gemm(const float *x, int64_t ldx, const void *panels, int half, const float *bias, float *y,
                 int64_t ldy, int m, int n, int k, int threads) {
    int count = (n + 15) / 16, tiles = (m + TILE_ROWS - 1) / TILE_ROWS;
    int jobs = (count + PANELS_PER_JOB - 1) / PANELS_PER_JOB * tiles;
    if (threads > jobs) threads = jobs;
    if (threads < 1) threads = 1;
    if (threads == 1) { /* no region (a caller's team runs it on each of its threads: layer_team.c) */
        for (int job = 0; job < jobs; job++) run_job(x, ldx, panels, half, bias, y, ldy, m, n, k, count, tiles, job, 1);
        return;
    }
    struct { _Alignas(64) uint64_t jobs; } ranges[threads]; /* a cache line each: no false sharing */
    for (int i = 0; i < threads; i++)
        ranges[i].jobs = (uint64_t)((int64_t)jobs * i / threads) << 32 | (uint64_t)((int64_t)jobs * (i + 1) / threads);
    _Pragma("omp parallel num_threads(threads)") {
        int me = omp_get_thread_num(), first, got;
        /* a panel's tiles at a time, one compare-and-swap each; a smaller team than asked for:
           the shares nobody owns are taken from the back too */
        while ((got = take(&ranges[me].jobs, 0, tiles, &first)) > 0)
            for (int job = first; job < first + got; job++)
                run_job(x, ldx, panels, half, bias, y, ldy, m, n, k, count, tiles, job, 1);
        for (int i = 1; i <= threads; i++) {
            uint64_t *other = &ranges[(me + i) % threads].jobs;
            while ((got = take(other, 1, 1, &first)) > 0)
                run_job(x, ldx, panels, half, bias, y, ldy, m, n, k, count, tiles, first, 0);
        }
    }
}

/* x [m][ldx], panels from pd_f32_pack, bias [n] or NULL, y [m][ldy]. */
void pd_f32_gemm(const float *x, int64_t ldx, const float *panels, const float *bias, float *y,
             int64_t ldy, int m, int n, int k, int threads) {
    gemm(x, ldx, panels, 0, bias, y, ldy, m, n, k, threads);
}

/* max_j (a[j] - c norms[j]), or NaN where any a[j] is NaN or infinite. */
static float lowest_bound(const float *a, const float *norms, int n, float c) {
    v8f top = (v8f){0} - INFINITY, bad = (v8f){0}, cv = (v8f){0} + c;
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        v8f v = f32_load8(a + j);
        top = vmax(v - cv * f32_load8(norms + j), top);
        bad += v - v; /* 0, or NaN for a NaN or an infinity */
    }
    float best = -INFINITY, nan = 0;
    for (int l = 0; l < 8; l++) best = top[l] > best ? top[l] : best, nan += bad[l];
    for (; j < n; j++) best = a[j] - c * norms[j] > best ? a[j] - c * norms[j] : best, nan += a[j] - a[j];
    return nan == 0 ? best : NAN;
}

/* The greedy token of each row of y = x @ W^T + bias, the argmax of the float32 product bit for bit,
   without reading all of W's float32 panels (engine/forward/greedy_head.py has the argument).

   1. A = x @ f16(W)^T + bias, from `half`, the panels rounded to IEEE half floats (half the bytes);
      or, with half NULL, `approx` as the caller computed it (pd_amx_head_approx), `rel` and `abs_` its bound.
   2. For row r, every float32 logit L_j lies within D_j = |x_r| (rel * norms[j] + abs) of A_j
      (`rel`, `abs`: the rounding's error, from the caller; norms[j] >= |W_j|), so the argmax of L
      is among the columns with A_j + D_j >= max_i (A_i - D_i).
   3. Each panel holding such a column is multiplied by row r alone, exactly as pd_f32_gemm does (each
      output a plain sum over k in order: the same bits), and the largest of those columns' L, the
      first on a tie, is the row's token.

   approx: [m][n] scratch. tokens [m]; reread [m]: how many panels step 3 read for each row.
   Returns 0, or -1 where a row's values are not all finite (the caller takes the full product). */
int pd_f32_greedy(const float *x, int64_t ldx, const float *panels, const uint16_t *half, const float *bias,
              const float *norms, float *approx, int m, int n, int k, double rel, double abs_, int64_t *tokens,
              int32_t *reread, int threads) {
    if (half != NULL) gemm(x, ldx, half, 1, bias, approx, n, m, n, k, threads); /* NULL: the caller's approx */
    int failed = 0;
    _Pragma("omp parallel for schedule(dynamic) num_threads(threads) reduction(|:failed)")
    for (int r = 0; r < m; r++) {
        const float *xr = x + (int64_t)r * ldx, *ar = approx + (int64_t)r * n;
        double size = 0;
        for (int i = 0; i < k; i++) size += (double)xr[i] * xr[i];
        size = sqrt(size);
        /* per unit of norms[j], and for every column; rounded up generously (a part in a thousand) */
        float c = (float)(rel * size * 1.001), e = (float)(abs_ * size * 1.001);
        float low = lowest_bound(ar, norms, n, c); /* NaN where a value is not finite */
        /* the window's own float32 arithmetic: a few ulps of the logits' size */
        float margin = 0x1p-20f * (fabsf(low) + 1.0f);
        if (!(size < INFINITY) || !(c < INFINITY) || low != low) { /* NaN or infinity in x, W or the bias */
            failed |= 1;
            continue;
        }
        float floor_ = low - 2 * e - margin, best = -INFINITY, exact[16];
        int64_t at = -1;
        int read = 0;
        v8f fl = (v8f){0} + floor_, cv = (v8f){0} + c;
        for (int p = 0; p * 16 < n; p++) { /* a panel's 16 columns at a time */
            int n0 = p * 16, cols = n - n0 < 16 ? n - n0 : 16;
            int any = 0;
            if (cols == 16) {
                v8i hit = (f32_load8(ar + n0) + cv * f32_load8(norms + n0) >= fl)
                          | (f32_load8(ar + n0 + 8) + cv * f32_load8(norms + n0 + 8) >= fl);
                for (int l = 0; l < 8; l++) any |= hit[l];
            } else {
                for (int j = n0; j < n0 + cols; j++) any |= ar[j] + c * norms[j] >= floor_;
            }
            if (!any) continue;
            /* this panel times row r alone: float32, as pd_f32_gemm sums it */
            tile1(xr, ldx, panels + (int64_t)p * k * 16, k, bias ? bias + n0 : NULL, exact, 16, 0, cols, NULL, 1);
            read++;
            for (int j = n0; j < n0 + cols; j++) {
                if (!(ar[j] + c * norms[j] >= floor_)) continue;
                float v = exact[j - n0];
                if (v != v || v == INFINITY || v == -INFINITY) failed |= 1;
                if (v > best) best = v, at = j;
            }
        }
        tokens[r] = at;
        reread[r] = read;
        if (at < 0) failed |= 1;
    }
    return failed ? -1 : 0;
}
