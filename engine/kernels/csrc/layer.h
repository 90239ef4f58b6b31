/* What layer.c (a layer as one call, the per-kernel path) and layer_team.c (a prompt-sized step's
   whole decoder in one OpenMP region) share: the kinds of work pd_layer_seconds counts, the
   layer's helpers (hidden: -fvisibility=hidden keeps them out of the library's exports). */
#ifndef PDSERVE_LAYER_H
#define PDSERVE_LAYER_H

#include <stddef.h>
#include <stdint.h>

#include "pdserve_kernels.h"

enum { LAYER_SMALL, LAYER_GEMM, LAYER_KV_WRITE, LAYER_DECODE, LAYER_PREFILL, LAYER_KINDS };

/* value i of a buffer of the step's dtype (`es` bytes a value, in scope) */
#define AT(p, i) ((char *)(p) + (int64_t)(i) * (int64_t)es)

double layer_now(void); /* CLOCK_MONOTONIC, in seconds */
/* tokens rows' K and V (width values each, at k_at and v_at of their qkv row) into their slots */
void layer_kv_write(const void *qkv, int64_t qkv_stride, int64_t k_at, int64_t v_at, int64_t width, void *k, void *v,
                    int64_t blk_stride, int64_t tok_stride, const int64_t *blocks, const int64_t *offsets,
                    int tokens, size_t es);
/* out = a + b over n values, as torch adds them */
void layer_add_rows(int dtype, const void *a, const void *b, void *out, int64_t n);
/* y [m, n] = x [m, k] @ the panels' weight^T (+ bias): 0, or the bfloat16 GEMM's failure */
int layer_gemm(int dtype, const void *x, int64_t ldx, const void *panels, const void *bias, void *y, int64_t ldy,
               int m, int n, int k, int threads);
void layer_rms_norm(int dtype, const void *x, const void *w, float eps, void *out, int rows, int n, int threads);

/* A phase of a step run as one OpenMP region (layer_team.c, layer_cols.c): threads claim its items
   from `next`; the phase is over when `done` reaches its item count. */
typedef struct {
    _Alignas(64) int next, done, sleepers; /* items claimed, items finished, threads asleep on done */
} layer_counter;
void layer_wait_done(layer_counter *c, int items);  /* spin a while, then sleep until the items are done */
void layer_finish_item(layer_counter *c, int items); /* one item done: the last wakes the sleepers */

/* Whether pd_decoder_forward runs this step on layer_team.c's one region, and that run (its
   arguments and return as pd_decoder_forward's). */
int layer_team_takes(const pd_step *S);
int layer_team_forward(const pd_layer *layers, int n, const pd_step *S, const void *x, void *out0, void *out1,
                       const void *norm, float eps, void *normed);
/* The same for a decode step's few rows on AMX tiles, its GEMMs split by columns (layer_cols.c). */
int layer_cols_takes(const pd_step *S);
int layer_cols_forward(const pd_layer *layers, int n, const pd_step *S, const void *x, void *out0, void *out1,
                       const void *norm, float eps, void *normed);

#endif
