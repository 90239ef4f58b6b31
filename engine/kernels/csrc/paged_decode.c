/* Decode attention straight from the paged KV pool, on the CPU (engine/kernels/cpu_kernel.py builds it).

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
Float32 throughout; a bfloat16 pool's keys and values are widened once per group (widen_group).
Every pass runs on 8-lane vectors (GCC/Clang vector extensions, so it builds for any target); a
head dimension that is no multiple of 8 finishes in scalars. With AVX-512, a bfloat16 pool whose
head dimension is a multiple of 32 takes faster paths for its scores: on AMX tiles (decode_amx.c,
where blocks hold a multiple of 16 keys and the tiles are on), else by vdpbf16ps straight from the
pool (AVX512_BF16, decode.h); either way each dot product is summed in its own order, not the
float32 kernel's. Its values are widened in registers (decode.h: the same bits as widening first).
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

#include "amx.h"
#include "decode.h"

/* How far ahead keys are prefetched (blocks are scattered, and a hardware prefetcher stops at a
   page): AHEAD_BYTES / the element's size keys, the same distance in bytes for either pool, 8 float32
   keys or 16 bfloat16 ones. SmolLM2's shape, 16 rows of 257 keys, 30 layers, 2 threads
   (2026-12-03, Xeon host): bfloat16 7.6 ms at 8 keys ahead, 6.8 at 16, 6.9 at 32; float32 10.0 at
   8, 11.1 at 16. Into L2 (prefetcht1), not L1 (2026-12-04, C harness, the same shape): bfloat16
   6.6 -> 6.5 ms, float32 10.3 -> 9.8 ms; farther ahead into L2 is no better (32 bfloat16 keys 6.2
   -> 6.2, 64 keys 6.5). A bfloat16 group's prefetches spread over its work (a KV head's share of the
   keys at a time; each value where its sums take a key in) rather than all at its start: 6.1-6.5 ->
   5.5-5.6 ms; then 8, 24 and 32 keys ahead are no better than 16 (5.95, 5.80, 5.68 against 5.66). */
#define AHEAD_BYTES 32

/* A bfloat16 pool's keys (values) for one group, heads h0 .. h1 - 1 of each, widened to float32 once
   (exactly: their bits shifted up) into `wide`, [m][span_n]: every query head sharing a KV head then
   reads floats, where widening on each head's load widened each key `groups` times (three for
   SmolLM2's nine query and three KV heads: 8.0 ms a step at 16 rows against 10.2 in float32, whose
   pool is twice the bytes). */
static inline void widen_group(const uint16_t *src, const int64_t *at, int m, int64_t head0, int64_t span_n,
                               float *wide) {
    for (int e = 0; e < m; e++) {
        const uint16_t *from = src + at[e] + head0;
        float *to = wide + e * span_n;
        int64_t d = 0;
        for (; d + 8 <= span_n; d += 8) store8(to + d, bf16_load8(from + d));
        for (; d < span_n; d++) to[d] = bf16_load(from[d]);
    }
}

/* A KV head's query heads, three at a time (then two, or one): F(nh, first head) with nh a constant. */
#define BY_THREES(count, F)                                                                         \
    for (int by = 0; by < (count);) {                                                               \
        int left = (count) - by;                                                                    \
        if (left >= 3) { F(3, by); by += 3; }                                                       \
        else if (left == 2) { F(2, by); by += 2; }                                                  \
        else { F(1, by); by += 1; }                                                                 \
    }

/* Key (value) e of the group, as query head j reads it: widened (`staged`) or in place in a float32 pool. */
#define ROW(src, e)                                                                                 \
    (staged ? (const float *)(wide + (e) * span_n + hoff[j] - h0 * head_stride)                     \
            : (const float *)(src + at[c0 + (e)] + hoff[j]))

/* Prefetch the keys (values) `ahead` positions past group members from .. to - 1 of src. */
#define PREFETCH_AHEAD(src, from, to)                                                               \
    for (int e = (from); e < (to); e++)                                                             \
        if (c0 + e + ahead < count) prefetch_span(src + at[c0 + e + ahead] + h0 * head_stride, span)

/* the dotted scores and the widened value sums of query heads kh * groups + by .. + nh - 1 */
#define SCORES(nh, by)                                                                              \
    scores_dot(nh, (const uint16_t *)(const void *)q + i * q_tok + ((h0 + kh) * groups + (by)) * q_head, q_head, \
               dim, kp, m, scale, sc + (kh * groups + (by)) * count + c0, count)
#define VALUES(nh, by, nz)                                                                          \
    values_bf16(nh, nz, acc + (kh * groups + (by)) * dim, dim, d0, held, m, sc + (kh * groups + (by)) * count + c0, count, \
                (by) == 0 && d0 == 0 ? pf : NULL)
#define VALUES64(nh, by) VALUES(nh, by, 2)
#define VALUES32(nh, by) VALUES(nh, by, 1)

#define DEFINE_DECODE(NAME, T, LOAD, STORE, STAGED)                                                 \
    static int NAME(const T *q, int64_t q_tok, int64_t q_head, const T *k, const T *v,              \
                     int64_t blk_stride, int64_t tok_stride, int64_t head_stride,                   \
                     const int64_t *tables, int64_t table_stride, const int64_t *lens, T *out,      \
                     int64_t out_tok, int64_t out_head, int n, int heads, int kv_heads, int dim,    \
                     int block_size, float scale, int window, float softcap, int threads) {         \
        int groups = heads / kv_heads, staged = STAGED, ahead = AHEAD_BYTES / (int)sizeof(T);       \
        int dotted = STAGED && DOT_BF16 && dim % 32 == 0; /* scores_dot: q read in place */          \
        int tiled = STAGED && dim % 32 == 0 && block_size % 16 == 0 && groups <= 16 && amx_ready(); \
        int64_t tile_floats = tiled ? 256 * (int64_t)(kv_heads * dim / 32 + 1) : 0; /* qb and cbuf */ \
        int widened_values = STAGED && LANES16 && dim % 32 == 0; /* values_bf16 */                  \
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
            int64_t span_n = (h1 - h0 - 1) * head_stride + dim, span = span_n * (int64_t)sizeof(T); \
            /* the key offsets first (int64, aligned), then the floats: q, sums, scores, and a      \
               group's keys (values) widened where the pool is not float32 */                       \
            int64_t *at = malloc(sizeof(int64_t) * (size_t)count                                    \
                                 + sizeof(float) * ((size_t)nq * (size_t)(2 * dim + count)          \
                                                    + (STAGED ? (size_t)(GROUP * span_n) : 0)       \
                                                    + (size_t)tile_floats));                        \
            if (at == NULL) {                                                                       \
                _Pragma("omp atomic write") failed = 1;                                             \
                continue;                                                                           \
            }                                                                                       \
            float *qf = (float *)(at + count), *acc = qf + nq * dim, *sc = acc + nq * dim;          \
            float *wide = sc + (int64_t)nq * count; /* staged: GROUP keys' heads h0 .. h1 - 1 */    \
            const int64_t *table = tables + i * table_stride;                                       \
            int64_t hoff[nq]; /* query head j reads KV head h0 + j / groups */                      \
            for (int j = 0; j < nq; j++) hoff[j] = (h0 + j / groups) * head_stride;                \
            /* where key first + c sits in a layer's K (V) of block 0: no division per key */      \
            for (int64_t c = 0, b = first / block_size, o = first % block_size; c < count; c++) {    \
                at[c] = table[b] * blk_stride + o * tok_stride;                                     \
                if (++o == block_size) o = 0, b++;                                                  \
            }                                                                                       \
            for (int j = 0; j < nq; j++) {                                                          \
                const T *qj = q + i * q_tok + (int64_t)(h0 * groups + j) * q_head;                  \
                for (int d = 0; !dotted && !tiled && d < dim; d++) qf[j * dim + d] = LOAD(qj[d]) * scale; \
                for (int d = 0; d < dim; d++) acc[j * dim + d] = 0.0f;                              \
            }                                                                                       \
            if (tiled) { /* scores on tiles (decode_amx.c); scratch after the widened group's */  \
                float *cbuf = wide + (STAGED ? GROUP * span_n : 0);                                 \
                decode_amx_scores((const uint16_t *)(const void *)q + i * q_tok + (int64_t)h0 * groups * q_head, \
                                  q_head, (const uint16_t *)(const void *)k + h0 * head_stride, blk_stride, \
                                  tok_stride, head_stride, table, block_size, first, len, h1 - h0, groups, dim, \
                                  scale, sc, span, (uint32_t *)(void *)(cbuf + 256), cbuf);         \
            }                                                                                       \
            /* scores, eight keys at a time: each key is read once for every query head that      \
               shares it, and eight dot products are summed across lanes together */              \
            for (int64_t c0 = 0; !tiled && c0 < count; c0 += GROUP) {                               \
                int m = count - c0 < GROUP ? (int)(count - c0) : GROUP;                             \
                if (dotted) { /* a short group's missing keys: key c0 again, its scores not stored */ \
                    const uint16_t *kp[GROUP];                                                      \
                    for (int kh = 0; kh < h1 - h0; kh++) {                                          \
                        PREFETCH_AHEAD(k, GROUP * kh / (h1 - h0), GROUP * (kh + 1) / (h1 - h0)); /* a share */ \
                        for (int e = 0; e < GROUP; e++)                                             \
                            kp[e] = (const uint16_t *)(const void *)k + at[c0 + (e < m ? e : 0)] + (h0 + kh) * head_stride; \
                        BY_THREES(groups, SCORES)                                                   \
                    }                                                                               \
                    continue;                                                                       \
                }                                                                                   \
                PREFETCH_AHEAD(k, nq, m); /* one key's prefetch per head below; here the rest */       \
                if (staged) widen_group((const uint16_t *)(const void *)k, at + c0, m, h0 * head_stride, span_n, wide);            \
                for (int j = 0; j < nq; j++) {                                                      \
                    if (j < m && c0 + j + ahead < count) prefetch_span(k + at[c0 + j + ahead] + h0 * head_stride, span); \
                    const float *qj = qf + j * dim;                                                 \
                    float *s = sc + j * count + c0;                                                 \
                    if (m == GROUP) {                                                               \
                        const float *k0 = ROW(k, 0), *k1 = ROW(k, 1), *k2 = ROW(k, 2), *k3 = ROW(k, 3); \
                        const float *k4 = ROW(k, 4), *k5 = ROW(k, 5), *k6 = ROW(k, 6), *k7 = ROW(k, 7); \
                        v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0}; \
                        int d = 0;                                                                  \
                        for (; d + 8 <= dim; d += 8) {                                              \
                            v8f x = f32_load8(qj + d);                                              \
                            a0 += x * f32_load8(k0 + d), a1 += x * f32_load8(k1 + d);               \
                            a2 += x * f32_load8(k2 + d), a3 += x * f32_load8(k3 + d);               \
                            a4 += x * f32_load8(k4 + d), a5 += x * f32_load8(k5 + d);               \
                            a6 += x * f32_load8(k6 + d), a7 += x * f32_load8(k7 + d);               \
                        }                                                                           \
                        store8(s, sum_lanes8(a0, a1, a2, a3, a4, a5, a6, a7));                      \
                        for (; d < dim; d++) {                                                      \
                            s[0] += qj[d] * k0[d], s[1] += qj[d] * k1[d];                           \
                            s[2] += qj[d] * k2[d], s[3] += qj[d] * k3[d];                           \
                            s[4] += qj[d] * k4[d], s[5] += qj[d] * k5[d];                           \
                            s[6] += qj[d] * k6[d], s[7] += qj[d] * k7[d];                           \
                        }                                                                           \
                    } else {                                                                        \
                        for (int e = 0; e < m; e++) {                                               \
                            const float *ke = ROW(k, e);                                            \
                            v8f a = {0};                                                            \
                            int d = 0;                                                              \
                            for (; d + 8 <= dim; d += 8) a += f32_load8(qj + d) * f32_load8(ke + d); \
                            float x = sum_lanes(a);                                                 \
                            for (; d < dim; d++) x += qj[d] * ke[d];                                \
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
                if (widened_values) { /* each KV head's values `ahead`, a key a turn (values_bf16) */ \
                    const uint16_t *held[GROUP], *pf[GROUP];                                        \
                    for (int kh = 0; kh < h1 - h0; kh++) {                                          \
                        for (int e = 0; e < GROUP; e++)                                             \
                            pf[e] = c0 + e + ahead < count ? (const uint16_t *)(const void *)v + at[c0 + e + ahead] + (h0 + kh) * head_stride : NULL; \
                        for (int e = 0; e < m; e++)                                                 \
                            held[e] = (const uint16_t *)(const void *)v + at[c0 + e] + (h0 + kh) * head_stride; \
                        for (int d0 = 0, pieces; d0 < dim; d0 += 32 * pieces) {                     \
                            pieces = dim - d0 >= 64 ? 2 : 1;                                        \
                            if (pieces == 2) BY_THREES(groups, VALUES64)                            \
                            else BY_THREES(groups, VALUES32)                                        \
                        }                                                                           \
                    }                                                                               \
                    continue;                                                                       \
                }                                                                                   \
                PREFETCH_AHEAD(v, nq, m); /* one value's prefetch per head below; here the rest */     \
                if (staged) widen_group((const uint16_t *)(const void *)v, at + c0, m, h0 * head_stride, span_n, wide);            \
                for (int j = 0; j < nq; j++) {                                                      \
                    if (j < m && c0 + j + ahead < count) prefetch_span(v + at[c0 + j + ahead] + h0 * head_stride, span); \
                    const float *w = sc + j * count + c0;                                           \
                    float *a = acc + j * dim;                                                       \
                    const float *vp[GROUP];                                                         \
                    for (int e = 0; e < m; e++) vp[e] = ROW(v, e);                                  \
                    int d = 0;                                                                      \
                    for (; d + 64 <= dim; d += 64) {                                                \
                        v8f x0 = f32_load8(a + d), x1 = f32_load8(a + d + 8);                       \
                        v8f x2 = f32_load8(a + d + 16), x3 = f32_load8(a + d + 24);                 \
                        v8f x4 = f32_load8(a + d + 32), x5 = f32_load8(a + d + 40);                 \
                        v8f x6 = f32_load8(a + d + 48), x7 = f32_load8(a + d + 56);                 \
                        for (int e = 0; e < m; e++) {                                               \
                            v8f we = splat(w + e);                                                  \
                            const float *ve = vp[e] + d;                                            \
                            x0 += we * f32_load8(ve), x1 += we * f32_load8(ve + 8);                 \
                            x2 += we * f32_load8(ve + 16), x3 += we * f32_load8(ve + 24);           \
                            x4 += we * f32_load8(ve + 32), x5 += we * f32_load8(ve + 40);           \
                            x6 += we * f32_load8(ve + 48), x7 += we * f32_load8(ve + 56);           \
                        }                                                                           \
                        store8(a + d, x0), store8(a + d + 8, x1), store8(a + d + 16, x2);           \
                        store8(a + d + 24, x3), store8(a + d + 32, x4), store8(a + d + 40, x5);     \
                        store8(a + d + 48, x6), store8(a + d + 56, x7);                             \
                    }                                                                               \
                    for (; d + 8 <= dim; d += 8) {                                                  \
                        v8f x = f32_load8(a + d);                                                   \
                        for (int e = 0; e < m; e++) x += splat(w + e) * f32_load8(vp[e] + d);       \
                        store8(a + d, x);                                                           \
                    }                                                                               \
                    for (; d < dim; d++) {                                                          \
                        float x = a[d];                                                             \
                        for (int e = 0; e < m; e++) x += w[e] * vp[e][d];                           \
                        a[d] = x;                                                                   \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
            for (int j = 0; j < nq; j++) {                                                          \
                T *o = out + i * out_tok + (int64_t)(h0 * groups + j) * out_head;                   \
                for (int d = 0; d < dim; d++) /* widened_values: [even | odd] per 32 dimensions */  \
                    o[d] = STORE(acc[j * dim + (widened_values ? d / 32 * 32 + d % 2 * 16 + d % 32 / 2 : d)] * inv[j]); \
            }                                                                                       \
            free(at);                                                                               \
        }                                                                                           \
        return failed ? -2 : 0; /* -2: out of memory for a task's scores */                         \
    }

#define F32_LOAD(x) (x)
#define F32_STORE(x) (x)
DEFINE_DECODE(decode_f32, float, F32_LOAD, F32_STORE, 0)
DEFINE_DECODE(decode_bf16, uint16_t, bf16_load, bf16_store, 1)

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
