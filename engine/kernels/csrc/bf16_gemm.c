/* bfloat16 linears for the kernel layers and `PackedLinear` (engine/kernels/cpu_gemm.py's `Bf16Gemm`):
   out = x @ W^T + bias, on the AMX GEMM's panels (pd_amx_pack), by AMX tiles where they run
   (amx_gemm.c), else by AVX512-BF16's vdpbf16ps, the CPUs without AMX (AMD Zen 4 and later,
   Intel Cooper Lake), else by AVX2's FMAs on the pairs widened to float32 (AMD Zen 3 and earlier,
   Intel before Cooper Lake): one entry (pd_bf16_gemm) so a layer's call and its module's pick alike.

The tiles' pair layout is what vdpbf16ps takes too: a panel's 16 columns for values of k 2 k2 and
2 k2 + 1 are 32 bfloat16, one 512-bit register, panels[p][k2][c][e] = W[16 p + c][2 k2 + e]; a row's
pair (x[2 k2], x[2 k2 + 1]) broadcast as one 32-bit value is the other operand, and one instruction
adds both products to each column's float32 sum. A block of R rows by P panels keeps its R x P sums
in registers over all of k (at most 24 of the 32, with the P panel registers and a broadcast), the
rows staged once per call zero-padded to whole pairs of k; the row tiles of a block of panels follow
one another, so a panel streams from memory once and from cache for the next tiles.

With AVX2 alone a panel's pair of k is two 256-bit loads (columns 0-7, 8-15); a lane shifted up 16
bits is the even k's weight in float32, masked to its top half the odd one's, exactly, so the weights
stream as bfloat16 (half of float32's bytes) and each row's pair, widened once at staging, takes two
FMAs a half. Blocks of up to 5 rows: 10 sums, a panel's 4 widened halves and the pair fill the 16
registers. Each sum's chain is two FMAs a pair of k, so a block of 4 rows or fewer waits on their
latency, and 5 rows keep the FMA ports busy. SmolLM2's 210 linears on one thread of an AMD EPYC
(Zen 3, 2.45 GHz, 2026-12-07), against the float32 GEMM (small_gemm.c) taking turns: 1 row 0.47-0.51x
the time (memory: half the bytes), 16 rows 1.01-1.16x, 64 rows 0.93-1.06x, 256 rows 0.95-0.97x
(72 GFLOP/s, of the core's 78); blocks of 6 rows taking a panel's halves in turn (twice the
broadcasts) 1.22-1.34x at 16 rows and up, and 4 rows with each pair's two products summed before the
sum (a 3-cycle add in the chain) 1.11-1.19x.

Each output is one float32 sum over the pairs of k in order, whatever R, P, the thread or the row
count, then its bias added and rounded once to bfloat16 (nearest even), as the tiles do: a row's
bits do not depend on what it is batched with (on AVX2, each pair's even product then its odd one
added to the sum by FMAs, the same for every block). Threads take even shares of the panels, and a
thread that runs out of its own takes from the back of another's.

pd_bf16_greedy is the same product for an LM head whose rows all sample greedily: each output
rounded as above, but kept only as each row's running largest (the first column on a tie, as
torch's argmax), lane by lane in registers, so the [rows, vocabulary] logits are never written nor
read again (a 262k vocabulary: 8 MiB a 16-row step) and the argmax needs no pass of its own. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pdserve_kernels.h"
#include "amx.h"
#include "vec.h"
#include "greedy_lanes.h"

/* The vector path without AMX: 1 vdpbf16ps (AVX512-BF16), 3 AVX2 + FMA (a pair of k widened to two
   float32 vectors by a shift and a mask, then two FMAs: the weights stream as bfloat16, half of
   float32's bytes), 0 none (oneDNN takes bfloat16's linears). */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define VEC_PATH 1
#define TILE_ROWS 8 /* rows of one block */
typedef uint32_t xpair; /* a row's pair (x[2 k2], x[2 k2 + 1]) as vdpbf16ps broadcasts it */
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VEC_PATH 3
#define TILE_ROWS 5 /* 2 R sums a panel, its 4 widened halves and a broadcast pair: the 16 registers */
typedef struct { float v[2]; } xpair; /* the pair widened once, at staging */
#else
#define VEC_PATH 0
#endif

#define AMX_ROWS 256 /* the most rows pd_amx_gemm takes */

/* Which path pd_bf16_gemm takes now: 2 AMX tiles (pd_use_amx on), else VEC_PATH. */
int pd_bf16_gemm_path(void) { return amx_ready() ? 2 : VEC_PATH; }

#if VEC_PATH
#if VEC_PATH != 1 && !defined(__AVX512F__) /* AVX-512 without BF16: greedy_lanes.h's, unused here */
typedef struct { char none; } best16; /* no fused greedy head on this path (pd_bf16_greedy: -1) */
#endif
#if VEC_PATH == 1
/* Panels per block for R rows: R x P sums and P panel registers within the 32. */
static inline int panels_for(int rows) { return rows <= 2 ? 8 : rows == 3 ? 6 : rows == 4 ? 5 : rows <= 6 ? 4 : 3; }
#else
/* Panels per block for R rows: 2 R P sums, a half's two widened vectors and a pair within the 16 */
static inline int panels_for(int rows) { return rows == 1 ? 4 : rows <= 2 ? 2 : 1; }
#endif

/* R rows' sums for P panels (sums [R][16 P]) plus the bias, each row's first cols rounded into out. */
static __attribute__((noinline)) void store_rows(const float *sums, int R, int P, const uint16_t *bias, uint16_t *out, int64_t out_stride,
                       int64_t cols) {
    for (int r = 0; r < R; r++) {
        const float *s = sums + r * P * 16;
        uint16_t *o = out + r * out_stride;
        int64_t j = 0;
        for (; j + 16 <= cols; j += 16) bf16_store16(o + j, bias ? f32_load16(s + j) + bf16_load16(bias + j) : f32_load16(s + j));
        for (; j < cols; j++) o[j] = bf16_store(bias ? s[j] + bf16_load(bias[j]) : s[j]);
    }
}

/* R rows (xs, pairs of k, kp2 a row) by P panels from w (a panel's kp2 * 32 values apart): the sums
   over all of k, then the bias added and each row's cols (<= 16 P) outputs rounded into out, or
   into the rows' running argmax where best is set (pd_bf16_greedy; col0 the first column). */
static inline __attribute__((always_inline)) void block(const xpair *xs, int64_t kp2, const uint16_t *w,
                                                        const uint16_t *bias, uint16_t *out, int64_t out_stride,
                                                        int64_t cols, best16 *best, int64_t col0, const int R,
                                                        const int P) {
#if VEC_PATH == 1
    __m512 acc[TILE_ROWS][8];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int p = 0; p < P; p++) acc[r][p] = _mm512_setzero_ps();
    for (int64_t k2 = 0; k2 < kp2; k2++) {
        __m512bh b[8];
#pragma GCC unroll 8
        for (int p = 0; p < P; p++) b[p] = (__m512bh)_mm512_loadu_si512(w + (p * kp2 + k2) * 32);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            __m512bh a = (__m512bh)_mm512_set1_epi32((int)xs[r * kp2 + k2]);
#pragma GCC unroll 8
            for (int p = 0; p < P; p++) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], a, b[p]);
        }
    }
    float sums[TILE_ROWS * 8 * 16];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int p = 0; p < P; p++) _mm512_storeu_ps(sums + (r * P + p) * 16, acc[r][p]);
#else
    /* a panel's k-pair is 32 bfloat16, two 256-bit loads: columns 0-7 and 8-15, each lane a pair; the
       lane shifted up 16 is the even k's weight, masked to its top half the odd one's. A row's sum for
       a column: even product then odd, pair by pair in order. */
    const __m256i top = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 acc[TILE_ROWS][8];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int h = 0; h < 2 * P; h++) acc[r][h] = _mm256_setzero_ps();
    for (int64_t k2 = 0; k2 < kp2; k2++) {
#pragma GCC unroll 4
        for (int p = 0; p < P; p++) {
            const uint16_t *wp = w + (p * kp2 + k2) * 32;
            __m256i lo = _mm256_loadu_si256((const __m256i *)wp), hi = _mm256_loadu_si256((const __m256i *)(wp + 16));
            __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), o0 = _mm256_castsi256_ps(_mm256_and_si256(lo, top));
            __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16)), o1 = _mm256_castsi256_ps(_mm256_and_si256(hi, top));
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                __m256 x0 = _mm256_broadcast_ss(&xs[r * kp2 + k2].v[0]), x1 = _mm256_broadcast_ss(&xs[r * kp2 + k2].v[1]);
                acc[r][2 * p] = _mm256_fmadd_ps(x1, o0, _mm256_fmadd_ps(x0, e0, acc[r][2 * p]));
                acc[r][2 * p + 1] = _mm256_fmadd_ps(x1, o1, _mm256_fmadd_ps(x0, e1, acc[r][2 * p + 1]));
            }
        }
    }
    float sums[TILE_ROWS * 8 * 16];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int h = 0; h < 2 * P; h++) _mm256_storeu_ps(sums + (r * P) * 16 + h * 8, acc[r][h]);
#endif
#if VEC_PATH == 1
    if (best) {
        keep_best(sums, R, P, bias, best, col0, cols);
        return;
    }
#endif
    (void)best, (void)col0;
    store_rows(sums, R, P, bias, out, out_stride, cols);
}

/* R rows by P panels, R and P as literals so each block keeps its sums in registers */
#define BLOCK(R, P) block(xs, kp2, w, bias, out, out_stride, cols, best, col0, R, P)
static void run_block(const xpair *xs, int64_t kp2, const uint16_t *w, const uint16_t *bias, uint16_t *out,
                      int64_t out_stride, int64_t cols, best16 *best, int64_t col0, int rows, int panels) {
#if VEC_PATH != 1
    switch (panels == 1 ? rows : 16 + rows) {
    case 1: BLOCK(1, 1); break;
    case 2: BLOCK(2, 1); break;
    case 3: BLOCK(3, 1); break;
    case 4: BLOCK(4, 1); break;
    case 17: BLOCK(1, 4); break;
    case 18: BLOCK(2, 2); break;
    default: BLOCK(5, 1); break;
    }
#else
    switch (panels == 1 ? rows : 16 + rows) {
    case 1: BLOCK(1, 1); break;
    case 2: BLOCK(2, 1); break;
    case 3: BLOCK(3, 1); break;
    case 4: BLOCK(4, 1); break;
    case 5: BLOCK(5, 1); break;
    case 6: BLOCK(6, 1); break;
    case 7: BLOCK(7, 1); break;
    case 8: BLOCK(8, 1); break;
    case 17: BLOCK(1, 8); break;
    case 18: BLOCK(2, 8); break;
    case 19: BLOCK(3, 6); break;
    case 20: BLOCK(4, 5); break;
    case 21: BLOCK(5, 4); break;
    case 22: BLOCK(6, 4); break;
    case 23: BLOCK(7, 3); break;
    default: BLOCK(8, 3); break;
    }
#endif
}
#undef BLOCK

/* Job j: panels [j * group, (j + 1) * group) (fewer in the last), each block of them through every
   row tile in turn; rows split in tiles of at most TILE_ROWS, as even as they go. A last job short of
   a whole group takes its panels one at a time. */
static void run_job(const xpair *xs, int64_t kp2, const uint16_t *panels, const uint16_t *bias, uint16_t *out,
                    int64_t out_stride, best16 *best, int rows, int64_t n, int64_t np, int group, int64_t job) {
    int tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
    for (int64_t p0 = job * group, end = p0 + group < np ? p0 + group : np; p0 < end;) {
        int cnt = end - p0 == group ? group : 1;
        int64_t col0 = 16 * p0, cols = n - col0 < 16 * cnt ? n - col0 : 16 * cnt;
        for (int t = 0; t < tiles; t++) {
            int r0 = t * rows / tiles, r1 = (t + 1) * rows / tiles;
            run_block(xs + r0 * kp2, kp2, panels + p0 * kp2 * 32, bias ? bias + col0 : NULL,
                      best ? NULL : out + r0 * out_stride + col0, out_stride, cols, best ? best + r0 : NULL, col0,
                      r1 - r0, cnt);
        }
        p0 += cnt;
    }
}

/* One job from a range [front, back) kept in one word (front << 32 | back): from the front for its
   owner, from the back for a thread that ran out of its own; -1 when none is left. */
static inline int64_t take(uint64_t *range, int from_back) {
    uint64_t seen = __atomic_load_n(range, __ATOMIC_RELAXED);
    for (;;) {
        uint32_t front = (uint32_t)(seen >> 32), back = (uint32_t)seen;
        if (front >= back) return -1;
        uint64_t want = from_back ? seen - 1 : seen + ((uint64_t)1 << 32);
        if (__atomic_compare_exchange_n(range, &seen, want, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return from_back ? back - 1 : front;
    }
}

/* The vector path of pd_bf16_gemm, any number of rows; with best set (pd_bf16_greedy), a
   [threads][rows] array of running argmaxes instead of out, thread i keeping its own. */
static int vec_run(const uint16_t *x, int64_t x_stride, const uint16_t *panels, const uint16_t *bias,
                   uint16_t *out, int64_t out_stride, best16 *best, int rows, int64_t n, int64_t k, int threads) {
    int64_t kp = (k + 31) / 32 * 32, np = (n + 15) / 16; /* the panels' k, padded as pd_amx_pack pads it */
    xpair *xs = malloc(sizeof(xpair) * (size_t)(rows * kp / 2)); /* the rows' pairs, zero-padded to kp */
    if (xs == NULL) return -2;
    for (int64_t r = 0; r < rows; r++) {
#if VEC_PATH == 1
        uint16_t *row = (uint16_t *)(xs + r * kp / 2);
        memcpy(row, x + r * x_stride, sizeof(uint16_t) * (size_t)k);
        memset(row + k, 0, sizeof(uint16_t) * (size_t)(kp - k));
#else
        float *row = (float *)(xs + r * kp / 2);
        for (int64_t i = 0; i < kp; i++) row[i] = i < k ? bf16_load(x[r * x_stride + i]) : 0.0f;
#endif
    }
    /* jobs of a block's panels; each thread owns an even, contiguous share and takes from the back of
       another's when its own runs out (a neighbour on one core of a shared host, or unequal shares of
       memory bandwidth, would otherwise leave the other waiting at the barrier) */
    int tiles = (rows + TILE_ROWS - 1) / TILE_ROWS, group = panels_for((rows + tiles - 1) / tiles);
    int64_t jobs = (np + group - 1) / group;
    if (threads > jobs) threads = (int)jobs;
    if (threads == 1) { /* no region (a caller's team runs it on each of its threads: layer_team.c) */
        for (int64_t job = 0; job < jobs; job++)
            run_job(xs, kp / 2, panels, bias, out, out_stride, best, rows, n, np, group, job);
        free(xs);
        return 0;
    }
    struct { _Alignas(64) uint64_t jobs; } ranges[threads]; /* a cache line each: no false sharing */
    for (int i = 0; i < threads; i++)
        ranges[i].jobs = (uint64_t)(jobs * i / threads) << 32 | (uint64_t)(jobs * (i + 1) / threads);
    _Pragma("omp parallel num_threads(threads)")
    {
        int me = omp_get_thread_num(); /* a smaller team than asked: the shares nobody owns are taken too */
        best16 *mine = best ? best + (int64_t)me * rows : NULL;
        for (int i = 0; i < threads; i++) { /* its own share first, then the others' from their backs */
            uint64_t *range = &ranges[(me + i) % threads].jobs;
            for (int64_t job; (job = take(range, i > 0)) >= 0;)
                run_job(xs, kp / 2, panels, bias, out, out_stride, mine, rows, n, np, group, job);
        }
    }
    free(xs);
    return 0;
}

#endif

/* x [rows][k] bfloat16, rows x_stride apart -> out [rows][n] bfloat16, rows out_stride apart; panels
   from pd_amx_pack; bias [n] bfloat16 or NULL. On AMX tiles where they run (64 rows a call: a row's
   sums do not depend on its batch, so more rows go 64 at a time, the same bits), else by vdpbf16ps
   (any row count). Returns 0; -1 where neither runs here or a size is out of range (nothing
   written); -2 when it could not allocate its staging buffer. */
int pd_bf16_gemm(const uint16_t *x, int64_t x_stride, const uint16_t *panels, const uint16_t *bias, uint16_t *out,
                 int64_t out_stride, int rows, int64_t n, int64_t k, int threads) {
    if (rows < 1 || n < 1 || k < 1) return -1;
    if (amx_ready()) {
        for (int r0 = 0, rc; r0 < rows; r0 += AMX_ROWS)
            if ((rc = pd_amx_gemm(x + r0 * x_stride, x_stride, panels, bias, out + r0 * out_stride, out_stride,
                                  rows - r0 < AMX_ROWS ? rows - r0 : AMX_ROWS, n, k, threads)) != 0)
                return rc;
        return 0;
    }
#if VEC_PATH
    return vec_run(x, x_stride, panels, bias, out, out_stride, NULL, rows, n, k, threads < 1 ? 1 : threads);
#else
    (void)x, (void)x_stride, (void)panels, (void)bias, (void)out, (void)out_stride, (void)threads;
    return -1;
#endif
}

/* tokens [rows] = each row's argmax of pd_bf16_gemm's output, the first column on a tie, without
   writing the outputs (an LM head whose rows all sample greedily). Returns 0; 1 where a row has a
   NaN output (nothing reliable in tokens: the caller takes the outputs); -1 where neither runs here,
   or, on AMX tiles (amx_gemm.c's amx_greedy, up to 256 rows), more rows (the caller takes the
   outputs); -2 out of memory. */
int pd_bf16_greedy(const uint16_t *x, int64_t x_stride, const uint16_t *panels, const uint16_t *bias, int rows,
                   int64_t n, int64_t k, int64_t *tokens, int threads) {
    if (rows < 1 || n < 1 || k < 1 || n >= INT32_MAX) return -1;
    if (amx_ready()) return amx_greedy(x, x_stride, panels, bias, rows, n, k, tokens, threads);
#if VEC_PATH == 1
    return greedy_by(vec_run, x, x_stride, panels, bias, rows, n, k, tokens, threads);
#else
    (void)x, (void)x_stride, (void)panels, (void)bias, (void)tokens, (void)threads;
    return -1;
#endif
}
