/* AMX tiles for the attention kernels (prefill_amx.c, decode_amx.c) and the few-row GEMM (amx_gemm.c),
   where the CPU has them (AMX-TILE and AMX-BF16, built with -march=native) and Linux lets the
   process use them.
   bfloat16 products on tiles are exact in float32 and summed in float32, in an order fixed by the
   output element alone, so a row's result never depends on which tile it shared. */
#ifndef PDSERVE_AMX_H
#define PDSERVE_AMX_H

#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1

/* Whether this process may use the tile registers: Linux asks each process to request them once
   (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA); where it refuses, the kernels keep their vectors.
   Called before a parallel region (the answer is cached). */
static inline int amx_permitted(void) {
    static int state; /* 0 unknown, 1 yes, -1 no */
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0 ? 1 : -1;
    return state == 1;
}

/* This thread's eight tiles, each 16 rows of 64 bytes (16 floats, 32 bfloat16 or 16 bfloat16 pairs a row). */
static inline void amx_configure(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((packed)) cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
}
#else
#define HAVE_AMX 0
static inline int amx_permitted(void) { return 0; }
#endif

extern int pd_amx_enabled; /* pd_use_amx (prefill_amx.c) */
/* pd_amx_prefetch (amx_gemm.c): how many k-steps ahead the streamed weights' tiles are prefetched, where
   a call's few rows leave it bound by the weights' stream (decode steps' GEMMs, the int8 head's first pass) */
extern int amx_prefetch_steps;

#if HAVE_AMX
/* Streaming panels of weights (a panel: `steps` k-steps of one 1 KiB tile each, panels `panel_bytes`
   apart; a call takes panels [p_lo, p_hi) `group` at a time, every k-step of a group in turn). */
typedef struct {
    const char *panels;
    int64_t panel_bytes, steps, p_hi, ahead; /* ahead: amx_prefetch_steps, at most `steps` */
    int group;
} amx_stream;

/* Into L1: k-step c's tiles of panels p .. p + group - 1 below p_hi. */
static inline __attribute__((always_inline)) void amx_prefetch_step(const amx_stream *s, int64_t p, int64_t c) {
    for (int64_t q = p; q < p + s->group && q < s->p_hi; q++)
        for (int l = 0; l < 16; l++) _mm_prefetch(s->panels + q * s->panel_bytes + c * 1024 + 64 * l, _MM_HINT_T0);
}

/* The stream from panel p_lo on: its first `ahead` k-steps prefetched now (call at the start). */
static inline amx_stream amx_stream_start(const void *panels, int64_t panel_bytes, int64_t steps, int group,
                                          int64_t p_lo, int64_t p_hi) {
    amx_stream s = {(const char *)panels, panel_bytes, steps, p_hi,
                    amx_prefetch_steps < steps ? amx_prefetch_steps : steps, group};
    for (int64_t c = 0; c < s.ahead; c++) amx_prefetch_step(&s, p_lo, c);
    return s;
}

/* As group p0 runs k-step c: the tiles `ahead` k-steps on, past its last step the next group's first. */
static inline __attribute__((always_inline)) void amx_prefetch_ahead(const amx_stream *s, int64_t p0, int64_t c) {
    if (s->ahead == 0) return;
    int64_t t = c + s->ahead;
    amx_prefetch_step(s, t < s->steps ? p0 : p0 + s->group, t % s->steps);
}
#endif

/* pd_bf16_greedy's path on the tiles (amx_gemm.c): each row's argmax of pd_amx_gemm's output. */
int amx_greedy(const uint16_t *x, int64_t x_stride, const uint16_t *panels, const uint16_t *bias, int rows, int64_t n,
               int64_t k, int64_t *tokens, int threads);

/* amx_greedy over a list of panels only (greedy_i8.c's rerun of its candidate panels), up to 16 rows. */
int amx_greedy_panels(const uint16_t *x, int64_t x_stride, const uint16_t *panels, int rows, int64_t n, int64_t k,
                      const int32_t *list, int64_t count, int64_t *tokens, int threads);

/* pd_amx_gemm's pieces for a caller that splits the columns itself (layer_cols.c), up to 16 rows:
   the rows staged (xs: 16 x k padded to 32 values), then panels [p_lo, p_hi) of out = xs @ W^T + bias
   on the calling thread's tiles (amx_configure'd; sums: 1,024 floats of scratch). */
void amx_stage16(const uint16_t *x, int64_t x_stride, int rows, int64_t k, uint16_t *xs);
void amx_panels16(const uint16_t *xs, const uint16_t *panels, const uint16_t *bias, uint16_t *out, int64_t out_stride,
                  int rows, int64_t n, int64_t k, int64_t p_lo, int64_t p_hi, float *sums);

/* Whether bfloat16 attention takes the tiles now: prefill chunks' scores and values, decode rows'
   scores. (A first try at decode scores, keys staged sixteen at a time, took 7.2-8.1 ms for SmolLM2's
   16-row step against 6.2-6.6 on vectors, 2026-12-03; read straight from the pool, 5.5-5.7 against
   5.8-5.9, 2026-12-04: decode_amx.c.) */
static inline int amx_ready(void) { return HAVE_AMX && pd_amx_enabled && amx_permitted(); }

#endif
