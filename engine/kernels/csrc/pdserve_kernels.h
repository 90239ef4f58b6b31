/* Everything a binding may call: the one declaration of each export of pdserve's CPU kernels.

Every export is named pd_* and marked PD_API; the library is built with -fvisibility=hidden, so
anything else (the kernels' helpers across files) is not in its dynamic symbol table. The ctypes
bindings (engine/kernels/abi.py) read their argument types from this file: a prototype is one
`PD_API <type> pd_<name>(<parameters>);` statement, parameters from the types below only
(int, int32_t, int64_t, float, double and pointers). Structs shared across the FFI export their
size (pd_layer_size, pd_step_size), which the bindings check against their ctypes mirrors.
Return values: 0 done; -1 an argument the kernel cannot take; -2 out of memory.
dtype arguments: 0 float32, 1 bfloat16 (as uint16_t bits). */
#ifndef PDSERVE_KERNELS_H
#define PDSERVE_KERNELS_H

#include <stdint.h>

#define PD_API __attribute__((visibility("default")))

/* One layer's weights and shape (abi.py's LayerArgs): float32 or bfloat16 alike, as the step's dtype says. */
typedef struct {
    const void *norm1, *qkv, *qkv_bias, *o, *o_bias, *norm2, *gate_up, *gate_up_bias, *down, *down_bias;
    float eps1, eps2, scale, softcap;
    int64_t layer; /* its index in the pool */
    int32_t hidden, heads, kv_heads, dim, inter, window;
} pd_layer;

/* One step: what every layer reads (abi.py's StepArgs). */
typedef struct {
    void *kv;                       /* the pool, [blocks, layers, 2, block_size, kv_heads, dim] */
    int64_t blk_stride, layer_stride, tok_stride; /* in values; V sits layer_stride / 2 past K */
    const int64_t *slot_blocks, *slot_offsets; /* [tokens] where each token's K/V goes */
    const int64_t *tables, *lens;   /* decode rows: [decodes, table_stride] and [decodes] */
    int64_t table_stride;
    const int64_t *chunks;          /* [chunks, 4]: start, end, first position, address of its table */
    const void *cos, *sin;          /* [tokens, dim] each */
    void *h, *qkv, *attn, *gu, *act, *tmp; /* scratch, [tokens, ...] */
    int32_t tokens, decodes, n_chunks, block_size, threads;
    int32_t dtype;                  /* 0 float32, 1 bfloat16: the pool, the weights, every buffer */
} pd_step;

/* the build: instruction sets compiled for (isa.c), struct sizes, AMX permission (prefill_amx.c) */
PD_API int pd_isa(void);
PD_API int64_t pd_layer_size(void);
PD_API int64_t pd_step_size(void);
PD_API int pd_use_amx(int enable);

/* attention straight from the paged pool (paged_decode.c, paged_prefill.c) */
PD_API int pd_paged_decode(int dtype, const void *q, int64_t q_tok, int64_t q_head, const void *k, const void *v,
                           int64_t blk_stride, int64_t tok_stride, int64_t head_stride, const int64_t *tables,
                           int64_t table_stride, const int64_t *lens, void *out, int64_t out_tok, int64_t out_head,
                           int n, int heads, int kv_heads, int dim, int block_size, float scale, int window,
                           float softcap, int threads);
PD_API int pd_paged_prefill(int dtype, const void *q, int64_t q_tok, int64_t q_head, const void *k, const void *v,
                            int64_t blk_stride, int64_t tok_stride, int64_t head_stride, const int64_t *table,
                            int64_t pos0, int nq, void *out, int64_t out_tok, int64_t out_head, int heads,
                            int kv_heads, int dim, int block_size, float scale, int window, float softcap,
                            int threads);

/* float32 linears on panel-packed weights, and the greedy head's reruns (small_gemm.c) */
PD_API void pd_f32_pack(const float *w, int64_t n, int64_t k, float *out);
PD_API void pd_f32_gemm(const float *x, int64_t ldx, const float *panels, const float *bias, float *y, int64_t ldy,
                        int m, int n, int k, int threads);
PD_API int pd_f32_greedy(const float *x, int64_t ldx, const float *panels, const uint16_t *half, const float *bias,
                         const float *norms, float *approx, int m, int n, int k, double rel, double abs_,
                         int64_t *tokens, int32_t *reread, int threads);

/* bfloat16 linears on the tiles' pair-packed panels: AMX (amx_gemm.c) or vdpbf16ps (bf16_gemm.c) */
PD_API void pd_amx_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *panels);
PD_API int pd_amx_gemm_ready(void);
/* Calls of up to 16 rows, and the int8 head's first pass, prefetch the weights' tiles `steps` k-steps
   ahead (4, the default; 0 none; negative unchanged; the same bits either way). Returns the setting before. */
PD_API int pd_amx_prefetch(int steps);
PD_API int pd_amx_gemm(const uint16_t *x, int64_t x_stride, const uint16_t *panels, const uint16_t *bias,
                       uint16_t *out, int64_t out_stride, int rows, int64_t n, int64_t k, int threads);
PD_API int pd_amx_head_approx(const float *x, int64_t ldx, const uint16_t *panels, const float *bias, float *approx,
                              int rows, int64_t n, int64_t k, int threads);
PD_API int pd_bf16_gemm_path(void);
PD_API int pd_bf16_gemm(const uint16_t *x, int64_t x_stride, const uint16_t *panels, const uint16_t *bias,
                        uint16_t *out, int64_t out_stride, int rows, int64_t n, int64_t k, int threads);
PD_API int pd_bf16_greedy(const uint16_t *x, int64_t x_stride, const uint16_t *panels, const uint16_t *bias, int rows,
                          int64_t n, int64_t k, int64_t *tokens, int threads);
/* a bfloat16 greedy head's first pass on an int8 copy on AMX-INT8 tiles, then an exact rerun of the
   candidate panels (greedy_i8.c) */
PD_API int pd_i8_head_ready(void);
PD_API int pd_i8_head_pack(const uint16_t *panels, int64_t n, int64_t k, int8_t *q, float *cols);
PD_API int pd_bf16_greedy_i8(const uint16_t *x, int64_t x_stride, const uint16_t *panels, const int8_t *q,
                             const float *cols, int rows, int64_t n, int64_t k, double wmax, double most, float *upper,
                             int64_t *tokens, int64_t *reread, int threads);

/* the small ops, each in float32 and bfloat16 (rms_norm.c, rope.c, silu_mul.c, argmax.c) */
PD_API void pd_rms_norm(const float *x, int64_t x_stride, const float *w, float eps, float *out, int64_t out_stride,
                        int rows, int n, int threads);
PD_API void pd_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, float eps, uint16_t *out,
                             int64_t out_stride, int rows, int n, int threads);
PD_API void pd_add_rms_norm(const float *x, int64_t x_stride, const float *y, int64_t y_stride, const float *w,
                            float eps, float *sum, float *out, int rows, int n, int threads);
PD_API void pd_add_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *y, int64_t y_stride,
                                 const uint16_t *w, float eps, uint16_t *sum, uint16_t *out, int rows, int n,
                                 int threads);
PD_API void pd_rope(float *x, int64_t tok_stride, int heads, int dim, const float *cos, const float *sin,
                    int64_t cs_stride, int tokens, int threads);
PD_API void pd_rope_bf16(uint16_t *x, int64_t tok_stride, int heads, int dim, const uint16_t *cos,
                         const uint16_t *sin, int64_t cs_stride, int tokens, int threads);
PD_API int pd_silu_mul(const float *x, int64_t x_stride, float *out, int64_t out_stride, int rows, int n, int threads);
PD_API int pd_silu_mul_bf16(const uint16_t *x, int64_t x_stride, uint16_t *out, int64_t out_stride, int rows, int n,
                            int threads);
PD_API void pd_argmax(const float *x, int64_t stride, int rows, int n, int64_t *out, int threads);
PD_API void pd_argmax_bf16(const uint16_t *x, int64_t stride, int rows, int n, int64_t *out, int threads);

/* a decoder layer, or the whole decoder's loop, as one call (layer.c); the seconds each kind of
   work took across calls (pd_layer_seconds, [PD_LAYER_KINDS]) */
#define PD_LAYER_KINDS 5
PD_API int pd_layer_forward(const pd_layer *L, const pd_step *S, const void *x, void *out);
PD_API int pd_decoder_forward(const pd_layer *layers, int n, const pd_step *S, const void *x, void *out0, void *out1,
                              const void *norm, float eps, void *normed);
PD_API extern double pd_layer_seconds[PD_LAYER_KINDS];
/* pd_decoder_forward runs steps of at least `rows` tokens on two or more threads as one OpenMP
   region split by rows (layer_team.c); 0: never; negative: unchanged. Returns the setting before. */
PD_API int pd_use_team(int rows);
PD_API int64_t pd_team_steps(void); /* the steps that path has run */
/* On that path, an item starts once the items it reads are done (1, the default), or once the whole
   previous phase is (0; the same bits); negative: unchanged. Returns the setting before. */
PD_API int pd_team_overlap(int enable);
/* For tests: on that path, the team's second thread sleeps `us` microseconds after claiming each
   item, so its partner runs as far ahead as the waits let it; negative: unchanged. Returns the
   setting before. */
PD_API int pd_team_lag(int us);
/* pd_decoder_forward runs bfloat16 steps of up to 16 decode rows on AMX tiles and two or more threads
   as one OpenMP region, the GEMMs split by columns (layer_cols.c): 1 on (the default), 0 off,
   negative unchanged. Returns the setting before. */
PD_API int pd_use_cols(int enable);
PD_API int64_t pd_cols_steps(void); /* the steps that path has run */

#endif
