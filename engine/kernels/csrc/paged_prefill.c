/* Prefill attention straight from the paged KV pool, on the CPU (engine/kernels/cpu_kernel.py builds it).

One chunk of one sequence: queries at positions pos0 .. pos0 + nq - 1, whose keys and values are
already in the pool (the chunk's own included), reached through the sequence's block table. A
query at position t sees keys [t - window + 1, t] with a sliding window, all of [0, t] without.

A task is one KV head and a tile of up to 48 query rows: the heads sharing that KV head, for a
few consecutive positions (row r is position pos0 + r / groups, query head kv * groups + r % groups).
It walks the keys its rows see in steps of KSTEP positions, each step aligned to an absolute
position (so a row's result depends on its own position only, never on how rows were tiled):
the step's keys and values are widened to float32 in a small buffer, then
- scores, transposed (keys x rows): six keys times sixteen rows of 8-lane sums in registers
  over the head dimension, the queries packed dimension-major once per task (scaled);
- an online softmax across steps, vectorized across rows: running max and sum per row, the
  finished part rescaled when the max grows; keys a row may not see weigh exactly 0;
- the weighted sum of values: six rows times sixteen dimensions in registers over the step's keys.
The causal half of the chunk is never computed, beyond the step that holds the diagonal.

bfloat16 chunks take AMX's tiles instead where the CPU has them and the OS allows it (amx_task):
the chunk's values gathered once per call, transposed (its keys too where a block holds other than a
multiple of 16 keys; else their tiles load straight from the pool), then per step of 32
keys the scores and the values' sums as tile products, the softmax on 16-lane vectors in between.
Products of bfloat16 are exact in float32 and the weights go in rounded to bfloat16, as
transformers' bfloat16 attention (PyTorch's flash kernel) rounds them, so each sum still has one
order fixed by its row and key. SmolLM2's 512-token chunk, 30 layers, 2 threads (2026-12-03, Xeon
host with AMX): 58 ms on the vector path (8-lane softmax) -> 53 (16-lane softmax) -> 41.6 (scores
on tiles) -> 33.5 (values on tiles too, each weight as three exact bfloat16 parts); one thread, 8
pieces as the one-region step cuts it (2026-12-06): 0.78x the time with the weights rounded, half
the products, and a whole step's softmax unmasked (prefill_amx.c).

Strides are in elements, as in paged_decode.c: key p of KV head h is at
k[table[p / block_size] * blk_stride + (p % block_size) * tok_stride + h * head_stride + d].
*/
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pdserve_kernels.h"
#include "amx.h"
#include "prefill.h"

#define VROWS 6  /* rows of a value-sum tile: with sixteen dimensions, twelve sums in registers */
#define KSTEP 24 /* keys per online-softmax step: four tiles of six */

/* n values of a float32 or bfloat16 (dtype 1) array into float32 */
static inline void widen(const void *src, int dtype, float *dst, int n) {
    if (dtype == 0) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    const uint16_t *h = src;
    for (int d = 0; d < n; d++) dst[d] = bf16_load(h[d]);
}

/* The two tiles, for a vector type VT of LANES floats (LOAD, STORE, SPLAT its helpers). A lane is
   one query row (scores) or one dimension (values), summed over the same keys (dimensions) in the
   same order at either width, so 8-lane and 16-lane tiles give the same bits.

   SCORES: st[j][r] = sum over d of kf[j][d] * qt[d][r], keys j0 .. j0 + 5, rows r0 .. r0 + R * LANES - 1. */
#define SCORES(NAME, VT, LANES, LOAD, STORE, SPLAT, R)                                              \
    static inline void NAME##R(const float *kf, const float *qt, float *st, int dim, int j0, int r0) { \
        VT a[6][R];                                                                                 \
        for (int j = 0; j < 6; j++)                                                                 \
            for (int x = 0; x < R; x++) a[j][x] = (VT){0};                                          \
        for (int d = 0; d < dim; d++) {                                                             \
            VT qv[R];                                                                               \
            for (int x = 0; x < R; x++) qv[x] = LOAD(qt + d * ROWS + r0 + LANES * x);               \
            for (int j = 0; j < 6; j++) {                                                           \
                VT kj = SPLAT(kf + (j0 + j) * dim + d);                                             \
                for (int x = 0; x < R; x++) a[j][x] += kj * qv[x];                                  \
            }                                                                                       \
        }                                                                                           \
        for (int j = 0; j < 6; j++)                                                                 \
            for (int x = 0; x < R; x++) STORE(st + (j0 + j) * ROWS + r0 + LANES * x, a[j][x]);      \
    }

/* VALUES: o[r][d0 .. d0 + W) = o[r][d0 .. d0 + W) * corr[r] + sum over the step's keys j < ks of
   st[j][r] * vf[j][d0 .. d0 + W), rows r0 .. r0 + VROWS - 1, W = V * LANES. */
#define VALUES(NAME, VT, LANES, LOAD, STORE, SPLAT, V)                                              \
    static inline void NAME##V(const float *st, const float *vf, const float *corr, float *o, int dim, \
                               int r0, int d0, int ks) {                                                    \
        VT a[VROWS][V];                                                                             \
        for (int r = 0; r < VROWS; r++)                                                             \
            for (int x = 0; x < V; x++) a[r][x] = LOAD(o + (r0 + r) * dim + d0 + LANES * x) * corr[r0 + r]; \
        for (int j = 0; j < ks; j++) {                                                              \
            VT vv[V];                                                                               \
            for (int x = 0; x < V; x++) vv[x] = LOAD(vf + j * dim + d0 + LANES * x);                \
            for (int r = 0; r < VROWS; r++) {                                                       \
                VT w = SPLAT(st + j * ROWS + r0 + r);                                               \
                for (int x = 0; x < V; x++) a[r][x] += w * vv[x];                                   \
            }                                                                                       \
        }                                                                                           \
        for (int r = 0; r < VROWS; r++)                                                             \
            for (int x = 0; x < V; x++) STORE(o + (r0 + r) * dim + d0 + LANES * x, a[r][x]);        \
    }

/* 8 lanes: sixteen rows of scores (two registers, twelve sums), sixteen dimensions of values */
SCORES(scores_tile, v8f, 8, f32_load8, store8, splat, 2)
VALUES(values_tile, v8f, 8, f32_load8, store8, splat, 1)
VALUES(values_tile, v8f, 8, f32_load8, store8, splat, 2)

#if defined(__AVX512F__)
/* 16 lanes where the CPU has AVX-512: scores for up to 48 rows (three registers, 18 sums), values
   for up to 64 dimensions (four registers, 24 sums). SmolLM2's 512-token prefill, 30 layers, 2
   threads (2026-12-03, Xeon host): bfloat16 65.4 -> 58 ms, float32 71.2 -> 61 against 8 lanes. */
SCORES(scores_wide, v16f, 16, f32_load16, store16, splat16, 1)
SCORES(scores_wide, v16f, 16, f32_load16, store16, splat16, 2)
SCORES(scores_wide, v16f, 16, f32_load16, store16, splat16, 3)
VALUES(values_wide, v16f, 16, f32_load16, store16, splat16, 1)
VALUES(values_wide, v16f, 16, f32_load16, store16, splat16, 2)
VALUES(values_wide, v16f, 16, f32_load16, store16, splat16, 4)
#endif

/* A step's scores, keys j0 .. j0 + 5, for rows 0 .. rows - 1 (in whole tiles of 16 rows). */
static inline void scores(const float *kf, const float *qt, float *st, int dim, int j0, int rows) {
#if defined(__AVX512F__)
    for (int r0 = 0; r0 < rows;) {
        int wide = (rows - r0 + 15) / 16;
        if (wide >= 3) scores_wide3(kf, qt, st, dim, j0, r0), r0 += 48;
        else if (wide == 2) scores_wide2(kf, qt, st, dim, j0, r0), r0 += 32;
        else scores_wide1(kf, qt, st, dim, j0, r0), r0 += 16;
    }
#else
    for (int r0 = 0; r0 < rows; r0 += 16) scores_tile2(kf, qt, st, dim, j0, r0);
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define DOT_PREFILL 1
/* A bfloat16 step's scores by vdpbf16ps, keys j0 .. j0 + 5 (kp[j]: key j in the pool, read in place)
   against R tiles of 16 rows from r0: qp holds each row's q as pairs of dimensions, [dim / 2][ROWS]
   dwords, so one instruction takes two dimensions of sixteen rows (two FMAs of exact products per
   lane, as scores_dot in decode.h). No key is widened; the scale is applied after (softmax_step's
   `post`). Each row's sum still runs over its dimensions in one fixed order. */
__attribute__((always_inline)) static inline void scores_dot_tile(const uint32_t *qp, const uint16_t *const *kp,
                                                                  float *st, int pairs, int j0, int r0, const int R) {
    __m512 a[6][3];
    for (int j = 0; j < 6; j++)
        for (int x = 0; x < R; x++) a[j][x] = _mm512_setzero_ps();
    for (int i = 0; i < pairs; i++) {
        __m512bh qv[3];
        for (int x = 0; x < R; x++) qv[x] = (__m512bh)_mm512_loadu_si512(qp + i * ROWS + r0 + 16 * x);
        for (int j = 0; j < 6; j++) {
            int32_t pair;
            memcpy(&pair, kp[j0 + j] + 2 * i, sizeof pair);
            __m512bh kj = (__m512bh)_mm512_set1_epi32(pair);
            for (int x = 0; x < R; x++) a[j][x] = _mm512_dpbf16_ps(a[j][x], qv[x], kj);
        }
    }
    for (int j = 0; j < 6; j++)
        for (int x = 0; x < R; x++) _mm512_storeu_ps(st + (j0 + j) * ROWS + r0 + 16 * x, a[j][x]);
}

static void scores_dot(const uint32_t *qp, const uint16_t *const *kp, float *st, int dim, int j0, int rows) {
    for (int r0 = 0; r0 < rows;) {
        int wide = (rows - r0 + 15) / 16;
        if (wide >= 3) scores_dot_tile(qp, kp, st, dim / 2, j0, r0, 3), r0 += 48;
        else if (wide == 2) scores_dot_tile(qp, kp, st, dim / 2, j0, r0, 2), r0 += 32;
        else scores_dot_tile(qp, kp, st, dim / 2, j0, r0, 1), r0 += 16;
    }
}
#else
#define DOT_PREFILL 0
static void scores_dot(const uint32_t *qp, const uint16_t *const *kp, float *st, int dim, int j0, int rows) {
    (void)qp, (void)kp, (void)st, (void)dim, (void)j0, (void)rows;
    __builtin_trap(); /* never called: vector_task takes it only where DOT_PREFILL */
}
#endif

/* A step's weighted values into rows r0 .. r0 + VROWS - 1 of o, dimensions 0 .. dim - 1. */
static inline void values(const float *st, const float *vf, const float *corr, float *o, int dim, int r0, int ks) {
    int d = 0;
#if defined(__AVX512F__)
    for (; d + 64 <= dim; d += 64) values_wide4(st, vf, corr, o, dim, r0, d, ks);
    if (d + 32 <= dim) values_wide2(st, vf, corr, o, dim, r0, d, ks), d += 32;
    if (d + 16 <= dim) values_wide1(st, vf, corr, o, dim, r0, d, ks), d += 16;
#else
    for (; d + 16 <= dim; d += 16) values_tile2(st, vf, corr, o, dim, r0, d, ks);
#endif
    if (d + 8 <= dim) values_tile1(st, vf, corr, o, dim, r0, d, ks), d += 8;
    for (int r = r0; r < r0 + VROWS; r++)
        for (int dd = d; dd < dim; dd++) {
            float a = o[r * dim + dd] * corr[r];
            for (int j = 0; j < ks; j++) a += st[j * ROWS + r] * vf[j * dim + dd];
            o[r * dim + dd] = a;
        }
}

/* A task's queries: float32 (scaled), [dim][ROWS], or, where its scores go by vdpbf16ps (`dot`), the
   bfloat16 bits as pairs of dimensions, [dim / 2][ROWS] dwords; padding rows stay zero. */
static void pack_queries(const Call *c, int tile, int h, int rows, int dot, float *qt) {
    int dim = c->dim;
    float row_q[dim];
    for (int r = 0; r < rows; r++) {
        const char *q = (const char *)c->q + row_offset(c, tile, h, r, c->q_tok, c->q_head);
        if (dot) {
            uint32_t *qp = (uint32_t *)(void *)qt;
            for (int i = 0; i < dim / 2; i++) memcpy(qp + i * ROWS + r, q + 4 * i, 4);
            continue;
        }
        widen(q, c->dtype, row_q, dim);
        for (int d = 0; d < dim; d++) qt[d * ROWS + r] = row_q[d] * c->scale;
    }
}

/* A task on vectors: each step's values (and, but for `dot`, keys) widened to float32, scores and
   values in FMA tiles; a bfloat16 pool's scores by vdpbf16ps where the CPU has it (`dot`: keys read
   in place, a zero key standing in past the last). Returns 0, or -2 when it could not allocate. */
static int vector_task(const Call *c, int tile, int h, int rows) {
    int dim = c->dim, dot = DOT_PREFILL && c->dtype == 1 && dim % 2 == 0;
    float *buf = malloc(sizeof(float) * (size_t)(2 * ROWS * dim + 2 * KSTEP * dim + KSTEP * ROWS));
    if (buf == NULL) return -2;
    float *qt = buf, *o = qt + ROWS * dim, *kf = o + ROWS * dim, *vf = kf + KSTEP * dim, *st = vf + KSTEP * dim;
    float m[ROWS], l[ROWS], corr[ROWS];
    int32_t pos[ROWS];
    const uint16_t *kp[KSTEP];
    memset(qt, 0, sizeof(float) * ROWS * dim);
    memset(o, 0, sizeof(float) * ROWS * dim);
    if (dot) memset(kf, 0, sizeof(float) * (size_t)dim); /* the zero key */
    start_rows(c, tile, rows, pos, m, l);
    pack_queries(c, tile, h, rows, dot, qt);
    int64_t last = pos[rows - 1], lo = c->window > 0 && pos[0] >= c->window ? pos[0] - c->window + 1 : 0;
    for (int64_t p0 = lo / KSTEP * KSTEP; p0 <= last; p0 += KSTEP) {
        for (int j = 0; j < KSTEP; j++) { /* this step's keys and values; zeros past `last` */
            int64_t p = p0 + j;
            if (p > last) {
                if (dot) kp[j] = (const uint16_t *)(const void *)kf;
                else memset(kf + j * dim, 0, sizeof(float) * (size_t)dim);
                memset(vf + j * dim, 0, sizeof(float) * (size_t)dim);
                continue;
            }
            int64_t at = (c->table[p / c->block_size] * c->blk_stride + (p % c->block_size) * c->tok_stride
                          + h * c->head_stride) * c->elem;
            if (dot) kp[j] = (const uint16_t *)(const void *)((const char *)c->k + at);
            else widen((const char *)c->k + at, c->dtype, kf + j * dim, dim);
            widen((const char *)c->v + at, c->dtype, vf + j * dim, dim);
        }
        for (int j0 = 0; j0 < KSTEP; j0 += 6) { /* padding rows past `rows`: only to the tile's edge */
            if (dot) scores_dot((const uint32_t *)(const void *)qt, kp, st, dim, j0, rows);
            else scores(kf, qt, st, dim, j0, rows);
        }
        softmax_step(st, m, l, corr, pos, p0, KSTEP, c->window, c->softcap, dot ? c->scale : 1.0f, NULL);
        for (int r0 = 0; r0 < rows; r0 += VROWS) values(st, vf, corr, o, dim, r0, KSTEP);
    }
    for (int r = 0; r < rows; r++) finish_row(c, tile, h, r, o + r * dim, 1, l[r]);
    free(buf);
    return 0;
}

/* dtype: 0 = float32, 1 = bfloat16 (q, the pool and out alike). q [nq][heads][dim] and out
   likewise, by their token / head strides; table: the sequence's blocks, covering keys
   0 .. pos0 + nq - 1. Returns 0; -1 for a dtype it does not know; -2 when it could not allocate
   its buffers (rows of the tasks that could not are not written). */
int pd_paged_prefill(int dtype, const void *q, int64_t q_tok, int64_t q_head, const void *k,
                     const void *v, int64_t blk_stride, int64_t tok_stride, int64_t head_stride,
                     const int64_t *table, int64_t pos0, int nq, void *out, int64_t out_tok,
                     int64_t out_head, int heads, int kv_heads, int dim, int block_size, float scale,
                     int window, float softcap, int threads) {
    if (dtype != 0 && dtype != 1) return -1;
    Call c = {.dtype = dtype, .dim = dim, .groups = heads / kv_heads, .block_size = block_size, .window = window,
              .elem = dtype == 0 ? sizeof(float) : sizeof(uint16_t), .q_tok = q_tok, .q_head = q_head,
              .blk_stride = blk_stride, .tok_stride = tok_stride, .head_stride = head_stride, .pos0 = pos0,
              .out_tok = out_tok, .out_head = out_head, .q = q, .k = k, .v = v, .out = out, .table = table,
              .scale = scale, .softcap = softcap};
    int per_head = nq * c.groups, tiles = (per_head + ROWS - 1) / ROWS;
    int amx = dtype == 1 && dim % 32 == 0 && amx_ready();
    uint16_t *kc = NULL, *vt = NULL;
    int64_t base = 0, nk = 0;
    if (amx) { /* every key any row sees, from the first row's window on */
        int64_t last = pos0 + nq - 1, lo = window > 0 && pos0 >= window ? pos0 - window + 1 : 0;
        base = lo / KSTEP_AMX * KSTEP_AMX, nk = (last - base) / KSTEP_AMX * KSTEP_AMX + KSTEP_AMX;
        int direct = block_size % 16 == 0; /* the keys' tiles straight from the pool: sixteen keys of one block */
        vt = malloc((direct ? 1 : 2) * sizeof(uint16_t) * (size_t)(kv_heads * nk * dim));
        if (vt == NULL) return -2;
        kc = direct ? NULL : vt + kv_heads * nk * dim;
#if HAVE_AMX
        prefill_amx_gather(&c, kv_heads, base, nk, last, kc, vt, threads);
#else
        (void)vt; /* never here: amx is 0 */
#endif
    }
    int failed = 0;
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")
    for (int task = 0; task < tiles * kv_heads; task++) {
        int tile = tiles - 1 - task / kv_heads, h = task % kv_heads; /* longest rows first */
        int rows = per_head - tile * ROWS < ROWS ? per_head - tile * ROWS : ROWS;
#if HAVE_AMX
        int rc = amx ? prefill_amx_task(&c, tile, h, rows, kc, vt, base, nk) : vector_task(&c, tile, h, rows);
#else
        int rc = vector_task(&c, tile, h, rows);
#endif
        if (rc != 0) _Pragma("omp atomic write") failed = 1;
    }
    free(vt);
    return failed ? -2 : 0;
}
