/* Decode attention straight from the paged KV pool, on the CPU (engine/cpu_kernel.py builds it).

One query token per sequence. Each (sequence, KV head) is one task: the heads sharing that KV
head read each key and value once, in place in its block (no gather, no padding, no mask), in
three passes over the row's keys, eight keys at a time:
- scores (q.k * scale): for each query head, eight dot products accumulated side by side (one
  load of q for eight keys) and summed across lanes together (sum_lanes8);
- a max-subtracted exp (soft-capped first when asked);
- the probability-weighted sum of values: 64 of a head's sums held in registers over the eight
  keys, each key's update its own, in key order.
Where each key sits is worked out once per task (`at`: no division per key, which cost more than
the arithmetic), and each pass prefetches the keys (values) eight positions ahead, one key per
query head's turn so the misses spread over the work: blocks are scattered anywhere in the pool.
Float32 throughout; bfloat16 pools are widened on load.
Every pass runs on 8-lane vectors (GCC/Clang vector extensions, so it builds for any target); a
head dimension that is no multiple of 8 finishes in scalars.
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

#define AHEAD 8 /* keys prefetched ahead: blocks are scattered, and a hardware prefetcher stops at a page */
#define GROUP 8 /* keys whose dot products with one query head are summed across lanes together */

static inline void prefetch_span(const void *start, int64_t span) {
    for (int64_t b = 0; b < span; b += 64) __builtin_prefetch((const char *)start + b);
}

#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

/* Lane e of the result: the sum of a_e's eight lanes, as ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)).
   Pairwise sums of two vectors at a time (vhaddps' pattern), then the halves: 14 shuffles and adds
   for eight sums, where one at a time takes 32. */
static inline v8f sum_lanes8(v8f a0, v8f a1, v8f a2, v8f a3, v8f a4, v8f a5, v8f a6, v8f a7) {
#define PAIRS(x, y) (SHUFFLE(x, y, 0, 2, 8, 10, 4, 6, 12, 14) + SHUFFLE(x, y, 1, 3, 9, 11, 5, 7, 13, 15))
    v8f lo = PAIRS(PAIRS(a0, a1), PAIRS(a2, a3)), hi = PAIRS(PAIRS(a4, a5), PAIRS(a6, a7));
#undef PAIRS
    return SHUFFLE(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15);
}

static inline float sum_lanes(v8f a) { /* one vector's lanes, summed as sum_lanes8 sums each */
    float l[8];
    memcpy(l, &a, sizeof l);
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

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
            /* the key offsets first (int64, aligned), then the floats */                           \
            int64_t *at = malloc(sizeof(int64_t) * (size_t)count                                    \
                                 + sizeof(float) * (size_t)nq * (size_t)(2 * dim + count));         \
            if (at == NULL) {                                                                       \
                _Pragma("omp atomic write") failed = 1;                                             \
                continue;                                                                           \
            }                                                                                       \
            float *qf = (float *)(at + count), *acc = qf + nq * dim, *sc = acc + nq * dim;          \
            const int64_t *table = tables + i * table_stride;                                       \
            int64_t span = ((h1 - h0 - 1) * head_stride + dim) * (int64_t)sizeof(T);                \
            int64_t hoff[nq]; /* query head j reads KV head h0 + j / groups */                      \
            for (int j = 0; j < nq; j++) hoff[j] = (h0 + j / groups) * head_stride;                \
            /* where key first + c sits in a layer's K (V) of block 0: no division per key */      \
            for (int64_t c = 0, b = first / block_size, o = first % block_size; c < count; c++) {    \
                at[c] = table[b] * blk_stride + o * tok_stride;                                     \
                if (++o == block_size) o = 0, b++;                                                  \
            }                                                                                       \
            for (int j = 0; j < nq; j++) {                                                          \
                const T *qj = q + i * q_tok + (int64_t)(h0 * groups + j) * q_head;                  \
                for (int d = 0; d < dim; d++) qf[j * dim + d] = LOAD(qj[d]) * scale;                \
                for (int d = 0; d < dim; d++) acc[j * dim + d] = 0.0f;                              \
            }                                                                                       \
            /* scores, eight keys at a time: each key is read once for every query head that      \
               shares it, and eight dot products are summed across lanes together */              \
            for (int64_t c0 = 0; c0 < count; c0 += GROUP) {                                         \
                int m = count - c0 < GROUP ? (int)(count - c0) : GROUP;                             \
                for (int e = nq; e < m; e++) /* one key's prefetch per head below; here the rest */ \
                    if (c0 + e + AHEAD < count) prefetch_span(k + at[c0 + e + AHEAD] + h0 * head_stride, span); \
                for (int j = 0; j < nq; j++) {                                                      \
                    if (j < m && c0 + j + AHEAD < count) prefetch_span(k + at[c0 + j + AHEAD] + h0 * head_stride, span); \
                    const float *qj = qf + j * dim;                                                 \
                    float *s = sc + j * count + c0;                                                 \
                    if (m == GROUP) {                                                               \
                        const T *k0 = k + at[c0] + hoff[j], *k1 = k + at[c0 + 1] + hoff[j];         \
                        const T *k2 = k + at[c0 + 2] + hoff[j], *k3 = k + at[c0 + 3] + hoff[j];     \
                        const T *k4 = k + at[c0 + 4] + hoff[j], *k5 = k + at[c0 + 5] + hoff[j];     \
                        const T *k6 = k + at[c0 + 6] + hoff[j], *k7 = k + at[c0 + 7] + hoff[j];     \
                        v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0}; \
                        int d = 0;                                                                  \
                        for (; d + 8 <= dim; d += 8) {                                              \
                            v8f x = f32_load8(qj + d);                                              \
                            a0 += x * LOAD8(k0 + d), a1 += x * LOAD8(k1 + d);                       \
                            a2 += x * LOAD8(k2 + d), a3 += x * LOAD8(k3 + d);                       \
                            a4 += x * LOAD8(k4 + d), a5 += x * LOAD8(k5 + d);                       \
                            a6 += x * LOAD8(k6 + d), a7 += x * LOAD8(k7 + d);                       \
                        }                                                                           \
                        store8(s, sum_lanes8(a0, a1, a2, a3, a4, a5, a6, a7));                      \
                        for (; d < dim; d++) {                                                      \
                            s[0] += qj[d] * LOAD(k0[d]), s[1] += qj[d] * LOAD(k1[d]);               \
                            s[2] += qj[d] * LOAD(k2[d]), s[3] += qj[d] * LOAD(k3[d]);               \
                            s[4] += qj[d] * LOAD(k4[d]), s[5] += qj[d] * LOAD(k5[d]);               \
                            s[6] += qj[d] * LOAD(k6[d]), s[7] += qj[d] * LOAD(k7[d]);               \
                        }                                                                           \
                    } else {                                                                        \
                        for (int e = 0; e < m; e++) {                                               \
                            const T *ke = k + at[c0 + e] + hoff[j];                                 \
                            v8f a = {0};                                                            \
                            int d = 0;                                                              \
                            for (; d + 8 <= dim; d += 8) a += f32_load8(qj + d) * LOAD8(ke + d);    \
                            float x = sum_lanes(a);                                                 \
                            for (; d < dim; d++) x += qj[d] * LOAD(ke[d]);                          \
                            s[e] = x;                                                               \
                        }                                                                           \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
            float inv[nq];                                                                          \
            for (int j = 0; j < nq; j++) {                                                          \
                float *row = sc + j * count;                                                        \
                if (softcap > 0.0f)                                                                 \
                    for (int64_t c = 0; c < count; c++) row[c] = tanhf(row[c] / softcap) * softcap; \
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
            /* values, eight keys at a time: a head's sums are loaded and stored once per eight    \
               keys (64 of them held in registers), each key's update still its own, in key order */ \
            for (int64_t c0 = 0; c0 < count; c0 += GROUP) {                                         \
                int m = count - c0 < GROUP ? (int)(count - c0) : GROUP;                             \
                for (int e = nq; e < m; e++) /* one key's prefetch per head below; here the rest */ \
                    if (c0 + e + AHEAD < count) prefetch_span(v + at[c0 + e + AHEAD] + h0 * head_stride, span); \
                for (int j = 0; j < nq; j++) {                                                      \
                    if (j < m && c0 + j + AHEAD < count) prefetch_span(v + at[c0 + j + AHEAD] + h0 * head_stride, span); \
                    const float *w = sc + j * count + c0;                                           \
                    float *a = acc + j * dim;                                                       \
                    const T *vp[GROUP];                                                             \
                    for (int e = 0; e < m; e++) vp[e] = v + at[c0 + e] + hoff[j];                   \
                    int d = 0;                                                                      \
                    for (; d + 64 <= dim; d += 64) {                                                \
                        v8f x0 = f32_load8(a + d), x1 = f32_load8(a + d + 8);                       \
                        v8f x2 = f32_load8(a + d + 16), x3 = f32_load8(a + d + 24);                 \
                        v8f x4 = f32_load8(a + d + 32), x5 = f32_load8(a + d + 40);                 \
                        v8f x6 = f32_load8(a + d + 48), x7 = f32_load8(a + d + 56);                 \
                        for (int e = 0; e < m; e++) {                                               \
                            v8f we = splat(w + e);                                                  \
                            const T *ve = vp[e] + d;                                                \
                            x0 += we * LOAD8(ve), x1 += we * LOAD8(ve + 8);                         \
                            x2 += we * LOAD8(ve + 16), x3 += we * LOAD8(ve + 24);                   \
                            x4 += we * LOAD8(ve + 32), x5 += we * LOAD8(ve + 40);                   \
                            x6 += we * LOAD8(ve + 48), x7 += we * LOAD8(ve + 56);                   \
                        }                                                                           \
                        store8(a + d, x0), store8(a + d + 8, x1), store8(a + d + 16, x2);           \
                        store8(a + d + 24, x3), store8(a + d + 32, x4), store8(a + d + 40, x5);     \
                        store8(a + d + 48, x6), store8(a + d + 56, x7);                             \
                    }                                                                               \
                    for (; d + 8 <= dim; d += 8) {                                                  \
                        v8f x = f32_load8(a + d);                                                   \
                        for (int e = 0; e < m; e++) x += splat(w + e) * LOAD8(vp[e] + d);           \
                        store8(a + d, x);                                                           \
                    }                                                                               \
                    for (; d < dim; d++) {                                                          \
                        float x = a[d];                                                             \
                        for (int e = 0; e < m; e++) x += w[e] * LOAD(vp[e][d]);                     \
                        a[d] = x;                                                                   \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
            for (int j = 0; j < nq; j++) {                                                          \
                T *o = out + i * out_tok + (int64_t)(h0 * groups + j) * out_head;                   \
                for (int d = 0; d < dim; d++) o[d] = STORE(acc[j * dim + d] * inv[j]);              \
            }                                                                                       \
            free(at);                                                                               \
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
