/* Decode attention straight from the paged KV pool, on the CPU (engine/cpu_kernel.py builds it).

One query token per sequence. Each (sequence, KV head) is one task: the heads sharing that KV
head read each key and value once, in place in its block (no gather, no padding, no mask), in
three passes: scores (q.k * scale, soft-capped when asked), a max-subtracted exp, and the
probability-weighted sum of values (four keys at a time, so each running sum is loaded and stored
once per four keys; 25% faster with the pool in cache, a few percent when it streams from memory).
Each pass prefetches the key (value) a few positions ahead, which may sit in another block
anywhere in the pool. Float32 throughout; bfloat16 pools are widened on load.
Every pass runs on 8-lane vectors (GCC/Clang vector extensions, so it builds for any target): dot
products in two sums over the head dimension, the max and a vector exp over the scores, the value
sum eight lanes at a time; a head dimension that is no multiple of 8 finishes in scalars.
A task's arithmetic never depends on the other rows of the step, so a row's result does not
depend on what it is batched with.

Strides are in elements. k/v point at one layer's K (V) of block 0: key p of sequence i, KV
head h, is at k[tables[i, p / block_size] * blk_stride + (p % block_size) * tok_stride
+ h * head_stride + d]. A query at position lens[i] - 1 sees keys [lens[i] - window, lens[i])
with a sliding window, all of [0, lens[i]) without (window 0).
*/
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#define AHEAD 4 /* keys prefetched ahead: blocks are scattered, and a hardware prefetcher stops at a page */

static inline void prefetch_span(const void *start, int64_t span) {
    for (int64_t b = 0; b < span; b += 64) __builtin_prefetch((const char *)start + b);
}

/* Key (value) position p of the task's row in the pool that `base` points into (the names are
   the decode function's own: its row's block table, block size and strides). */
#define AT(base, p) ((base) + table[(p) / block_size] * blk_stride + ((p) % block_size) * tok_stride)

#define DEFINE_DECODE(NAME, T, LOAD, LOAD8, STORE)                                                  \
    static int NAME(const T *q, int64_t q_tok, int64_t q_head, const T *k, const T *v,              \
                     int64_t blk_stride, int64_t tok_stride, int64_t head_stride,                   \
                     const int64_t *tables, int64_t table_stride, const int64_t *lens, T *out,      \
                     int64_t out_tok, int64_t out_head, int n, int heads, int kv_heads, int dim,    \
                     int block_size, float scale, int window, float softcap, int threads) {         \
        int groups = heads / kv_heads;                                                              \
        int parts = n >= 2 * threads ? 1 : kv_heads; /* few rows: split each row's heads too */     \
        int failed = 0;                                                                             \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")                       \
        for (int task = 0; task < n * parts; task++) {                                              \
            int i = task / parts, part = task % parts;                                              \
            int h0 = part * kv_heads / parts, h1 = (part + 1) * kv_heads / parts;                   \
            int nq = (h1 - h0) * groups; /* query heads h0 * groups .. h1 * groups */               \
            int64_t len = lens[i];                                                                  \
            int64_t first = window > 0 && len > window ? len - window : 0;                          \
            int64_t count = len - first;                                                            \
            float *buf = malloc(sizeof(float) * (size_t)nq * (size_t)(2 * dim + count));            \
            if (buf == NULL) {                                                                      \
                _Pragma("omp atomic write") failed = 1;                                             \
                continue;                                                                           \
            }                                                                                       \
            float *qf = buf, *acc = buf + nq * dim, *sc = buf + 2 * nq * dim;                       \
            const int64_t *table = tables + i * table_stride;                                       \
            int64_t span = ((h1 - h0 - 1) * head_stride + dim) * (int64_t)sizeof(T);                \
            int64_t hoff[nq]; /* query head j reads KV head h0 + j / groups: no division per key */ \
            for (int j = 0; j < nq; j++) hoff[j] = (h0 + j / groups) * head_stride;                \
            for (int j = 0; j < nq; j++) {                                                          \
                const T *qj = q + i * q_tok + (int64_t)(h0 * groups + j) * q_head;                  \
                for (int d = 0; d < dim; d++) qf[j * dim + d] = LOAD(qj[d]) * scale;                \
                for (int d = 0; d < dim; d++) acc[j * dim + d] = 0.0f;                              \
            }                                                                                       \
            /* scores: each key is read once, for every query head that shares it */              \
            for (int64_t p = first; p < len; p++) {                                                 \
                const T *kp = AT(k, p);                                                             \
                if (p + AHEAD < len) prefetch_span(AT(k, p + AHEAD) + h0 * head_stride, span);      \
                for (int j = 0; j < nq; j++) {                                                      \
                    const T *kh = kp + hoff[j];                                                     \
                    const float *qj = qf + j * dim;                                                 \
                    v8f s0 = {0}, s1 = {0};                                                         \
                    int d = 0;                                                                      \
                    for (; d + 16 <= dim; d += 16) {                                                \
                        s0 += f32_load8(qj + d) * LOAD8(kh + d);                                    \
                        s1 += f32_load8(qj + d + 8) * LOAD8(kh + d + 8);                            \
                    }                                                                               \
                    if (d + 8 <= dim) s0 += f32_load8(qj + d) * LOAD8(kh + d), d += 8;              \
                    float s = hsum(s0 + s1);                                                        \
                    for (; d < dim; d++) s += qj[d] * LOAD(kh[d]);                                  \
                    sc[j * count + (p - first)] = softcap > 0.0f ? tanhf(s / softcap) * softcap : s; \
                }                                                                                   \
            }                                                                                       \
            float inv[nq];                                                                          \
            for (int j = 0; j < nq; j++) {                                                          \
                float *row = sc + j * count;                                                        \
                v8f top8 = (v8f){0} - INFINITY, sum8 = {0};                                         \
                int64_t c = 0;                                                                      \
                for (; c + 8 <= count; c += 8) top8 = vmax(top8, f32_load8(row + c));               \
                float lanes[8], top = -INFINITY, sum;                                               \
                memcpy(lanes, &top8, sizeof lanes);                                                 \
                for (int l = 0; l < 8; l++) top = lanes[l] > top ? lanes[l] : top;                  \
                for (; c < count; c++) top = row[c] > top ? row[c] : top;                           \
                for (c = 0; c + 8 <= count; c += 8) {                                               \
                    v8f e = exp_nonpos8(f32_load8(row + c) - top);                                  \
                    store8(row + c, e);                                                             \
                    sum8 += e;                                                                      \
                }                                                                                   \
                sum = hsum(sum8);                                                                   \
                for (; c < count; c++) sum += row[c] = exp_nonpos(row[c] - top);                    \
                inv[j] = 1.0f / sum;                                                                \
            }                                                                                       \
            /* values four keys at a time: a sum is loaded and stored once per four keys, each   \
               key's update still its own, in key order (the same bits as key by key) */         \
            int64_t p = first;                                                                      \
            for (; p + 4 <= len; p += 4) {                                                          \
                const T *vp[4];                                                                     \
                for (int e = 0; e < 4; e++) {                                                       \
                    vp[e] = AT(v, p + e);                                                           \
                    if (p + e + AHEAD < len) prefetch_span(AT(v, p + e + AHEAD) + h0 * head_stride, span); \
                }                                                                                   \
                for (int j = 0; j < nq; j++) {                                                      \
                    const float *wr = sc + j * count + (p - first);                                 \
                    const T *v0 = vp[0] + hoff[j], *v1 = vp[1] + hoff[j];                           \
                    const T *v2 = vp[2] + hoff[j], *v3 = vp[3] + hoff[j];                           \
                    v8f w0 = splat(wr), w1 = splat(wr + 1), w2 = splat(wr + 2), w3 = splat(wr + 3); \
                    float *a = acc + j * dim;                                                       \
                    int d = 0;                                                                      \
                    for (; d + 8 <= dim; d += 8) {                                                  \
                        v8f x = f32_load8(a + d);                                                   \
                        x += w0 * LOAD8(v0 + d);                                                    \
                        x += w1 * LOAD8(v1 + d);                                                    \
                        x += w2 * LOAD8(v2 + d);                                                    \
                        x += w3 * LOAD8(v3 + d);                                                    \
                        store8(a + d, x);                                                           \
                    }                                                                               \
                    for (; d < dim; d++) {                                                          \
                        float x = a[d];                                                             \
                        x += wr[0] * LOAD(v0[d]);                                                   \
                        x += wr[1] * LOAD(v1[d]);                                                   \
                        x += wr[2] * LOAD(v2[d]);                                                   \
                        x += wr[3] * LOAD(v3[d]);                                                   \
                        a[d] = x;                                                                   \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
            for (; p < len; p++) {                                                                  \
                const T *vp = AT(v, p);                                                             \
                if (p + AHEAD < len) prefetch_span(AT(v, p + AHEAD) + h0 * head_stride, span);      \
                for (int j = 0; j < nq; j++) {                                                      \
                    const T *vh = vp + hoff[j];                                                     \
                    float w = sc[j * count + (p - first)];                                          \
                    v8f w8 = {w, w, w, w, w, w, w, w};                                              \
                    float *a = acc + j * dim;                                                       \
                    int d = 0;                                                                      \
                    for (; d + 8 <= dim; d += 8) store8(a + d, f32_load8(a + d) + w8 * LOAD8(vh + d)); \
                    for (; d < dim; d++) a[d] += w * LOAD(vh[d]);                                   \
                }                                                                                   \
            }                                                                                       \
            for (int j = 0; j < nq; j++) {                                                          \
                T *o = out + i * out_tok + (int64_t)(h0 * groups + j) * out_head;                   \
                for (int d = 0; d < dim; d++) o[d] = STORE(acc[j * dim + d] * inv[j]);              \
            }                                                                                       \
            free(buf);                                                                              \
        }                                                                                           \
        return failed ? -2 : 0; /* -2: out of memory for a task's scores */                         \
    }

#define F32_LOAD(x) (x)
#define F32_STORE(x) (x)
DEFINE_DECODE(decode_f32, float, F32_LOAD, f32_load8, F32_STORE)
DEFINE_DECODE(decode_bf16, uint16_t, bf16_load, bf16_load8, bf16_store)

/* dtype: 0 = float32, 1 = bfloat16 (q, the pool and out alike). Returns 0; -1 for a dtype it
   does not know; -2 when a task could not allocate its scores (its rows are not written). */
int pd_paged_decode(int dtype, const void *q, int64_t q_tok, int64_t q_head, const void *k,
                    const void *v, int64_t blk_stride, int64_t tok_stride, int64_t head_stride,
                    const int64_t *tables, int64_t table_stride, const int64_t *lens, void *out,
                    int64_t out_tok, int64_t out_head, int n, int heads, int kv_heads, int dim,
                    int block_size, float scale, int window, float softcap, int threads) {
    if (dtype == 0)
        return decode_f32(q, q_tok, q_head, k, v, blk_stride, tok_stride, head_stride, tables,
                          table_stride, lens, out, out_tok, out_head, n, heads, kv_heads, dim,
                          block_size, scale, window, softcap, threads);
    if (dtype == 1)
        return decode_bf16(q, q_tok, q_head, k, v, blk_stride, tok_stride, head_stride, tables,
                           table_stride, lens, out, out_tok, out_head, n, heads, kv_heads, dim,
                           block_size, scale, window, softcap, threads);
    return -1;
}
