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

#include "pdserve_kernels.h"
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

/* The same, four at a time (then three, two or one): the widened values' sums (values_bf16). */
#define BY_FOURS(count, F)                                                                          \
    for (int by = 0; by < (count);) {                                                               \
        int left = (count) - by;                                                                    \
        if (left >= 4) { F(4, by); by += 4; }                                                       \
        else if (left == 3) { F(3, by); by += 3; }                                                  \
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

/* decode_f32 and decode_bf16: decode_rows.h once per dtype */
#define DECODE_NAME decode_f32
#define T float
#define LOAD(x) (x)
#define STORE(x) (x)
#define STAGED 0
#include "decode_rows.h"

#define DECODE_NAME decode_bf16
#define T uint16_t
#define LOAD(x) bf16_load(x)
#define STORE(x) bf16_store(x)
#define STAGED 1
#include "decode_rows.h"

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
