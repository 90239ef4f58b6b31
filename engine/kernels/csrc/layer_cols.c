/* A bfloat16 decode step's whole decoder in one OpenMP region on AMX tiles, its GEMMs split by
columns (pd_decoder_forward's path for steps of decode rows only, up to 16 of them, on two or more
threads).

A decode step reads every weight once for its few rows, so its GEMMs split the weight's panels
between the threads (a split by rows would read each weight once a thread). The per-kernel path
(layer.c) forks a team and joins it in each of a layer's four GEMMs and its attention: the join
waits for the slowest thread, and on a host whose two cores are shared with the serving stack
that is often one the OS has descheduled. Here each layer is ten phases of one region:

    norm1 (+ the layer before's residual) | q|k|v | rotary, K/V write | attention | o's rows staged
    | o | x + o, norm2 | gate|up | SiLU.up | down                          (then the final norm)

Serial phases are one item; a GEMM's items are four panels (64 columns) each; attention's one
decode row each. Threads claim items from a phase's counter and a phase ends when its items are
done (layer_team.c's counters): a descheduled thread's share is taken by its partner, and a late
thread finds the phases it missed done.

Bits: every kernel runs as the per-kernel path runs it (the GEMM's columns are each one sum over k
in order, whatever split; attention's rows each their own; the small ops row-wise on the same
rows), so a step gives its outputs and pool bit for bit (tests/test_kernel_layer.py compares).

pd_layer_seconds: the calling thread's own work by kind, its waits at a phase's end to the phase's. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pdserve_kernels.h"
#include "amx.h"
#include "layer.h"

#define COLS_ROWS 16 /* the most rows this path takes: one row tile of amx_gemm.c's decode path */
#define JOB 4        /* panels (of 16 columns) a GEMM item */
#define PHASES 10    /* a layer's */

static int cols_on = 1;   /* pd_use_cols */
static int64_t cols_steps; /* pd_cols_steps */

int pd_use_cols(int enable) {
    int before = cols_on;
    if (enable >= 0) cols_on = enable != 0;
    return before;
}

int64_t pd_cols_steps(void) { return __atomic_load_n(&cols_steps, __ATOMIC_RELAXED); }

int layer_cols_takes(const pd_step *S) {
    return HAVE_AMX && cols_on && S->dtype == 1 && S->threads > 1 && S->n_chunks == 0 && S->decodes == S->tokens &&
           S->tokens >= 1 && S->tokens <= COLS_ROWS && amx_ready();
}

#if HAVE_AMX
#define CLOCK(kind) (t1 = layer_now(), pd_layer_seconds[kind] += mine ? t1 - t0 : 0, t0 = t1)
#define AT16(p, i) ((uint16_t *)(p) + (int64_t)(i))

typedef struct {
    const pd_layer *layers;
    const pd_step *S;
    const void *x, *norm;
    void *outs[2], *normed;
    float eps;
    int n;
    uint16_t *xs;          /* the next GEMM's rows, staged */
    layer_counter *phases; /* PHASES n + 1 */
    int failed;
} cols;

static const void *input(const cols *c, int l) { return l == 0 ? c->x : c->outs[(l - 1) % 2]; }

/* A GEMM phase's item count: jobs of JOB panels over n columns */
static int jobs(int n) { return (n + 16 * JOB - 1) / (16 * JOB); }

static int items(const cols *c, int l, int phase) {
    if (l == c->n) return 1;
    const pd_layer *L = c->layers + l;
    int qkv_n = (L->heads + 2 * L->kv_heads) * L->dim;
    switch (phase) {
    case 1: return jobs(qkv_n);
    case 3: return c->S->decodes;
    case 5: case 9: return jobs(L->hidden);
    case 7: return jobs(2 * L->inter);
    default: return 1;
    }
}

/* GEMM item j: panels [JOB j, JOB j + JOB) of out = xs @ W^T + bias */
static void gemm_item(const cols *c, const void *w, const void *bias, void *out, int n, int k, int j) {
    float sums[32 * 32];
    int64_t np = (n + 15) / 16, lo = (int64_t)JOB * j, hi = lo + JOB < np ? lo + JOB : np;
    amx_panels16(c->xs, w, bias, out, n, c->S->tokens, n, k, lo, hi, sums);
}

/* The serial phases of layer l (l == n: the last layer's residual and the final norm): 0, or -3 where
   pd_silu_mul cannot give torch's bits. */
static int serial_item(cols *c, int l, int phase, int mine) {
    const pd_step *S = c->S;
    const pd_layer *L = c->layers + (l < c->n ? l : l - 1);
    int T = S->tokens, hid = L->hidden, dim = L->dim, inter = L->inter;
    int q_width = L->heads * dim, kv_width = L->kv_heads * dim, qkv_n = q_width + 2 * kv_width;
    size_t es = sizeof(uint16_t);
    double t0 = layer_now(), t1;
    if (phase == 0) {
        if (l > 0) layer_add_rows(1, c->outs[(l - 1) % 2], S->tmp, c->outs[(l - 1) % 2], (int64_t)T * hid);
        if (l == c->n) {
            layer_rms_norm(1, input(c, l), c->norm, c->eps, c->normed, T, hid, 1);
        } else {
            layer_rms_norm(1, input(c, l), L->norm1, L->eps1, S->h, T, hid, 1);
            amx_stage16(S->h, hid, T, hid, c->xs);
        }
        CLOCK(LAYER_SMALL);
    } else if (phase == 2) {
        void *k = AT(S->kv, L->layer * S->layer_stride), *v = AT(k, S->layer_stride / 2);
        pd_rope_bf16(S->qkv, qkv_n, L->heads + L->kv_heads, dim, S->cos, S->sin, dim, T, 1);
        CLOCK(LAYER_SMALL);
        layer_kv_write(S->qkv, qkv_n, q_width, q_width + kv_width, kv_width, k, v, S->blk_stride, S->tok_stride,
                       S->slot_blocks, S->slot_offsets, T, es);
        CLOCK(LAYER_KV_WRITE);
    } else if (phase == 4) {
        amx_stage16(S->attn, q_width, T, q_width, c->xs);
        CLOCK(LAYER_SMALL);
    } else if (phase == 6) {
        pd_add_rms_norm_bf16(input(c, l), hid, S->tmp, hid, L->norm2, L->eps2, c->outs[l % 2], S->h, T, hid, 1);
        amx_stage16(S->h, hid, T, hid, c->xs);
        CLOCK(LAYER_SMALL);
    } else { /* 8 */
        if (pd_silu_mul_bf16(S->gu, 2 * inter, S->act, inter, T, inter, 1) != 0) return -3;
        amx_stage16(S->act, inter, T, inter, c->xs);
        CLOCK(LAYER_SMALL);
    }
    return 0;
}

/* Item i of layer l's phase: 0 or the failing kernel's code. */
static int item(cols *c, int l, int phase, int i, int mine) {
    const pd_step *S = c->S;
    const pd_layer *L = c->layers + l;
    int hid = L->hidden, dim = L->dim, q_width = L->heads * dim, qkv_n = q_width + 2 * L->kv_heads * dim;
    double t0 = layer_now(), t1;
    switch (l == c->n ? 0 : phase) {
    case 1: gemm_item(c, L->qkv, L->qkv_bias, S->qkv, qkv_n, hid, i); break;
    case 5: gemm_item(c, L->o, L->o_bias, S->tmp, hid, q_width, i); break;
    case 7: gemm_item(c, L->gate_up, L->gate_up_bias, S->gu, 2 * L->inter, hid, i); break;
    case 9: gemm_item(c, L->down, L->down_bias, S->tmp, hid, L->inter, i); break;
    case 3: {
        size_t es = sizeof(uint16_t);
        void *k = AT(S->kv, L->layer * S->layer_stride), *v = AT(k, S->layer_stride / 2);
        int rc = pd_paged_decode(1, AT16(S->qkv, (int64_t)i * qkv_n), qkv_n, dim, k, v, S->blk_stride, S->tok_stride,
                                 dim, S->tables + (int64_t)i * S->table_stride, S->table_stride, S->lens + i,
                                 AT16(S->attn, (int64_t)i * q_width), q_width, dim, 1, L->heads, L->kv_heads, dim,
                                 S->block_size, L->scale, L->window, L->softcap, 1);
        CLOCK(LAYER_DECODE);
        return rc;
    }
    default: return serial_item(c, l, phase, mine);
    }
    CLOCK(LAYER_GEMM);
    return 0;
}

/* One thread's part of the step: every phase in turn, claiming items until none is left. */
static void run(cols *c) {
    int mine = omp_get_thread_num() == 0;
    for (int p = 0; p < PHASES * c->n + 1; p++) {
        int l = p / PHASES, phase = p % PHASES, count = items(c, l, phase), gemm = l < c->n && phase % 2 == 1 && phase != 3;
        layer_counter *counter = c->phases + p;
        if (gemm) amx_configure(); /* attention's tiles release the configuration */
        for (int i; (i = __atomic_fetch_add(&counter->next, 1, __ATOMIC_RELAXED)) < count;) {
            if (__atomic_load_n(&c->failed, __ATOMIC_RELAXED) == 0) {
                int rc = item(c, l, phase, i, mine), none = 0;
                if (rc != 0) __atomic_compare_exchange_n(&c->failed, &none, rc, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
            }
            layer_finish_item(counter, count);
        }
        double t0 = layer_now(), t1;
        layer_wait_done(counter, count);
        CLOCK(phase == 3 ? LAYER_DECODE : gemm ? LAYER_GEMM : LAYER_SMALL);
    }
    _tile_release();
}

int layer_cols_forward(const pd_layer *layers, int n, const pd_step *S, const void *x, void *out0, void *out1,
                       const void *norm, float eps, void *normed) {
    int64_t widest = 0;
    for (int l = 0; l < n; l++) {
        const pd_layer *L = layers + l;
        int64_t ks[3] = {L->hidden, (int64_t)L->heads * L->dim, L->inter};
        for (int i = 0; i < 3; i++) widest = ks[i] > widest ? ks[i] : widest;
    }
    uint16_t *xs = aligned_alloc(64, sizeof(uint16_t) * (size_t)(COLS_ROWS * ((widest + 31) / 32 * 32)));
    layer_counter *phases = aligned_alloc(64, sizeof(layer_counter) * (size_t)(PHASES * n + 1));
    if (xs == NULL || phases == NULL) {
        free(xs), free(phases);
        return -2;
    }
    memset(phases, 0, sizeof(layer_counter) * (size_t)(PHASES * n + 1));
    cols c = {.layers = layers, .S = S, .x = x, .norm = norm, .outs = {out0, out1}, .normed = normed, .eps = eps,
              .n = n, .xs = xs, .phases = phases};
    _Pragma("omp parallel num_threads(S->threads)") run(&c);
    __atomic_fetch_add(&cols_steps, 1, __ATOMIC_RELAXED);
    free(xs), free(phases);
    return c.failed;
}
#else
int layer_cols_forward(const pd_layer *layers, int n, const pd_step *S, const void *x, void *out0, void *out1,
                       const void *norm, float eps, void *normed) { /* never called: layer_cols_takes is 0 */
    (void)layers, (void)n, (void)S, (void)x, (void)out0, (void)out1, (void)norm, (void)eps, (void)normed;
    return -1;
}
#endif
