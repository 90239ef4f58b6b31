/* A whole Llama-shaped decoder layer in one call, on the CPU, float32 or bfloat16
(engine/forward/kernel_layer.py).

The layer an eager step runs as about twenty Python-level calls (modules, torch ops, and one
ctypes call per kernel) runs here as the same kernels called in the same order on the same
buffers, so its output is the module path's bit for bit (engine/forward/kernel_layer.py checks that at load,
layer by layer):

    h = rms_norm(x, norm1)                  pd_rms_norm[_bf16]
    qkv = h @ [Wq; Wk; Wv]^T (+ bias)       pd_f32_gemm (float32), pd_bf16_gemm (bfloat16)
    rotary on qkv's q and k heads           pd_rope[_bf16]
    k, v -> their slots in the pool         kv_write
    a = attention(q, the pool)              pd_paged_decode (decode rows), pd_paged_prefill (chunks)
    y = x + a @ Wo^T (+ bias)               the GEMM, then
    h = rms_norm(y, norm2)                  the sum and the norm in one pass, pd_add_rms_norm[_bf16]
    g = silu(h @ Wgate^T) * (h @ Wup^T)     the GEMM on the stacked gate|up, pd_silu_mul[_bf16]
    y = y + g @ Wdown^T                     the GEMM, then the sum

In bfloat16 every tensor between the kernels is bfloat16, rounded where torch's bfloat16 ops round
(each kernel's own comment says how). Each kernel forks its own OpenMP team as it does when Python
calls it. The token rows of the step are laid out as the runner lays them out: decode rows first,
then each prefill chunk's queries.

`pd_layer_seconds` adds up the wall time of each kind of work across calls (a profiler sees one
opaque call; microbench/profile_step.py reads these): LAYER_SMALL the norms, rotary, activation and
residual sums, LAYER_GEMM the four products, LAYER_KV_WRITE the new tokens' K/V into their
slots, LAYER_DECODE the decode rows' attention, LAYER_PREFILL the prefill chunks'. A clock read
per kernel, about 10 us a step. */
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "pdserve_kernels.h"
#include "layer.h"
#include "vec.h"

_Static_assert(LAYER_KINDS == PD_LAYER_KINDS, "pdserve_kernels.h counts the kinds of work");
double pd_layer_seconds[PD_LAYER_KINDS];

/* the structs' sizes, checked by the bindings against their ctypes mirrors (abi.py) */
int64_t pd_layer_size(void) { return (int64_t)sizeof(pd_layer); }
int64_t pd_step_size(void) { return (int64_t)sizeof(pd_step); }

double layer_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* the time since the last mark, to `kind` */
#define MARK(kind) (t1 = layer_now(), pd_layer_seconds[kind] += t1 - t0, t0 = t1)


/* Each of `tokens` rows' K and V (`width` values each, at k_at and v_at of its qkv row) into its
   slot of one layer's pool. */
void layer_kv_write(const void *qkv, int64_t qkv_stride, int64_t k_at, int64_t v_at, int64_t width, void *k, void *v,
                     int64_t blk_stride, int64_t tok_stride, const int64_t *blocks, const int64_t *offsets,
                     int tokens, size_t es) {
    for (int t = 0; t < tokens; t++) {
        int64_t slot = blocks[t] * blk_stride + offsets[t] * tok_stride;
        memcpy(AT(k, slot), AT(qkv, t * qkv_stride + k_at), es * (size_t)width);
        memcpy(AT(v, slot), AT(qkv, t * qkv_stride + v_at), es * (size_t)width);
    }
}

/* out = a + b over n values, as torch adds them (bfloat16: the float32 sum rounded to nearest even) */
void layer_add_rows(int dtype, const void *a, const void *b, void *out, int64_t n) {
    if (dtype == 0) {
        const float *x = a, *y = b;
        float *o = out;
        for (int64_t i = 0; i < n; i++) o[i] = x[i] + y[i];
    } else {
        const uint16_t *x = a, *y = b;
        uint16_t *o = out;
        for (int64_t i = 0; i < n; i++) o[i] = bf16_store(bf16_load(x[i]) + bf16_load(y[i]));
    }
}

/* y [m, n] = x [m, k] @ the panels' weight^T (+ bias): 0, or the bfloat16 GEMM's failure */
int layer_gemm(int dtype, const void *x, int64_t ldx, const void *panels, const void *bias, void *y, int64_t ldy,
                int m, int n, int k, int threads) {
    if (dtype == 0) {
        pd_f32_gemm(x, ldx, panels, bias, y, ldy, m, n, k, threads);
        return 0;
    }
    return pd_bf16_gemm(x, ldx, panels, bias, y, ldy, m, n, k, threads);
}

void layer_rms_norm(int dtype, const void *x, const void *w, float eps, void *out, int rows, int n, int threads) {
    if (dtype == 0)
        pd_rms_norm(x, n, w, eps, out, n, rows, n, threads);
    else
        pd_rms_norm_bf16(x, n, w, eps, out, n, rows, n, threads);
}

/* x [tokens, hidden] in, out [tokens, hidden] written (out may be x). Returns 0, or the failing
   kernel's code: -2 out of memory in attention or the GEMM, -3 pd_silu_mul cannot give torch's bits
   here, -1 the bfloat16 GEMM cannot run (neither AMX, AVX512-BF16 nor AVX2). */
int pd_layer_forward(const pd_layer *L, const pd_step *S, const void *x, void *out) {
    int T = S->tokens, th = S->threads, hid = L->hidden, dim = L->dim, dt = S->dtype, rc;
    size_t es = dt == 0 ? sizeof(float) : sizeof(uint16_t);
    int q_width = L->heads * dim, kv_width = L->kv_heads * dim, qkv_n = q_width + 2 * kv_width;
    void *k = AT(S->kv, L->layer * S->layer_stride), *v = AT(k, S->layer_stride / 2);

    double t0 = layer_now(), t1;
    layer_rms_norm(dt, x, L->norm1, L->eps1, S->h, T, hid, th);
    MARK(LAYER_SMALL);
    if ((rc = layer_gemm(dt, S->h, hid, L->qkv, L->qkv_bias, S->qkv, qkv_n, T, qkv_n, hid, th)) != 0) return rc;
    MARK(LAYER_GEMM);
    if (dt == 0)
        pd_rope(S->qkv, qkv_n, L->heads + L->kv_heads, dim, S->cos, S->sin, dim, T, th);
    else
        pd_rope_bf16(S->qkv, qkv_n, L->heads + L->kv_heads, dim, S->cos, S->sin, dim, T, th);
    MARK(LAYER_SMALL);
    layer_kv_write(S->qkv, qkv_n, q_width, q_width + kv_width, kv_width, k, v, S->blk_stride, S->tok_stride,
             S->slot_blocks, S->slot_offsets, T, es);
    MARK(LAYER_KV_WRITE);
    if (S->decodes > 0) {
        rc = pd_paged_decode(dt, S->qkv, qkv_n, dim, k, v, S->blk_stride, S->tok_stride, dim, S->tables,
                             S->table_stride, S->lens, S->attn, q_width, dim, S->decodes, L->heads,
                             L->kv_heads, dim, S->block_size, L->scale, L->window, L->softcap, th);
        if (rc != 0) return rc;
    }
    MARK(LAYER_DECODE);
    for (int c = 0; c < S->n_chunks; c++) {
        const int64_t *chunk = S->chunks + 4 * c;
        int64_t start = chunk[0];
        rc = pd_paged_prefill(dt, AT(S->qkv, start * qkv_n), qkv_n, dim, k, v, S->blk_stride, S->tok_stride, dim,
                              (const int64_t *)(intptr_t)chunk[3], chunk[2], (int)(chunk[1] - start),
                              AT(S->attn, start * q_width), q_width, dim, L->heads, L->kv_heads, dim,
                              S->block_size, L->scale, L->window, L->softcap, th);
        if (rc != 0) return rc;
    }
    MARK(LAYER_PREFILL);
    if ((rc = layer_gemm(dt, S->attn, q_width, L->o, L->o_bias, S->tmp, hid, T, hid, q_width, th)) != 0) return rc;
    MARK(LAYER_GEMM);
    if (dt == 0)
        pd_add_rms_norm(x, hid, S->tmp, hid, L->norm2, L->eps2, out, S->h, T, hid, th);
    else
        pd_add_rms_norm_bf16(x, hid, S->tmp, hid, L->norm2, L->eps2, out, S->h, T, hid, th);
    MARK(LAYER_SMALL);
    if ((rc = layer_gemm(dt, S->h, hid, L->gate_up, L->gate_up_bias, S->gu, 2 * L->inter, T, 2 * L->inter, hid, th)) != 0)
        return rc;
    MARK(LAYER_GEMM);
    rc = dt == 0 ? pd_silu_mul(S->gu, 2 * L->inter, S->act, L->inter, T, L->inter, th)
                 : pd_silu_mul_bf16(S->gu, 2 * L->inter, S->act, L->inter, T, L->inter, th);
    if (rc != 0) return -3;
    MARK(LAYER_SMALL);
    if ((rc = layer_gemm(dt, S->act, L->inter, L->down, L->down_bias, S->tmp, hid, T, hid, L->inter, th)) != 0) return rc;
    MARK(LAYER_GEMM);
    layer_add_rows(dt, out, S->tmp, out, (int64_t)T * hid);
    MARK(LAYER_SMALL);
    return 0;
}

/* A step's whole decoder after the embedding (engine/forward/kernel_layer.py's KernelDecoder): each layer in
   turn, layer i writing outs[i % 2] from the one before (x for the first), then the final RMSNorm of
   the last output into `normed`, all as the Python loop calls them (the same kernels, the same bits)
   without a ctypes call and a torch allocation per layer. Returns 0, or the first failing layer's
   code (its outputs and the later layers' are not written). */
int pd_decoder_forward(const pd_layer *layers, int n, const pd_step *S, const void *x, void *out0, void *out1,
                       const void *norm, float eps, void *normed) {
    if (n > 0 && layer_team_takes(S)) return layer_team_forward(layers, n, S, x, out0, out1, norm, eps, normed);
    if (n > 0 && layer_cols_takes(S)) return layer_cols_forward(layers, n, S, x, out0, out1, norm, eps, normed);
    const void *in = x;
    for (int i = 0; i < n; i++) {
        void *out = i % 2 ? out1 : out0;
        int rc = pd_layer_forward(layers + i, S, in, out);
        if (rc != 0) return rc;
        in = out;
    }
    int hid = n > 0 ? layers[0].hidden : 0;
    double t0 = layer_now(), t1;
    layer_rms_norm(S->dtype, in, norm, eps, normed, S->tokens, hid, S->threads);
    MARK(LAYER_SMALL);
    return 0;
}
