/* bfloat16 linears on AMX tiles: out = x @ W^T + bias, for up to 256 rows a call; engine/forward/dense.py's
   `PackedLinear` gives it up to 32 (cpu_kernel.AmxGemm.max_rows: past that oneDNN's module path) and
   a prompt step run as one region (layer_team.c) its tiles of up to 256 rows, where the CPU has AMX.

A decode step reads every weight once for a handful of rows: it is bound by how fast the weights
stream from memory, and a tile product (16 rows x 16 columns x 32 of k in one instruction) leaves
the cores free to keep the stream going. The weight is packed once into panels of 16 columns in
the tiles' pair layout, panels[p][k2][c][e] = W[16 p + c][2 k2 + e] (k padded with zeros to a
multiple of 32, the last panel's missing columns zero): a panel's 32 values of k are one 1 KiB
tile, read straight from the panels. The rows are staged once per call, zero-padded to whole tiles
and laid out tile by tile, so a row tile's 32 values of k are one contiguous 1 KiB too.

Each thread takes an even share of the panels, the sums in tiles 0-3 over all of k: up to 16 rows,
four panels at a time; more, a pair of panels at a time through every block of 32 rows (2 x 2
tiles), so the pair streams from memory once a call and from cache for the other blocks. Every
output is one float32 sum of exact products in the order of k, whatever the blocking or the row
count, then the bias added and rounded once to bfloat16 (nearest even): a row's result does not
depend on what it is batched with. SmolLM2-135M's linears at 16 rows, 2 threads (2026-12-03, Xeon
host with AMX): 9.6 ms for its 269 MB of weights (28 GB/s), where oneDNN's packed bfloat16 linears
took 16.4 ms in the engine's step. A prompt's rows (host E, 2026-12-05, one thread, the Gemma-3-shaped
checkpoint's gate|up and down at 256 rows): 430-470 GMAC/s, against 350 with the rows read in place
(row-major staging) and 145 in 32-row calls, each streaming the weights again
(docs/engine_speed.md, "bfloat16 linears"). */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pdserve_kernels.h"
#include "amx.h"
#include "vec.h"
#include "greedy_lanes.h"

#define MAX_ROWS 256

static inline int64_t padded_k(int64_t k) { return (k + 31) / 32 * 32; }

/* w [n][k] bfloat16 -> panels, [ceil(n / 16)][padded_k(k) / 2][16][2]. */
void pd_amx_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *panels) {
    int64_t kp = padded_k(k), np = (n + 15) / 16;
    for (int64_t p = 0; p < np; p++)
        for (int64_t k2 = 0; k2 < kp / 2; k2++)
            for (int c = 0; c < 16; c++)
                for (int e = 0; e < 2; e++) {
                    int64_t col = 16 * p + c, kk = 2 * k2 + e;
                    panels[((p * (kp / 2) + k2) * 16 + c) * 2 + e] = col < n && kk < k ? w[col * k + kk] : 0;
                }
}

int amx_prefetch_steps = 4; /* pd_amx_prefetch */

int pd_amx_prefetch(int steps) {
    int was = amx_prefetch_steps;
    if (steps >= 0) amx_prefetch_steps = steps;
    return was;
}

/* Whether the tiles may be used here (the CPU has them and the OS lets this process use them). */
int pd_amx_gemm_ready(void) { return amx_permitted(); }

#if HAVE_AMX
/* `cols` sums of one row plus their bias (or none), rounded to bfloat16 (nearest even) into o. */
static inline void store_sums(const float *s, const uint16_t *bias, uint16_t *o, int64_t cols) {
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= cols; j += 16)
        bf16_store16(o + j, bias ? f32_load16(s + j) + bf16_load16(bias + j) : f32_load16(s + j));
#endif
    for (; j + 8 <= cols; j += 8) bf16_store8(o + j, bias ? f32_load8(s + j) + bf16_load8(bias + j) : f32_load8(s + j));
    for (; j < cols; j++) o[j] = bf16_store(bias ? s[j] + bf16_load(bias[j]) : s[j]);
}

#if defined(__AVX512F__)
#define FUSED_ARGMAX 1
#else
#define FUSED_ARGMAX 0
typedef struct best16 best16; /* never made here */
#endif

/* m rows' sums of a block ([m][ld] floats, its first `cols` columns from col0 on) biased and rounded:
   into out, or, with best (amx_greedy), into the rows' running argmax instead. */
static inline void block_out(const float *sums, int ld, int m, const uint16_t *bias, uint16_t *out,
                             int64_t out_stride, best16 *best, int64_t col0, int64_t cols) {
#if FUSED_ARGMAX
    if (best) {
        keep_best(sums, m, ld / 16, bias ? bias + col0 : NULL, best, col0, cols);
        return;
    }
#endif
    for (int r = 0; r < m; r++)
        store_sums(sums + (int64_t)r * ld, bias ? bias + col0 : NULL, out + (int64_t)r * out_stride + col0, cols);
}

/* Tile (p, c): panel p's values of k 32 c .. 32 c + 31. */
#define PANEL(p, c) (panels + ((int64_t)(p) * (kp / 2) + (int64_t)(c) * 16) * 32)

/* One step c of k (32 values) for four panels p0 .. p0 + cnt - 1 (cnt <= 4) and up to 16 rows: tiles
   0-3 += the rows (a, in tile 4) times each panel (B tiles 5, 6, 5, 6); with a2, a second set of
   rows (tile 7) summed into the same tiles right after the first. */
static inline void four_panels(const uint16_t *a, const uint16_t *a2, int64_t xrow, const uint16_t *panels,
                               int64_t kp, int64_t p0, int64_t c, int cnt) {
    _tile_loadd(4, a, xrow);
    if (a2) _tile_loadd(7, a2, xrow);
    _tile_loadd(5, PANEL(p0, c), 64);
    _tile_dpbf16ps(0, 4, 5);
    if (a2) _tile_dpbf16ps(0, 7, 5);
    if (cnt > 1) {
        _tile_loadd(6, PANEL(p0 + 1, c), 64);
        _tile_dpbf16ps(1, 4, 6);
        if (a2) _tile_dpbf16ps(1, 7, 6);
    }
    if (cnt > 2) {
        _tile_loadd(5, PANEL(p0 + 2, c), 64);
        _tile_dpbf16ps(2, 4, 5);
        if (a2) _tile_dpbf16ps(2, 7, 5);
    }
    if (cnt > 3) {
        _tile_loadd(6, PANEL(p0 + 3, c), 64);
        _tile_dpbf16ps(3, 4, 6);
        if (a2) _tile_dpbf16ps(3, 7, 6);
    }
}

/* Rows [r0, r0 + m) (m <= 32: one or two row tiles, in tiles 4 and 7) by panels p0 and p0 + 1 (cnt of
   them, 1 or 2: tiles 5 and 6) over all of k: sums in tiles 0-3 (row tile r, panel q: tile 2 r + q),
   stored to `sums` ([32][32] floats), then biased, rounded and written. Meanwhile `per` cache lines a
   k-step of the next pair's panels (`ahead`, `lines` of them left) are prefetched. The row tiles load
   with the streaming hint (tileloaddt1): read once per pair from L2, they then do not evict the pair's
   panels from L1, which every block reads again (SmolLM2's 120 prompt linears, `microbench.gemm_pair
   --rows 64,128,256`, host E 2026-12-07: 0.98 / 0.97 / 0.85x the time on one thread, 0.97 / 0.95 /
   0.96x on two; a 512-token prompt 0.96-0.97x; the same bits). */
static void two_by_two(const uint16_t *xs, const uint16_t *panels, const uint16_t *bias, uint16_t *out,
                       int64_t out_stride, best16 *best, int r0, int m, int64_t n, int64_t kp, int64_t p0, int cnt,
                       float *sums, const char *ahead, int64_t lines, int64_t per) {
    const uint16_t *a0 = xs + (int64_t)r0 * kp, *a1 = a0 + 16 * kp; /* row tiles, staged tile by tile */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < kp / 32; c++) {
        for (int64_t i = 0; i < per && lines > 0; i++, lines--, ahead += 64) _mm_prefetch(ahead, _MM_HINT_T2);
        _tile_stream_loadd(4, a0 + c * 512, 64);
        _tile_loadd(5, PANEL(p0, c), 64);
        if (m > 16) _tile_stream_loadd(7, a1 + c * 512, 64);
        if (cnt > 1) _tile_loadd(6, PANEL(p0 + 1, c), 64);
        _tile_dpbf16ps(0, 4, 5);
        if (m > 16) _tile_dpbf16ps(2, 7, 5);
        if (cnt > 1) _tile_dpbf16ps(1, 4, 6);
        if (m > 16 && cnt > 1) _tile_dpbf16ps(3, 7, 6);
    }
    _tile_stored(0, sums, 128);
    if (cnt > 1) _tile_stored(1, sums + 16, 128);
    if (m > 16) _tile_stored(2, sums + 16 * 32, 128);
    if (m > 16 && cnt > 1) _tile_stored(3, sums + 16 * 32 + 16, 128);
    int64_t col0 = p0 * 16, cols = (int64_t)cnt * 16 < n - col0 ? (int64_t)cnt * 16 : n - col0;
    block_out(sums, 32, m, bias, out ? out + (int64_t)r0 * out_stride : NULL, out_stride, best ? best + r0 : NULL,
              col0, cols);
}

/* One thread's panels [p_lo, p_hi). Up to 16 rows (a decode step, bound by the weights' stream):
   four panels at a time, the sums in tiles 0-3, the rows' 32 values of k in tile 4, the panels' in
   tiles 5 and 6. More rows (a prompt's tile): a pair of panels at a time, through every block of 32
   rows in turn (`two_by_two`), so the pair streams from memory once and from cache for the next
   blocks, and the rows stay in L2. */
static void panels_of(const uint16_t *xs, const uint16_t *panels, const uint16_t *bias, uint16_t *out,
                      int64_t out_stride, best16 *best, int rows, int64_t n, int64_t kp, int64_t p_lo, int64_t p_hi,
                      float *sums) {
    if (rows > 16) {
        /* The pair after this one is prefetched while this one runs, spread over its blocks' k-steps:
           the first block of rows then finds its panels in cache instead of waiting on memory
           (SmolLM2's prompt linears at 32-256 rows, one thread: 0.88-0.91x the time on a quiet host,
           0.70-0.79x with the host's neighbours busy; docs/engine_speed.md, "bfloat16 linears"). */
        int64_t blocks = (rows + 31) / 32, steps = kp / 32;
        for (int64_t p0 = p_lo; p0 < p_hi; p0 += 2) {
            int64_t next = p_hi - p0 - 2 < 2 ? p_hi - p0 - 2 : 2, lines = next > 0 ? next * steps * 16 : 0;
            int64_t per = (lines + blocks * steps - 1) / (blocks * steps);
            const char *ahead = next > 0 ? (const char *)(panels + (p0 + 2) * (kp / 2) * 32) : NULL;
            for (int64_t b = 0; b < blocks; b++) {
                int64_t done = b * steps * per < lines ? b * steps * per : lines;
                two_by_two(xs, panels, bias, out, out_stride, best, (int)(32 * b),
                           rows - 32 * b < 32 ? (int)(rows - 32 * b) : 32, n, kp, p0, p_hi - p0 < 2 ? 1 : 2, sums,
                           ahead ? ahead + 64 * done : NULL, lines - done, per);
            }
        }
        return;
    }
    /* The panels' tiles `ahead` k-steps on are prefetched as each step runs (the next four panels'
       first steps near the end of these), and the first `ahead` steps at the start: each tile load
       then finds its KiB in cache instead of waiting on memory (SmolLM2's linears at 8 and 16 rows,
       2 threads: 0.82-0.85x the time; docs/engine_speed.md, "bfloat16 linears"). */
    amx_stream stream = amx_stream_start(panels, kp * 32, kp / 32, 4, p_lo, p_hi); /* a panel: kp / 2 x 16 pairs */
    for (int64_t p0 = p_lo; p0 < p_hi; p0 += 4) {
        int cnt = p_hi - p0 < 4 ? (int)(p_hi - p0) : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < kp / 32; c++) {
            amx_prefetch_ahead(&stream, p0, c);
            four_panels(xs + c * 512, NULL, 64, panels, kp, p0, c, cnt);
        }
        _tile_stored(0, sums, 256);
        if (cnt > 1) _tile_stored(1, sums + 16, 256);
        if (cnt > 2) _tile_stored(2, sums + 32, 256);
        if (cnt > 3) _tile_stored(3, sums + 48, 256);
        int64_t col0 = p0 * 16, cols = (int64_t)cnt * 16 < n - col0 ? (int64_t)cnt * 16 : n - col0;
        block_out(sums, 64, rows, bias, out, out_stride, best, col0, cols);
    }
}

#undef PANEL
#endif

#if HAVE_AMX
/* The rows, zero-padded, tile by tile: row tile t's k-step c (its 16 rows' 32 values of k) is the 1 KiB
   at xs + (t * kp / 32 + c) * 512, so each tile load reads one contiguous KiB (stage_rows: into a
   new buffer, NULL when out of memory). */
void amx_stage16(const uint16_t *x, int64_t x_stride, int rows, int64_t k, uint16_t *xs) {
    int64_t kp = padded_k(k), staged = (rows + 15) / 16 * 16;
    for (int64_t r = 0; r < staged; r++)
        for (int64_t c = 0; c < kp / 32; c++) {
            uint16_t *to = xs + ((r / 16) * (kp / 32) + c) * 512 + (r % 16) * 32;
            int64_t have = r < rows ? (k - 32 * c < 32 ? k - 32 * c : 32) : 0; /* k - 32 c > 0 below kp */
            if (have > 0) memcpy(to, x + r * x_stride + 32 * c, sizeof(uint16_t) * (size_t)have);
            memset(to + have, 0, sizeof(uint16_t) * (size_t)(32 - have));
        }
}

static uint16_t *stage_rows(const uint16_t *x, int64_t x_stride, int rows, int64_t k) {
    uint16_t *xs = aligned_alloc(64, sizeof(uint16_t) * (size_t)((rows + 15) / 16 * 16 * padded_k(k)));
    if (xs != NULL) amx_stage16(x, x_stride, rows, k, xs);
    return xs;
}

void amx_panels16(const uint16_t *xs, const uint16_t *panels, const uint16_t *bias, uint16_t *out, int64_t out_stride,
                  int rows, int64_t n, int64_t k, int64_t p_lo, int64_t p_hi, float *sums) {
    panels_of(xs, panels, bias, out, out_stride, NULL, rows, n, padded_k(k), p_lo, p_hi, sums);
}

/* pd_amx_gemm's work, into out, or into each thread's running argmax of the rows (best: [threads][rows],
   thread i keeping its own; out NULL). */
static int amx_run(const uint16_t *x, int64_t x_stride, const uint16_t *panels, const uint16_t *bias, uint16_t *out,
                   int64_t out_stride, best16 *best, int rows, int64_t n, int64_t k, int threads) {
    int64_t kp = padded_k(k), np = (n + 15) / 16;
    uint16_t *xs = stage_rows(x, x_stride, rows, k);
    if (xs == NULL) return -2;
    _Pragma("omp parallel num_threads(threads)")
    {
        int t = omp_get_thread_num(), count = omp_get_num_threads();
        float sums[32 * 32]; /* a block's sums: 4 KiB */
        amx_configure();
        panels_of(xs, panels, bias, out, out_stride, best ? best + (int64_t)t * rows : NULL, rows, n, kp,
                  np * t / count, np * (t + 1) / count, sums);
        _tile_release();
    }
    free(xs);
    return 0;
}

#if FUSED_ARGMAX
/* amx_greedy over the listed panels only (list[count], each < ceil(n / 16)): each row's argmax of those
   panels' columns of pd_amx_gemm's output, the same bits (greedy_i8.c's rerun of its candidates). */
int amx_greedy_panels(const uint16_t *x, int64_t x_stride, const uint16_t *panels, int rows, int64_t n, int64_t k,
                      const int32_t *list, int64_t count, int64_t *tokens, int threads) {
    if (!amx_permitted() || rows < 1 || rows > 16 || n >= INT32_MAX) return -1;
    threads = threads < 1 ? 1 : threads;
    int64_t kp = padded_k(k);
    uint16_t *xs = stage_rows(x, x_stride, rows, k);
    best16 *best = aligned_alloc(64, sizeof(best16) * (size_t)threads * (size_t)rows);
    if (xs == NULL || best == NULL) return free(xs), free(best), -2;
    for (int64_t i = 0; i < (int64_t)threads * rows; i++) best[i] = best16_none();
    _Pragma("omp parallel num_threads(threads) if(count > 8)")
    {
        int t = omp_get_thread_num(), teams = omp_get_num_threads();
        float sums[32 * 32];
        amx_configure();
        for (int64_t i = count * t / teams; i < count * (t + 1) / teams; i++)
            panels_of(xs, panels, NULL, NULL, 0, best + (int64_t)t * rows, rows, n, kp, list[i], list[i] + 1, sums);
        _tile_release();
    }
    int rc = 0;
    for (int r = 0; rc == 0 && r < rows; r++)
        if ((tokens[r] = merge_best(best, rows, threads, r)) < 0) rc = 1;
    free(xs);
    free(best);
    return rc;
}
#endif
#endif

/* x [rows][k] bfloat16, rows x_stride apart (1 <= rows <= MAX_ROWS) -> out [rows][n] bfloat16, rows
   out_stride apart; bias [n] bfloat16 or NULL. Returns 0; -1 where AMX is unavailable or rows is
   out of range (nothing written); -2 when it could not allocate its staging buffer. */
int pd_amx_gemm(const uint16_t *x, int64_t x_stride, const uint16_t *panels, const uint16_t *bias, uint16_t *out,
                int64_t out_stride, int rows, int64_t n, int64_t k, int threads) {
#if HAVE_AMX
    if (!amx_permitted() || rows < 1 || rows > MAX_ROWS) return -1;
    return amx_run(x, x_stride, panels, bias, out, out_stride, NULL, rows, n, k, threads);
#else
    (void)x, (void)x_stride, (void)panels, (void)bias, (void)out, (void)out_stride, (void)rows, (void)n, (void)k;
    (void)threads;
    return -1;
#endif
}

/* pd_bf16_greedy on AMX tiles (amx.h): tokens [rows] = each row's argmax of pd_amx_gemm's output (the
   first column on a tie) without writing it. Returns 0; 1 where a row has a NaN output; -1 where the
   tiles or AVX-512 are not here or rows is out of range; -2 out of memory. */
int amx_greedy(const uint16_t *x, int64_t x_stride, const uint16_t *panels, const uint16_t *bias, int rows, int64_t n,
               int64_t k, int64_t *tokens, int threads) {
#if HAVE_AMX && FUSED_ARGMAX
    if (!amx_permitted() || rows < 1 || rows > MAX_ROWS || n >= INT32_MAX) return -1;
    return greedy_by(amx_run, x, x_stride, panels, bias, rows, n, k, tokens, threads);
#else
    (void)x, (void)x_stride, (void)panels, (void)bias, (void)rows, (void)n, (void)k, (void)tokens, (void)threads;
    return -1;
#endif
}

/* The float32 greedy head's first pass on the tiles (engine/forward/greedy_head.py): approx [rows][n] =
   x @ b(W)^T + bias, b(W) the head's weight rounded to bfloat16 (`panels`, pd_amx_pack's layout),
   x float32 split into two bfloat16 parts (x = h + l + e, |e| <= 2^-16 |x|), both products summed
   in float32 on the tiles; pd_f32_greedy then takes these with the bound for them. Returns 0; -1 where
   the tiles are unavailable or a row's largest |x| is under 2^-60 (or NaN): the tiles flush values
   under 2^-126 to zero, which the bound covers only above that; -2 when it could not allocate. */
int pd_amx_head_approx(const float *x, int64_t ldx, const uint16_t *panels, const float *bias, float *approx,
                       int rows, int64_t n, int64_t k, int threads) {
#if HAVE_AMX
    if (!amx_permitted() || rows < 1) return -1;
    int64_t kp = padded_k(k), np = (n + 15) / 16;
    uint16_t *hl = calloc((size_t)(32 * kp), sizeof(uint16_t)); /* 16 rows' high parts, then their low */
    if (hl == NULL) return -2;
    for (int r0 = 0; r0 < rows; r0 += 16) {
        int m = rows - r0 < 16 ? rows - r0 : 16;
        memset(hl, 0, sizeof(uint16_t) * (size_t)(32 * kp));
        for (int r = 0; r < m; r++) {
            float top = 0.0f;
            for (int64_t i = 0; i < k; i++) {
                float v = x[(r0 + r) * ldx + i];
                uint16_t h = bf16_store(v);
                hl[r * kp + i] = h, hl[(16 + r) * kp + i] = bf16_store(v - bf16_load(h));
                top = fabsf(v) > top || v != v ? fabsf(v) : top;
            }
            if (!(top >= 0x1p-60f)) { /* a row of tiny values, or a NaN */
                free(hl);
                return -1;
            }
        }
        _Pragma("omp parallel num_threads(threads)")
        {
            int t = omp_get_thread_num(), count = omp_get_num_threads();
            float sums[16 * 64];
            int64_t xrow = kp * (int64_t)sizeof(uint16_t);
            amx_configure();
            for (int64_t p0 = np * t / count; p0 < np * (t + 1) / count; p0 += 4) {
                int cnt = np * (t + 1) / count - p0 < 4 ? (int)(np * (t + 1) / count - p0) : 4;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t c = 0; c < kp / 32; c++)
                    four_panels(hl + c * 32, hl + 16 * kp + c * 32, xrow, panels, kp, p0, c, cnt);
                _tile_stored(0, sums, 256);
                if (cnt > 1) _tile_stored(1, sums + 16, 256);
                if (cnt > 2) _tile_stored(2, sums + 32, 256);
                if (cnt > 3) _tile_stored(3, sums + 48, 256);
                int64_t col0 = p0 * 16, cols = (int64_t)cnt * 16 < n - col0 ? (int64_t)cnt * 16 : n - col0;
                for (int r = 0; r < m; r++)
                    for (int64_t j = 0; j < cols; j++)
                        approx[(r0 + r) * n + col0 + j] = sums[r * 64 + j] + (bias ? bias[col0 + j] : 0.0f);
            }
            _tile_release();
        }
    }
    free(hl);
    return 0;
#else
    (void)x, (void)ldx, (void)panels, (void)bias, (void)approx, (void)rows, (void)n, (void)k, (void)threads;
    return -1;
#endif
}
