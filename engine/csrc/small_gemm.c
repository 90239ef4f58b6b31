/* y = x @ W^T + bias for a few rows of x, on the CPU (engine/dense.py calls it for up to
   SMALL_ROWS rows; oneDNN takes larger products, where it is faster).

W is packed once into panels of 16 output columns, each panel K-major: panel p holds
W[16p .. 16p + 15, k] for k = 0 .. K - 1 contiguously (`sg_pack`, zeros past N). A job is one
panel times a tile of up to six rows: twelve 8-lane sums stay in registers while the panel streams
through once, so a decode step reads each weight once per six rows. The rows are split into tiles
as even as they go (16 rows: 5 + 5 + 6, not 6 + 6 + 4: a 4-row tile keeps too few sums in flight
to hide the multiply-add's latency).

The next panel is read ahead while this one computes, and every tile of the panel reads its share,
spread evenly over its k: that keeps the demand on memory level instead of bursting in the first
tile. Against the first tile alone doing all the reading, SmolLM2's 120 packed linears at 16 rows
went from 26.1 to 19.0 ms (2 threads, 130 to 179 GFLOP/s, the host's peak being about 205).

The threads split the jobs evenly, each a contiguous run of panels, and a thread that finishes its
run takes jobs from the back of another's (sg_gemm): at 16 rows the two threads of this 2-core host
stream ~27 GB/s of weights between them, and their shares of memory bandwidth are often unequal (a
neighbour on the host), so a static split left one thread waiting at the barrier for the other:
measured per thread over the 120 linears, 26-31 ms against 44-51 ms.

Each output is a plain sum over k in order, whatever the tile or thread, so a row's result depends
neither on the other rows nor on how many there are (batch-invariant, bit for bit). */
#include <stdint.h>
#include <stddef.h>
#include <string.h>

#include <omp.h>

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
                        float *y, int64_t ldy, int n0, int cols, const float *pf, int pf_every) {   \
        v8f a[R][2];                                                                                \
        for (int r = 0; r < R; r++) a[r][0] = a[r][1] = (v8f){0};                                   \
        int countdown = pf_every;                                                                   \
        for (int j = 0; j < k; j++) {                                                               \
            if (pf && --countdown == 0) { /* one line of the next panel every pf_every k */          \
                __builtin_prefetch(pf, 0, 1);                                                       \
                pf += 16;                                                                           \
                countdown = pf_every;                                                               \
            }                                                                                       \
            v8f w0 = f32_load8(w + j * 16), w1 = f32_load8(w + j * 16 + 8);                         \
            for (int r = 0; r < R; r++) {                                                           \
                v8f b = splat(x + r * ldx + j);                                                     \
                a[r][0] += b * w0;                                                                  \
                a[r][1] += b * w1;                                                                  \
            }                                                                                       \
        }                                                                                           \
        store_rows(a, R, bias, y, ldy, n0, cols);                                                   \
    }
TILE(1)
TILE(2)
TILE(3)
TILE(4)
TILE(5)
TILE(6)

/* Job `job` (panel job / tiles, tile job % tiles); `ahead`: read the next panel ahead while this
   one computes (the thread's next job is most likely that panel's). */
static void run_job(const float *x, int64_t ldx, const float *panels, const float *bias, float *y, int64_t ldy,
                    int m, int n, int k, int count, int tiles, int job, int ahead) {
    int p = job / tiles, t = job % tiles;
    int m0 = t * m / tiles, rows = (t + 1) * m / tiles - m0; /* tiles as even as m allows */
    int n0 = p * 16, cols = n - n0 < 16 ? n - n0 : 16;
    const float *w = panels + (int64_t)p * k * 16, *xt = x + (int64_t)m0 * ldx;
    float *yt = y + (int64_t)m0 * ldy;
    /* tile t of this panel reads ahead lines [t * k / tiles, ...) of the next, one every `tiles` k;
       one or two rows are paced by memory alone and read ahead nothing */
    const float *pf = ahead && m > 2 && p + 1 < count ? w + (int64_t)k * 16 + (int64_t)(t * k / tiles) * 16 : NULL;
    switch (rows) {
    case 1: tile1(xt, ldx, w, k, bias, yt, ldy, n0, cols, pf, tiles); break;
    case 2: tile2(xt, ldx, w, k, bias, yt, ldy, n0, cols, pf, tiles); break;
    case 3: tile3(xt, ldx, w, k, bias, yt, ldy, n0, cols, pf, tiles); break;
    case 4: tile4(xt, ldx, w, k, bias, yt, ldy, n0, cols, pf, tiles); break;
    case 5: tile5(xt, ldx, w, k, bias, yt, ldy, n0, cols, pf, tiles); break;
    default: tile6(xt, ldx, w, k, bias, yt, ldy, n0, cols, pf, tiles); break;
    }
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

/* x [m][ldx], panels from sg_pack, bias [n] or NULL, y [m][ldy].

   Each thread owns an even, contiguous share of the jobs (panel by panel, so the panel it reads
   ahead is its own next) and works through it from the front; a thread that runs out takes jobs
   from the back of another's share. On a host whose cores are not equally fast at the moment (a
   neighbour on one, or the two threads' shares of memory bandwidth unequal) the threads then finish
   together instead of the faster one waiting at the barrier. */
void sg_gemm(const float *x, int64_t ldx, const float *panels, const float *bias, float *y,
             int64_t ldy, int m, int n, int k, int threads) {
    int count = (n + 15) / 16, tiles = (m + 5) / 6, jobs = count * tiles;
    if (threads > jobs) threads = jobs;
    if (threads < 1) threads = 1;
    struct { _Alignas(64) uint64_t jobs; } ranges[threads]; /* a cache line each: no false sharing */
    for (int i = 0; i < threads; i++)
        ranges[i].jobs = (uint64_t)((int64_t)jobs * i / threads) << 32 | (uint64_t)((int64_t)jobs * (i + 1) / threads);
    _Pragma("omp parallel num_threads(threads)") {
        int me = omp_get_thread_num(), first, got;
        /* a panel's tiles at a time, one compare-and-swap each; a smaller team than asked for:
           the shares nobody owns are taken from the back too */
        while ((got = take(&ranges[me].jobs, 0, tiles, &first)) > 0)
            for (int job = first; job < first + got; job++)
                run_job(x, ldx, panels, bias, y, ldy, m, n, k, count, tiles, job, 1);
        for (int i = 1; i <= threads; i++) {
            uint64_t *other = &ranges[(me + i) % threads].jobs;
            while ((got = take(other, 1, 1, &first)) > 0)
                run_job(x, ldx, panels, bias, y, ldy, m, n, k, count, tiles, first, 0);
        }
    }
}
