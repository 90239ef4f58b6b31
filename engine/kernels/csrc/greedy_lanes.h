/* A greedy LM head's running argmax in registers, for the GEMMs that fuse it (bf16_gemm.c's
   vdpbf16ps blocks, amx_gemm.c's tiles): each output rounded to bfloat16 exactly as the GEMM would
   store it, kept only as each row's largest (the first column on a tie, as torch's argmax), so the
   [rows, vocabulary] logits are never written nor read again. Where AVX-512 is built. */
#ifndef PDSERVE_GREEDY_LANES_H
#define PDSERVE_GREEDY_LANES_H

#if defined(__AVX512F__)
#include <stdlib.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

/* A row's running argmax in one thread: lane l holds the largest rounded output
   it has seen in columns = l mod 16, the first such column, and whether any was NaN */
typedef struct {
    __m512 top;
    __m512i where, nan;
} best16;

/* R rows' sums for P panels ([R][16 P]), rounded as the GEMM stores them, into the rows' running argmax
   (col0: the block's first column; columns past cols are not outputs) */
static __attribute__((noinline, unused)) void keep_best(const float *sums, int R, int P, const uint16_t *bias,
                                                        best16 *best, int64_t col0, int64_t cols) {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int r = 0; r < R; r++) {
        best16 b = best[r];
        for (int p = 0; p < P && 16 * p < cols; p++) {
            v16f s = f32_load16(sums + (r * P + p) * 16);
            if (bias) {
                uint16_t part[16] = {0}; /* the bias ends at the last column */
                memcpy(part, bias + 16 * p, sizeof(uint16_t) * (size_t)(cols - 16 * p < 16 ? cols - 16 * p : 16));
                s += bf16_load16(part);
            }
            __m512 v = (__m512)bf16_round16(s);
            __m512i at = _mm512_add_epi32(lanes, _mm512_set1_epi32((int)(col0 + 16 * p)));
            __mmask16 valid = _mm512_cmplt_epi32_mask(_mm512_sub_epi32(at, _mm512_set1_epi32((int)col0)),
                                                      _mm512_set1_epi32((int)cols));
            __mmask16 nan = _mm512_mask_cmp_ps_mask(valid, v, v, _CMP_UNORD_Q);
            __mmask16 more = _mm512_mask_cmp_ps_mask(valid, v, b.top, _CMP_GT_OQ) |
                             (_mm512_mask_cmp_ps_mask(valid, v, b.top, _CMP_EQ_OQ) &
                              _mm512_cmplt_epi32_mask(at, b.where));
            b.top = _mm512_mask_mov_ps(b.top, more, v);
            b.where = _mm512_mask_mov_epi32(b.where, more, at);
            b.nan = _mm512_mask_mov_epi32(b.nan, nan, _mm512_set1_epi32(-1));
        }
        best[r] = b;
    }
}

/* A row's lanes before any output: nothing seen. */
static inline best16 best16_none(void) {
    return (best16){_mm512_set1_ps(-__builtin_inff()), _mm512_set1_epi32(INT32_MAX), _mm512_setzero_si512()};
}

/* Row r's token from every thread's lanes: the largest, the first column on a tie; -1 if any was NaN. */
static inline __attribute__((unused)) int64_t merge_best(const best16 *best, int rows, int teams, int r) {
    float top = 0;
    int64_t at = -1;
    for (int t = 0; t < teams; t++) {
        const best16 *b = best + (int64_t)t * rows + r;
        if (_mm512_test_epi32_mask(b->nan, b->nan)) return -1;
        float vals[16];
        int32_t where[16];
        _mm512_storeu_ps(vals, b->top);
        _mm512_storeu_si512(where, b->where);
        for (int l = 0; l < 16; l++)
            if (where[l] != INT32_MAX && (at < 0 || vals[l] > top || (vals[l] == top && where[l] < at)))
                top = vals[l], at = where[l];
    }
    return at;
}

/* A GEMM that keeps each row's lanes in `best` (threads x rows) instead of writing outputs. */
typedef int (*lanes_gemm)(const uint16_t *x, int64_t x_stride, const uint16_t *panels, const uint16_t *bias,
                          uint16_t *out, int64_t out_stride, best16 *best, int rows, int64_t n, int64_t k, int threads);

/* Each row's greedy token by `gemm`: its lanes per thread, merged; -2 out of memory, 1 a NaN row. */
static inline __attribute__((unused)) int greedy_by(lanes_gemm gemm, const uint16_t *x, int64_t x_stride,
                                                    const uint16_t *panels, const uint16_t *bias, int rows, int64_t n,
                                                    int64_t k, int64_t *tokens, int threads) {
    threads = threads < 1 ? 1 : threads;
    best16 *best = aligned_alloc(64, sizeof(best16) * (size_t)threads * (size_t)rows);
    if (best == NULL) return -2;
    for (int64_t i = 0; i < (int64_t)threads * rows; i++) best[i] = best16_none();
    int rc = gemm(x, x_stride, panels, bias, NULL, 0, best, rows, n, k, threads);
    for (int r = 0; rc == 0 && r < rows; r++)
        if ((tokens[r] = merge_best(best, rows, threads, r)) < 0) rc = 1;
    free(best);
    return rc;
}
#endif
#endif
