/* The prefill attention kernel's bfloat16 path on AMX tiles (paged_prefill.c chooses it, where the
   CPU and the OS have them; docs/engine_speed.md, "Prefill attention"): the chunk's values (and its
   keys, where not read in place) gathered once per call (prefill_amx_gather), then each task's
   scores and value sums as tile products (prefill_amx_task). And the switch that turns it off for
   tests and measurements (pd_use_amx). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pdserve_kernels.h"
#include "amx.h"
#include "prefill.h"

#if HAVE_AMX
static inline int all_ones16(v16f x) { /* every row's max the same as before the step */
    return _mm512_cmpneq_ps_mask((__m512)x, _mm512_set1_ps(1.0f)) == 0;
}

/* 32 keys' values (vp[j], NULL: zeros), dim a multiple of 32, transposed: vh[d * nk + j] = vp[j][d]. On
   AVX-512, 32 x 32 blocks in registers, each stage swapping the off-diagonal halves of pairs of rows
   (256-bit halves, 128-bit lanes, 64-, 32-, then 16-bit pieces): SmolLM2's 64 dimensions in 294
   against 2,294 ns element by element (C harness, host E, 2026-12-06), which was ~5% of a prompt step. */
static void transpose_span(const uint16_t *const *vp, int dim, uint16_t *vh, int64_t nk) {
#if defined(__AVX512BW__)
    const __m512i lanes_lo = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0);
    const __m512i lanes_hi = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
    for (int d0 = 0; d0 < dim; d0 += 32) {
        __m512i r[32];
        for (int j = 0; j < 32; j++) r[j] = vp[j] ? _mm512_loadu_si512(vp[j] + d0) : _mm512_setzero_si512();
        for (int i = 0; i < 16; i++) {
            __m512i a = r[i], c = r[i + 16];
            r[i] = _mm512_shuffle_i64x2(a, c, 0x44), r[i + 16] = _mm512_shuffle_i64x2(a, c, 0xEE);
        }
        for (int i = 0; i < 32; i += (i & 7) == 7 ? 9 : 1) {
            __m512i a = r[i], c = r[i + 8];
            r[i] = _mm512_permutex2var_epi64(a, lanes_lo, c), r[i + 8] = _mm512_permutex2var_epi64(a, lanes_hi, c);
        }
        for (int i = 0; i < 32; i += (i & 3) == 3 ? 5 : 1) {
            __m512i a = r[i], c = r[i + 4];
            r[i] = _mm512_unpacklo_epi64(a, c), r[i + 4] = _mm512_unpackhi_epi64(a, c);
        }
        for (int i = 0; i < 32; i += (i & 1) ? 3 : 1) {
            __m512i a = r[i], c = r[i + 2];
            r[i] = _mm512_mask_blend_epi32(0xAAAA, a, _mm512_slli_epi64(c, 32));
            r[i + 2] = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(a, 32), c);
        }
        for (int i = 0; i < 32; i += 2) {
            __m512i a = r[i], c = r[i + 1];
            r[i] = _mm512_mask_blend_epi16(0xAAAAAAAAu, a, _mm512_slli_epi32(c, 16));
            r[i + 1] = _mm512_mask_blend_epi16(0xAAAAAAAAu, _mm512_srli_epi32(a, 16), c);
        }
        for (int d = 0; d < 32; d++) _mm512_storeu_si512(vh + (int64_t)(d0 + d) * nk, r[d]);
    }
#else
    for (int d = 0; d < dim; d++)
        for (int j = 0; j < KSTEP_AMX; j++) vh[d * nk + j] = vp[j] ? vp[j][d] : 0;
#endif
}

/* 16 x 16 floats (or 32-bit pairs) transposed in registers: r[i][j] becomes r[j][i]. */
static inline void transpose16(__m512 *r) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2)
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44), r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44), r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88), t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 8; i++)
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88), r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
}

/* A task's queries as bfloat16 pairs, dimension-major: qp[d2][r] = (q[r][2 d2], q[r][2 d2 + 1]), rows
   past `rows` zero; sixteen rows by sixteen pairs at a time, transposed in registers. */
static void pack_query_pairs(const Call *c, int tile, int h, int rows, uint32_t *qp) {
    for (int r0 = 0; r0 < ROWS; r0 += 16)
        for (int d0 = 0; d0 < c->dim / 2; d0 += 16) {
            __m512 v[16];
            for (int i = 0; i < 16; i++)
                v[i] = r0 + i < rows ? _mm512_loadu_ps((const uint32_t *)((const char *)c->q
                                                           + row_offset(c, tile, h, r0 + i, c->q_tok, c->q_head)) + d0)
                                     : _mm512_setzero_ps();
            transpose16(v);
            for (int i = 0; i < 16; i++) _mm512_storeu_ps(qp + (d0 + i) * ROWS + r0, v[i]);
        }
}

/* The rows' outputs, o[d][r] / l[r] rounded to bfloat16 (finish_row's, sixteen rows by sixteen
   dimensions at a time, transposed in registers). */
static void finish_rows(const Call *c, int tile, int h, int rows, const float *ot, const float *l) {
    for (int r0 = 0; r0 < rows; r0 += 16) {
        __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_loadu_ps(l + r0));
        for (int d0 = 0; d0 < c->dim; d0 += 16) {
            __m512 v[16];
            for (int i = 0; i < 16; i++) v[i] = _mm512_mul_ps(_mm512_loadu_ps(ot + (d0 + i) * ROWS + r0), inv);
            transpose16(v);
            for (int i = 0; i < 16 && r0 + i < rows; i++) {
                char *row = (char *)c->out + row_offset(c, tile, h, r0 + i, c->out_tok, c->out_head);
                bf16_store16((uint16_t *)row + d0, (v16f)v[i]);
            }
        }
    }
}

/* The call's keys base .. base + nk - 1 of each KV head (nk a multiple of 32; zeros past `last`),
   gathered from the pool once for every task: vt [kv head][dim][key], the values transposed, rows
   of the values' tiles, and (kc not NULL: blocks that do not hold a multiple of 16 keys) kc [kv
   head][key][dim], rows of the scores' key tiles. */
void prefill_amx_gather(const Call *c, int kv_heads, int64_t base, int64_t nk, int64_t last, uint16_t *kc,
                        uint16_t *vt, int threads) {
    int dim = c->dim;
    int64_t spans = nk / KSTEP_AMX;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t task = 0; task < kv_heads * spans; task++) {
        int h = (int)(task / spans);
        int64_t j0 = task % spans * KSTEP_AMX;
        uint16_t *kh = kc ? kc + (int64_t)h * nk * dim : NULL, *vh = vt + (int64_t)h * dim * nk;
        const uint16_t *vp[KSTEP_AMX];
        for (int j = 0; j < KSTEP_AMX; j++) {
            int64_t p = base + j0 + j;
            if (p > last) {
                if (kc) memset(kh + (j0 + j) * dim, 0, sizeof(uint16_t) * (size_t)dim);
                vp[j] = NULL;
                continue;
            }
            int64_t at = c->table[p / c->block_size] * c->blk_stride + (p % c->block_size) * c->tok_stride
                         + h * c->head_stride;
            if (kc) memcpy(kh + (j0 + j) * dim, (const uint16_t *)c->k + at, sizeof(uint16_t) * (size_t)dim);
            vp[j] = (const uint16_t *)c->v + at;
        }
        transpose_span(vp, dim, vh + j0, nk); /* the span's values transposed: row d, 32 keys */
    }
}

/* tile 0-2 += keys kt (in tile KT) x each row tile's queries from b (tiles 4-6) */
#define SCORES(KT)                                                \
    do {                                                          \
        _tile_loadd(KT, kt, kstride);                             \
        _tile_loadd(4, b, ROWS * sizeof(uint32_t));               \
        _tile_dpbf16ps(0, KT, 4);                                 \
        if (tiles > 1) {                                          \
            _tile_loadd(5, b + 16, ROWS * sizeof(uint32_t));      \
            _tile_dpbf16ps(1, KT, 5);                             \
        }                                                         \
        if (tiles > 2) {                                          \
            _tile_loadd(6, b + 32, ROWS * sizeof(uint32_t));      \
            _tile_dpbf16ps(2, KT, 6);                             \
        }                                                         \
    } while (0)

/* row tile x's sums of dimension tile n (o, in tile x) += the values (tile VT) x its weights (tile 5 + x) */
#define VALUES(VT)                                                           \
    do {                                                                     \
        _tile_loadd(VT, vals + (int64_t)16 * n * nk, nk * sizeof(uint16_t)); \
        _tile_loadd(0, o, ROWS * sizeof(float));                             \
        _tile_dpbf16ps(0, VT, 5);                                            \
        _tile_stored(0, o, ROWS * sizeof(float));                            \
        if (tiles > 1) {                                                     \
            _tile_loadd(1, o + 16, ROWS * sizeof(float));                    \
            _tile_dpbf16ps(1, VT, 6);                                        \
            _tile_stored(1, o + 16, ROWS * sizeof(float));                   \
        }                                                                    \
        if (tiles > 2) {                                                     \
            _tile_loadd(2, o + 32, ROWS * sizeof(float));                    \
            _tile_dpbf16ps(2, VT, 7);                                        \
            _tile_stored(2, o + 32, ROWS * sizeof(float));                   \
        }                                                                    \
    } while (0)

/* A task on AMX tiles (bfloat16, dim a multiple of 32), in steps of 32 keys:
   - scores, keys x rows: tiles 0-2 the three row tiles' sums for sixteen keys, over the dimensions
     32 at a time (the keys in tile 3 or 7: straight from the pool where blocks hold a multiple of
     16 keys, sixteen keys of one block a tile, else from kc; each row tile's queries in its own
     tile, 4-6, from qp [dim / 2][ROWS], so no load waits for the product before it to free its
     tile), scaled in the softmax. A key past a row's position is masked there, so what the pool
     holds past the chunk (the rest of its last block) never reaches a sum;
   - the softmax's weights rounded to bfloat16 as it makes them (softmax_step's `pairs`, as
     transformers' bfloat16 attention rounds them before their product with the values), a tile
     of key pairs per row tile (tiles 5-7 for the whole step);
   - values, transposed (dims x rows, ot [dim][ROWS]): for each sixteen dimensions, their values
     loaded once (tile 3 or 4, straight from vt) and, for each row tile, its sums so far loaded
     from ot into tile 0-2, plus the values times its weights, stored back. A row tile whose max
     grew is rescaled on vectors first.
   Each product is exact and a sum's order is fixed by its row and key alone, whatever the tile.
   Per 32 keys and 48 rows: 24 tile products, 35 loads and 18 stores (three exact bfloat16 parts of
   each weight took 36 products and 49 loads; SmolLM2's 512-token prompt on one thread: 0.78x the
   time, and 0.92x again with the keys read in place; docs/engine_speed.md, "Prefill attention").
   Returns 0, or -2 when it could not allocate its buffers. */
int prefill_amx_task(const Call *c, int tile, int h, int rows, const uint16_t *kc, const uint16_t *vt, int64_t base,
                     int64_t nk) {
    static const uint16_t zeros[512] __attribute__((aligned(64)));
    int dim = c->dim, tiles = (rows + 15) / 16;
    /* floats: the sums (ot), the step's scores / weights (st); then the queries as bfloat16 pairs (qp)
       and the row tiles' weights (3 x 16 x 16 pairs) */
    float *buf = malloc(sizeof(float) * ((size_t)dim * ROWS + KSTEP_AMX * ROWS + (size_t)dim / 2 * ROWS + 768));
    if (buf == NULL) return -2;
    float *ot = buf, *st = ot + dim * ROWS;
    uint32_t *qp = (uint32_t *)(st + KSTEP_AMX * ROWS), *w = qp + dim / 2 * ROWS;
    float m[ROWS], l[ROWS], corr[ROWS];
    int32_t pos[ROWS];
    memset(ot, 0, sizeof(float) * (size_t)dim * ROWS);
    start_rows(c, tile, rows, pos, m, l);
    pack_query_pairs(c, tile, h, rows, qp);
    amx_configure();
    int64_t last = pos[rows - 1], lo = c->window > 0 && pos[0] >= c->window ? pos[0] - c->window + 1 : 0;
    for (int64_t p0 = lo / KSTEP_AMX * KSTEP_AMX; p0 <= last; p0 += KSTEP_AMX) {
        for (int half = 0; half < 2; half++) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            /* sixteen keys: gathered (kc), or straight from the pool, all of one block (none past the
               task's last row: zeros) */
            int64_t p = p0 + 16 * half, kstride = dim * sizeof(uint16_t), step = 32;
            const uint16_t *k16;
            if (kc != NULL)
                k16 = kc + ((int64_t)h * nk + (p - base)) * dim;
            else if (p > last)
                k16 = zeros, kstride = 64, step = 0;
            else
                k16 = (const uint16_t *)c->k + c->table[p / c->block_size] * c->blk_stride
                      + (p % c->block_size) * c->tok_stride + h * c->head_stride,
                kstride = c->tok_stride * sizeof(uint16_t);
            for (int c32 = 0; c32 < dim / 32; c32++) { /* keys in tile 3 or 7, each row tile's queries its own tile */
                const uint16_t *kt = k16 + c32 * step;
                const uint32_t *b = qp + c32 * 16 * ROWS;
                if (c32 % 2 == 0)
                    SCORES(3);
                else
                    SCORES(7);
            }
            float *s0 = st + half * 16 * ROWS;
            _tile_stored(0, s0, ROWS * sizeof(float));
            if (tiles > 1) _tile_stored(1, s0 + 16, ROWS * sizeof(float));
            if (tiles > 2) _tile_stored(2, s0 + 32, ROWS * sizeof(float));
        }
        softmax_step(st, m, l, corr, pos, p0, KSTEP_AMX, c->window, c->softcap, c->scale, w);
        const uint16_t *vals = vt + (int64_t)h * dim * nk + (p0 - base);
        for (int x = 0; x < tiles; x++) {
            v16f cr = f32_load16(corr + 16 * x);
            if (!all_ones16(cr)) /* a row's max grew: its sums so far rescaled (rare after the first steps) */
                for (int d = 0; d < dim; d++) {
                    float *o = ot + d * ROWS + 16 * x;
                    store16(o, f32_load16(o) * cr);
                }
        }
        _tile_loadd(5, w, 64); /* row tile x's weights in tile 5 + x */
        if (tiles > 1) _tile_loadd(6, w + 256, 64);
        if (tiles > 2) _tile_loadd(7, w + 512, 64);
        for (int n = 0; n < dim / 16; n++) { /* each dimension tile's values once (tile 3 or 4), for every row tile */
            float *o = ot + 16 * n * ROWS;
            if (n % 2 == 0)
                VALUES(3);
            else
                VALUES(4);
        }
    }
    _tile_release();
#undef SCORES
#undef VALUES
    finish_rows(c, tile, h, rows, ot, l);
    free(buf);
    return 0;
}
#endif

int pd_amx_enabled = 1;

/* Whether bfloat16 attention takes AMX tiles where the CPU and the OS have them (prefill chunks here,
   decode rows' scores in decode_amx.c): on (1, the default) or off (0), for tests and measurements
   of either path; returns whether the tiles will be used. */
int pd_use_amx(int enable) {
    pd_amx_enabled = enable != 0;
    return amx_ready();
}

