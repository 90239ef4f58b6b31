/* Prefill attention straight from the paged KV pool, on the CPU (engine/cpu_kernel.py builds it).

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
the chunk's keys and values gathered once per call (the values transposed), then per step of 32
keys the scores and the values' sums as tile products, the softmax on 16-lane vectors in between.
Products of bfloat16 are exact in float32 and the weights go in as three exact bfloat16 parts, so
the sums are as accurate as the vector path's, and each still has one order fixed by its row and
key. SmolLM2's 512-token chunk, 30 layers, 2 threads (2026-12-03, Xeon host with AMX): 58 ms on
the vector path (8-lane softmax) -> 53 (16-lane softmax) -> 41.6 (scores on tiles) -> 33.5 (values
on tiles too).

Strides are in elements, as in paged_decode.c: key p of KV head h is at
k[table[p / block_size] * blk_stride + (p % block_size) * tok_stride + h * head_stride + d].
*/
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "vec.h"

#define ROWS 48      /* query rows of a task: six vectors of eight */
#define VROWS 6      /* rows of a value-sum tile: with sixteen dimensions, twelve sums in registers */
#define KSTEP 24     /* keys per online-softmax step: four tiles of six */
#define KSTEP_AMX 32 /* keys per step on AMX tiles: two tiles' rows of keys, one tile's row of key pairs */

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

/* One online-softmax step over keys p0 .. p0 + ks - 1 (st: their scores, [ks][ROWS], times `post`),
   sixteen rows at a time: the masked scores' max and exps (st becomes the weights; keys a row may
   not see weigh exactly 0), each row's running max m and sum l, and corr, the factor its sums so
   far are scaled by. */
static void softmax_step(float *st, float *m, float *l, float *corr, const int32_t *pos, int64_t p0, int ks,
                         int window, float softcap, float post) {
    for (int r0 = 0; r0 < ROWS; r0 += 16) {
        v16f m16 = f32_load16(m + r0), top = m16, sum = {0}, none = (v16f){0} - INFINITY;
        v16i pos16;
        memcpy(&pos16, pos + r0, sizeof pos16);
        for (int j = 0; j < ks; j++) {
            float *s = st + j * ROWS + r0;
            if (post != 1.0f) store16(s, f32_load16(s) * post);
            if (softcap > 0.0f)
                for (int x = 0; x < 16; x++) s[x] = tanhf(s[x] / softcap) * softcap;
            v16i p16 = (v16i){0} + (int32_t)(p0 + j);
            v16i sees = p16 <= pos16;
            if (window > 0) sees &= p16 > pos16 - window;
            v16f s16 = select16(sees, f32_load16(s), none);
            store16(s, s16);
            top = vmax16(top, s16);
        }
        v16f base = select16(top == none, (v16f){0}, top); /* rows that saw nothing yet: any finite base */
        v16f c16 = select16(m16 == none, (v16f){0}, exp_nonpos16(m16 - base));
        for (int j = 0; j < ks; j++) {
            float *s = st + j * ROWS + r0;
            v16f s16 = f32_load16(s), e = select16(s16 == none, (v16f){0}, exp_nonpos16(s16 - base));
            store16(s, e);
            sum += e;
        }
        store16(l + r0, f32_load16(l + r0) * c16 + sum);
        store16(m + r0, top);
        store16(corr + r0, c16);
    }
}

/* One call's arguments, as every task reads them. */
typedef struct {
    int dtype, dim, groups, block_size, window;
    int64_t elem, q_tok, q_head, blk_stride, tok_stride, head_stride, pos0, out_tok, out_head;
    const void *q, *k, *v;
    void *out;
    const int64_t *table;
    float scale, softcap;
} Call;

/* Row r of a tile is query head h * groups + g % groups at position pos0 + g / groups, g = tile * ROWS + r. */
static inline int64_t row_offset(const Call *c, int tile, int h, int r, int64_t tok, int64_t head) {
    int g = tile * ROWS + r;
    return ((int64_t)(g / c->groups) * tok + (int64_t)(h * c->groups + g % c->groups) * head) * c->elem;
}

/* The rows' positions (-1 for the padding rows past `rows`), running maxima and sums. */
static void start_rows(const Call *c, int tile, int rows, int32_t *pos, float *m, float *l) {
    for (int r = 0; r < ROWS; r++) {
        m[r] = -INFINITY, l[r] = 0.0f;
        pos[r] = r < rows ? (int32_t)(c->pos0 + (tile * ROWS + r) / c->groups) : -1;
    }
}

/* Row r's output: o[d * o_stride] / l, in the call's dtype. */
static void finish_row(const Call *c, int tile, int h, int r, const float *o, int o_stride, float l) {
    char *dst = (char *)c->out + row_offset(c, tile, h, r, c->out_tok, c->out_head);
    float inv = 1.0f / l;
    for (int d = 0; d < c->dim; d++) {
        float x = o[d * o_stride] * inv;
        if (c->dtype == 0)
            ((float *)dst)[d] = x;
        else
            ((uint16_t *)dst)[d] = bf16_store(x);
    }
}

/* A task on vectors: each step's keys and values widened to float32, scores and values in FMA
   tiles. Returns 0, or -2 when it could not allocate its buffers. */
static int vector_task(const Call *c, int tile, int h, int rows) {
    int dim = c->dim;
    float *buf = malloc(sizeof(float) * (size_t)(2 * ROWS * dim + 2 * KSTEP * dim + KSTEP * ROWS));
    if (buf == NULL) return -2;
    float *qt = buf, *o = qt + ROWS * dim, *kf = o + ROWS * dim, *vf = kf + KSTEP * dim, *st = vf + KSTEP * dim;
    float m[ROWS], l[ROWS], corr[ROWS], row_q[dim];
    int32_t pos[ROWS];
    memset(qt, 0, sizeof(float) * ROWS * dim);
    memset(o, 0, sizeof(float) * ROWS * dim);
    start_rows(c, tile, rows, pos, m, l);
    for (int r = 0; r < rows; r++) {
        widen((const char *)c->q + row_offset(c, tile, h, r, c->q_tok, c->q_head), c->dtype, row_q, dim);
        for (int d = 0; d < dim; d++) qt[d * ROWS + r] = row_q[d] * c->scale;
    }
    int64_t last = pos[rows - 1], lo = c->window > 0 && pos[0] >= c->window ? pos[0] - c->window + 1 : 0;
    for (int64_t p0 = lo / KSTEP * KSTEP; p0 <= last; p0 += KSTEP) {
        for (int j = 0; j < KSTEP; j++) { /* this step's keys and values; zeros past `last` */
            int64_t p = p0 + j;
            if (p > last) {
                memset(kf + j * dim, 0, sizeof(float) * (size_t)dim);
                memset(vf + j * dim, 0, sizeof(float) * (size_t)dim);
                continue;
            }
            int64_t at = (c->table[p / c->block_size] * c->blk_stride + (p % c->block_size) * c->tok_stride
                          + h * c->head_stride) * c->elem;
            widen((const char *)c->k + at, c->dtype, kf + j * dim, dim);
            widen((const char *)c->v + at, c->dtype, vf + j * dim, dim);
        }
        for (int j0 = 0; j0 < KSTEP; j0 += 6) /* padding rows past `rows`: only to the tile's edge */
            scores(kf, qt, st, dim, j0, rows);
        softmax_step(st, m, l, corr, pos, p0, KSTEP, c->window, c->softcap, 1.0f);
        for (int r0 = 0; r0 < rows; r0 += VROWS) values(st, vf, corr, o, dim, r0, KSTEP);
    }
    for (int r = 0; r < rows; r++) finish_row(c, tile, h, r, o + r * dim, 1, l[r]);
    free(buf);
    return 0;
}

#if HAVE_AMX
static inline int all_ones16(v16f x) { /* every row's max the same as before the step */
    for (int i = 0; i < 16; i++)
        if (x[i] != 1.0f) return 0;
    return 1;
}

/* The call's keys base .. base + nk - 1 of each KV head (nk a multiple of 32; zeros past `last`),
   gathered from the pool once for every task: kc [kv head][key][dim], rows of the scores' key tiles,
   and vt [kv head][dim][key], the values transposed, rows of the values' tiles. */
static void gather(const Call *c, int kv_heads, int64_t base, int64_t nk, int64_t last, uint16_t *kc,
                   uint16_t *vt, int threads) {
    int dim = c->dim;
    int64_t spans = nk / KSTEP_AMX;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t task = 0; task < kv_heads * spans; task++) {
        int h = (int)(task / spans);
        int64_t j0 = task % spans * KSTEP_AMX;
        uint16_t *kh = kc + (int64_t)h * nk * dim, *vh = vt + (int64_t)h * dim * nk;
        const uint16_t *vp[KSTEP_AMX];
        for (int j = 0; j < KSTEP_AMX; j++) {
            int64_t p = base + j0 + j;
            if (p > last) {
                memset(kh + (j0 + j) * dim, 0, sizeof(uint16_t) * (size_t)dim);
                vp[j] = NULL;
                continue;
            }
            int64_t at = c->table[p / c->block_size] * c->blk_stride + (p % c->block_size) * c->tok_stride
                         + h * c->head_stride;
            memcpy(kh + (j0 + j) * dim, (const uint16_t *)c->k + at, sizeof(uint16_t) * (size_t)dim);
            vp[j] = (const uint16_t *)c->v + at;
        }
        for (int d = 0; d < dim; d++) /* the span's values transposed: row d, 32 keys */
            for (int j = 0; j < KSTEP_AMX; j++) vh[d * nk + j0 + j] = vp[j] ? vp[j][d] : 0;
    }
}

/* A step's weights of rows 16x .. 16x + 15 as three bfloat16 parts, each weight w = w0 + w1 + w2
   exactly (w0 its top 16 bits, w1 the top 16 of w - w0, w2 the rest, which has 8 significant bits
   at most), laid out as a tile of key pairs: parts[s][k2][r] = part s of (w[2 k2][r], w[2 k2 + 1][r]). */
static void split_weights(const float *st, int x, uint32_t *parts) {
    for (int k2 = 0; k2 < KSTEP_AMX / 2; k2++) {
        v16f a = f32_load16(st + 2 * k2 * ROWS + 16 * x), b = f32_load16(st + (2 * k2 + 1) * ROWS + 16 * x);
        for (int s = 0; s < 3; s++) {
            v16u ua, ub;
            memcpy(&ua, &a, sizeof ua);
            memcpy(&ub, &b, sizeof ub);
            ua &= 0xFFFF0000u, ub &= 0xFFFF0000u;
            v16u pair = ua >> 16 | ub;
            memcpy(parts + (s * KSTEP_AMX / 2 + k2) * 16, &pair, sizeof pair);
            v16f ha, hb;
            memcpy(&ha, &ua, sizeof ha);
            memcpy(&hb, &ub, sizeof hb);
            a -= ha, b -= hb; /* exact: the bits below the top 16 */
        }
    }
}

/* A task on AMX tiles (bfloat16, dim a multiple of 32), in steps of 32 keys:
   - scores, keys x rows: tiles 0-2 the three row tiles' sums for sixteen keys, over the dimensions
     32 at a time (tile 3 the keys, straight from kc; tile 4 the queries as pairs, qp [dim / 2][ROWS]),
     scaled in the softmax;
   - values, transposed (dims x rows, ot [dim][ROWS]): for each row tile, its weights in three exact
     bfloat16 parts (tiles 5-7), and for sixteen dimensions at a time (two at once, tiles 0 and 1) the
     sums so far, loaded from ot, plus their values (tiles 3 and 4, straight from vt) times the three
     parts, stored back. A row tile whose max grew is rescaled on vectors first.
   A sum's products are exact and its order fixed by its row and key alone, whatever the tile.
   Returns 0, or -2 when it could not allocate its buffers. */
static int amx_task(const Call *c, int tile, int h, int rows, const uint16_t *kc, const uint16_t *vt,
                    int64_t base, int64_t nk) {
    int dim = c->dim, tiles = (rows + 15) / 16;
    /* floats: the sums (ot), the step's scores / weights (st); then the queries as bfloat16 pairs (qp)
       and a row tile's weights in parts (3 x 16 x 16 pairs) */
    float *buf = malloc(sizeof(float) * ((size_t)dim * ROWS + KSTEP_AMX * ROWS + (size_t)dim / 2 * ROWS + 768));
    if (buf == NULL) return -2;
    float *ot = buf, *st = ot + dim * ROWS;
    uint32_t *qp = (uint32_t *)(st + KSTEP_AMX * ROWS), *parts = qp + dim / 2 * ROWS;
    float m[ROWS], l[ROWS], corr[ROWS];
    int32_t pos[ROWS];
    memset(ot, 0, sizeof(float) * (size_t)dim * ROWS);
    memset(qp, 0, sizeof(uint32_t) * (size_t)dim / 2 * ROWS);
    start_rows(c, tile, rows, pos, m, l);
    for (int r = 0; r < rows; r++) {
        const uint16_t *qh = (const uint16_t *)((const char *)c->q + row_offset(c, tile, h, r, c->q_tok, c->q_head));
        for (int d2 = 0; d2 < dim / 2; d2++) qp[d2 * ROWS + r] = (uint32_t)qh[2 * d2] | (uint32_t)qh[2 * d2 + 1] << 16;
    }
    amx_configure();
    int64_t last = pos[rows - 1], lo = c->window > 0 && pos[0] >= c->window ? pos[0] - c->window + 1 : 0;
    for (int64_t p0 = lo / KSTEP_AMX * KSTEP_AMX; p0 <= last; p0 += KSTEP_AMX) {
        const uint16_t *keys = kc + ((int64_t)h * nk + (p0 - base)) * dim;
        for (int half = 0; half < 2; half++) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            for (int c32 = 0; c32 < dim / 32; c32++) {
                _tile_loadd(3, keys + half * 16 * dim + c32 * 32, dim * sizeof(uint16_t));
                const uint32_t *b = qp + c32 * 16 * ROWS;
                _tile_loadd(4, b, ROWS * sizeof(uint32_t));
                _tile_dpbf16ps(0, 3, 4);
                if (tiles > 1) {
                    _tile_loadd(4, b + 16, ROWS * sizeof(uint32_t));
                    _tile_dpbf16ps(1, 3, 4);
                }
                if (tiles > 2) {
                    _tile_loadd(4, b + 32, ROWS * sizeof(uint32_t));
                    _tile_dpbf16ps(2, 3, 4);
                }
            }
            float *s0 = st + half * 16 * ROWS;
            _tile_stored(0, s0, ROWS * sizeof(float));
            if (tiles > 1) _tile_stored(1, s0 + 16, ROWS * sizeof(float));
            if (tiles > 2) _tile_stored(2, s0 + 32, ROWS * sizeof(float));
        }
        softmax_step(st, m, l, corr, pos, p0, KSTEP_AMX, c->window, c->softcap, c->scale);
        const uint16_t *vals = vt + (int64_t)h * dim * nk + (p0 - base);
        for (int x = 0; x < tiles; x++) {
            split_weights(st, x, parts);
            _tile_loadd(5, parts, 64);
            _tile_loadd(6, parts + 256, 64);
            _tile_loadd(7, parts + 512, 64);
            v16f cr = f32_load16(corr + 16 * x);
            if (!all_ones16(cr)) /* a row's max grew: its sums so far rescaled (rare after the first steps) */
                for (int d = 0; d < dim; d++) {
                    float *o = ot + d * ROWS + 16 * x;
                    store16(o, f32_load16(o) * cr);
                }
            float *o = ot + 16 * x;
            for (int n = 0; n < dim / 16; n += 2) { /* two dimension tiles at a time, in tiles 0 and 1 */
                _tile_loadd(0, o + 16 * n * ROWS, ROWS * sizeof(float));
                _tile_loadd(1, o + 16 * (n + 1) * ROWS, ROWS * sizeof(float));
                _tile_loadd(3, vals + (int64_t)16 * n * nk, nk * sizeof(uint16_t));
                _tile_loadd(4, vals + (int64_t)16 * (n + 1) * nk, nk * sizeof(uint16_t));
                _tile_dpbf16ps(0, 3, 5);
                _tile_dpbf16ps(1, 4, 5);
                _tile_dpbf16ps(0, 3, 6);
                _tile_dpbf16ps(1, 4, 6);
                _tile_dpbf16ps(0, 3, 7);
                _tile_dpbf16ps(1, 4, 7);
                _tile_stored(0, o + 16 * n * ROWS, ROWS * sizeof(float));
                _tile_stored(1, o + 16 * (n + 1) * ROWS, ROWS * sizeof(float));
            }
        }
    }
    _tile_release();
    for (int r = 0; r < rows; r++) finish_row(c, tile, h, r, ot + r, ROWS, l[r]);
    free(buf);
    return 0;
}
#endif

int pd_amx_enabled = 1;

/* Whether bfloat16 prefill chunks take AMX tiles where the CPU and the OS have them: on (1, the
   default) or off (0), for tests and measurements of either path; returns whether the tiles will be
   used. */
int pd_use_amx(int enable) {
    pd_amx_enabled = enable != 0;
    return amx_ready();
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
        kc = malloc(2 * sizeof(uint16_t) * (size_t)(kv_heads * nk * dim));
        if (kc == NULL) return -2;
        vt = kc + kv_heads * nk * dim;
#if HAVE_AMX
        gather(&c, kv_heads, base, nk, last, kc, vt, threads);
#endif
    }
    int failed = 0;
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")
    for (int task = 0; task < tiles * kv_heads; task++) {
        int tile = tiles - 1 - task / kv_heads, h = task % kv_heads; /* longest rows first */
        int rows = per_head - tile * ROWS < ROWS ? per_head - tile * ROWS : ROWS;
#if HAVE_AMX
        int rc = amx ? amx_task(&c, tile, h, rows, kc, vt, base, nk) : vector_task(&c, tile, h, rows);
#else
        int rc = vector_task(&c, tile, h, rows);
#endif
        if (rc != 0) _Pragma("omp atomic write") failed = 1;
    }
    free(kc);
    return failed ? -2 : 0;
}
