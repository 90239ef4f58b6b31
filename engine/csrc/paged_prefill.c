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

Strides are in elements, as in paged_decode.c: key p of KV head h is at
k[table[p / block_size] * blk_stride + (p % block_size) * tok_stride + h * head_stride + d].
*/
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#define ROWS 48  /* query rows of a task: six vectors of eight */
#define VROWS 6  /* rows of a value-sum tile: with sixteen dimensions, twelve sums in registers */
#define KSTEP 24 /* keys per online-softmax step: four tiles of six */
#define KSTEP_AMX 32 /* keys per step where AMX computes the scores: two tiles of sixteen */
#define KMAX 32      /* the longer of the two */

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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1

/* Whether this process may use AMX's tile registers: Linux asks each process to request them once
   (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA); a kernel that refuses leaves the vector path. */
static int amx_permitted(void) {
    static int state; /* 0 unknown, 1 yes, -1 no */
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0 ? 1 : -1;
    return state == 1;
}

/* Every tile 16 rows of 64 bytes: scores C (16 keys x 16 rows, float32), keys A (16 keys x 32
   dimensions, bfloat16), queries B (16 dimension pairs x 16 rows, bfloat16 pairs). */
static void amx_configure(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((packed)) cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 5; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
}

/* One step's scores by AMX: st[j][r] = sum over dimension pairs of keys[j] . queries[r], keys
   j < 32 (kst: bfloat16 rows of `dim`), rows in `tiles` tiles of 16 (qp: the queries as bfloat16 pairs,
   dimension-pair-major, ROWS to a pair). Tiles 0-2 hold the three row tiles' sums for sixteen keys,
   over the dimensions 32 at a time (tile 3 the keys', tile 4 the queries'), each sum in the same
   order whatever the tile. */
static void scores_amx(const uint16_t *kst, const uint32_t *qp, float *st, int dim, int tiles) {
    for (int half = 0; half < 2; half++) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        for (int c = 0; c < dim / 32; c++) {
            _tile_loadd(3, kst + half * 16 * dim + c * 32, dim * sizeof(uint16_t));
            const uint32_t *b = qp + c * 16 * ROWS;
            _tile_loadd(4, b, ROWS * sizeof(uint32_t));
            _tile_dpbf16ps(0, 3, 4);
            if (tiles > 1) { _tile_loadd(4, b + 16, ROWS * sizeof(uint32_t));
                _tile_dpbf16ps(1, 3, 4); }
            if (tiles > 2) { _tile_loadd(4, b + 32, ROWS * sizeof(uint32_t));
                _tile_dpbf16ps(2, 3, 4); }
        }
        float *c0 = st + half * 16 * ROWS;
        _tile_stored(0, c0, ROWS * sizeof(float));
        if (tiles > 1) _tile_stored(1, c0 + 16, ROWS * sizeof(float));
        if (tiles > 2) _tile_stored(2, c0 + 32, ROWS * sizeof(float));
    }
}
#else
#define HAVE_AMX 0
static int amx_permitted(void) { return 0; }
#endif

static int amx_enabled = 1; /* pd_prefill_amx */

/* Whether bfloat16 chunks take AMX for their scores (where the CPU has it): on (1) or off (0), for
   tests and measurements of either path; returns whether AMX will be used. */
int pd_prefill_amx(int enable) {
    amx_enabled = enable != 0;
    return HAVE_AMX && amx_enabled && amx_permitted();
}

/* dtype: 0 = float32, 1 = bfloat16 (q, the pool and out alike). q [nq][heads][dim] and out
   likewise, by their token / head strides; table: the sequence's blocks, covering keys
   0 .. pos0 + nq - 1. Returns 0; -1 for a dtype it does not know; -2 when a task could not
   allocate its buffers (its rows are not written). */
int pd_paged_prefill(int dtype, const void *q, int64_t q_tok, int64_t q_head, const void *k,
                     const void *v, int64_t blk_stride, int64_t tok_stride, int64_t head_stride,
                     const int64_t *table, int64_t pos0, int nq, void *out, int64_t out_tok,
                     int64_t out_head, int heads, int kv_heads, int dim, int block_size, float scale,
                     int window, float softcap, int threads) {
    if (dtype != 0 && dtype != 1) return -1;
    size_t elem = dtype == 0 ? sizeof(float) : sizeof(uint16_t);
    int groups = heads / kv_heads, per_head = nq * groups, tiles = (per_head + ROWS - 1) / ROWS;
    /* AMX: bfloat16 scores in steps of 32 keys, scaled after the sums */
    int amx = dtype == 1 && dim % 32 == 0 && HAVE_AMX && amx_enabled && amx_permitted();
    int ks = amx ? KSTEP_AMX : KSTEP;
    float post = amx ? scale : 1.0f, pre = amx ? 1.0f : scale;
    int failed = 0;
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")
    for (int task = 0; task < tiles * kv_heads; task++) {
        int tile = tiles - 1 - task / kv_heads, h = task % kv_heads; /* longest rows first */
        int rows = per_head - tile * ROWS < ROWS ? per_head - tile * ROWS : ROWS;
        /* floats: queries (packed), sums, a step's keys and values (widened; keys as bfloat16 for AMX), scores */
        float *buf = malloc(sizeof(float) * (size_t)(2 * ROWS * dim + 2 * KMAX * dim + KMAX * ROWS));
        if (buf == NULL) {
            _Pragma("omp atomic write") failed = 1;
            continue;
        }
        float *qt = buf, *o = qt + ROWS * dim, *kf = o + ROWS * dim, *vf = kf + KMAX * dim;
        float *st = vf + KMAX * dim;
        uint32_t *qp = (uint32_t *)qt; /* amx: the queries as bfloat16 pairs, [dim / 2][ROWS] */
        uint16_t *kst = (uint16_t *)kf; /* amx: the step's keys, bfloat16, [KSTEP_AMX][dim] */
        float m[ROWS], l[ROWS], corr[ROWS], row_q[dim];
        int32_t pos[ROWS]; /* each row's position; -1 for the padding rows past `rows` */
        memset(qt, 0, sizeof(float) * ROWS * dim);
        memset(o, 0, sizeof(float) * ROWS * dim);
        for (int r = 0; r < ROWS; r++) {
            m[r] = -INFINITY, l[r] = 0.0f, pos[r] = -1;
            if (r >= rows) continue;
            int g = tile * ROWS + r, t = g / groups, head = h * groups + g % groups;
            pos[r] = (int32_t)(pos0 + t);
            const char *qr = (const char *)q + ((int64_t)t * q_tok + (int64_t)head * q_head) * (int64_t)elem;
            if (amx) {
                const uint16_t *qh = (const uint16_t *)qr;
                for (int d2 = 0; d2 < dim / 2; d2++) qp[d2 * ROWS + r] = (uint32_t)qh[2 * d2] | (uint32_t)qh[2 * d2 + 1] << 16;
                continue;
            }
            widen(qr, dtype, row_q, dim);
            for (int d = 0; d < dim; d++) qt[d * ROWS + r] = row_q[d] * pre;
        }
#if HAVE_AMX
        if (amx) amx_configure();
#endif
        int64_t last = pos[rows - 1], lo = window > 0 && pos[0] >= window ? pos[0] - window + 1 : 0;
        for (int64_t p0 = lo / ks * ks; p0 <= last; p0 += ks) {
            for (int j = 0; j < ks; j++) { /* this step's keys and values; zeros past `last` */
                int64_t p = p0 + j;
                if (p > last) {
                    if (amx) memset(kst + j * dim, 0, sizeof(uint16_t) * (size_t)dim);
                    else memset(kf + j * dim, 0, sizeof(float) * (size_t)dim);
                    memset(vf + j * dim, 0, sizeof(float) * (size_t)dim);
                    continue;
                }
                int64_t at = (table[p / block_size] * blk_stride + (p % block_size) * tok_stride
                              + h * head_stride) * (int64_t)elem;
                if (amx) memcpy(kst + j * dim, (const char *)k + at, sizeof(uint16_t) * (size_t)dim);
                else widen((const char *)k + at, dtype, kf + j * dim, dim);
                widen((const char *)v + at, dtype, vf + j * dim, dim);
            }
#if HAVE_AMX
            if (amx) scores_amx(kst, qp, st, dim, (rows + 15) / 16);
            else
#endif
            for (int j0 = 0; j0 < KSTEP; j0 += 6) /* padding rows past `rows`: only to the tile's edge */
                scores(kf, qt, st, dim, j0, rows);
            for (int r0 = 0; r0 < ROWS; r0 += 16) { /* sixteen rows at a time: mask, max, exp, sums */
                v16f m16 = f32_load16(m + r0), top = m16, sum = {0}, none = (v16f){0} - INFINITY;
                v16i pos16;
                memcpy(&pos16, pos + r0, sizeof pos16);
                for (int j = 0; j < ks; j++) {
                    float *s = st + j * ROWS + r0;
                    if (amx) store16(s, f32_load16(s) * post);
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
            for (int r0 = 0; r0 < rows; r0 += VROWS) values(st, vf, corr, o, dim, r0, ks);
        }
#if HAVE_AMX
        if (amx) _tile_release();
#endif
        for (int r = 0; r < rows; r++) {
            int g = tile * ROWS + r, t = g / groups, head = h * groups + g % groups;
            char *dst = (char *)out + ((int64_t)t * out_tok + (int64_t)head * out_head) * (int64_t)elem;
            float inv = 1.0f / l[r];
            for (int d = 0; d < dim; d++) {
                float x = o[r * dim + d] * inv;
                if (dtype == 0)
                    ((float *)dst)[d] = x;
                else
                    ((uint16_t *)dst)[d] = bf16_store(x);
            }
        }
        free(buf);
    }
    return failed ? -2 : 0;
}
