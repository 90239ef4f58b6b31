/* The decode kernel's bfloat16 scores on AMX tiles (paged_decode.c chooses them where the CPU and
   the OS have tiles, head dims are a multiple of 32 and blocks hold a multiple of 16 keys).

A row's keys are taken 16 positions at a time, aligned (p0 = 16 t: one block holds them all, each
key tok_stride past the one before): for each KV head, its 16 keys are a tile's rows straight from
the pool, 32 dimensions a tile (no gather, no copy), times the query heads sharing it as a tile of
dimension pairs (built once a call, its unused columns zero), summed over the dimensions in one
tile of 16 keys x 16 heads; the heads' columns come back as vectors, scaled, into their score rows
(positions outside first .. len - 1 not stored). Each score is one float32 sum of exact products
in the order of its dimensions, whatever the batch. The next 16 keys are prefetched into L2 a KV
head's share at a time, so the misses spread over the work (all at once: 6.1-6.5 against 5.8-6.1
ms, C harness, cold). SmolLM2's shape, 16 rows of 257 keys, 30 layers, 2 threads (2026-12-04, Xeon
host): the step's decode attention 5.8-5.9 ms with scores by vdpbf16ps, 5.5-5.7 on tiles; in the C
harness with every key in cache, 3.6 -> 3.0 ms. */
#include <stdint.h>
#include <string.h>

#include "amx.h"
#include "decode.h"

#if HAVE_AMX
/* Scores of the query heads sharing each of `kv_heads` KV heads (q: the first's bfloat16 query,
   heads q_head apart; k: the first KV head's keys of block 0) over positions first .. len - 1, to
   sc [kv_heads * groups][len - first]. qb: kv_heads * dim / 32 KiB of scratch, cbuf 1 KiB. */
void decode_amx_scores(const uint16_t *q, int64_t q_head, const uint16_t *k, int64_t blk_stride, int64_t tok_stride,
                       int64_t head_stride, const int64_t *table, int block_size, int64_t first, int64_t len,
                       int kv_heads, int groups, int dim, float scale, float *sc, int64_t span, uint32_t *qb,
                       float *cbuf) {
    int chunks = dim / 32;
    int64_t count = len - first;
    memset(qb, 0, sizeof(uint32_t) * 256 * (size_t)(kv_heads * chunks));
    for (int kh = 0; kh < kv_heads; kh++) /* qb [kv head][chunk][16 dimension pairs][16 heads] */
        for (int g = 0; g < groups; g++) {
            const uint16_t *qh = q + (kh * groups + g) * q_head;
            for (int d2 = 0; d2 < dim / 2; d2++)
                qb[((kh * chunks + d2 / 16) * 16 + d2 % 16) * 16 + g] = qh[2 * d2] | (uint32_t)qh[2 * d2 + 1] << 16;
        }
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(16));
    const __m512 scale16 = _mm512_set1_ps(scale);
    amx_configure();
    for (int64_t p0 = first / 16 * 16; p0 < len; p0 += 16) {
        const uint16_t *keys = k + table[p0 / block_size] * blk_stride + (p0 % block_size) * tok_stride;
        const char *next = p0 + 16 < len ? (const char *)(k + table[(p0 + 16) / block_size] * blk_stride
                                                          + ((p0 + 16) % block_size) * tok_stride) : NULL;
        int lo = p0 < first ? (int)(first - p0) : 0, hi = len - p0 < 16 ? (int)(len - p0) : 16;
        __mmask16 stored = (__mmask16)(((1u << hi) - 1) & ~((1u << lo) - 1));
        for (int kh = 0; kh < kv_heads; kh++) {
            for (int e = 16 * kh / kv_heads; next && e < 16 * (kh + 1) / kv_heads; e++) /* the next 16 keys */
                prefetch_span(next + e * tok_stride * (int64_t)sizeof(uint16_t), span); /* a share a KV head */
            _tile_zero(0);
            for (int c = 0; c < chunks; c++) {
                _tile_loadd(1, keys + kh * head_stride + 32 * c, tok_stride * sizeof(uint16_t));
                _tile_loadd(2, qb + (kh * chunks + c) * 256, 64);
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, cbuf, 64);
            for (int g = 0; g < groups; g++) /* head g's column of 16 keys, into its row of scores */
                _mm512_mask_storeu_ps(sc + (kh * groups + g) * count + (p0 - first), stored,
                                      _mm512_mul_ps(_mm512_i32gather_ps(column, cbuf + g, 4), scale16));
        }
    }
    _tile_release();
}
#else
void decode_amx_scores(const uint16_t *q, int64_t q_head, const uint16_t *k, int64_t blk_stride, int64_t tok_stride,
                       int64_t head_stride, const int64_t *table, int block_size, int64_t first, int64_t len,
                       int kv_heads, int groups, int dim, float scale, float *sc, int64_t span, uint32_t *qb,
                       float *cbuf) { /* never called: paged_decode.c takes tiles only where HAVE_AMX */
    (void)q, (void)q_head, (void)k, (void)blk_stride, (void)tok_stride, (void)head_stride, (void)table;
    (void)block_size, (void)first, (void)len, (void)kv_heads, (void)groups, (void)dim, (void)scale, (void)sc;
    (void)span, (void)qb, (void)cbuf;
}
#endif
