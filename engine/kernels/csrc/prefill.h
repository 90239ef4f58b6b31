/* What the prefill attention kernel's two paths share (paged_prefill.c: vectors, and the entry
   point; prefill_amx.c: AMX tiles): a task's rows, the call's arguments, the online-softmax step. */
#ifndef PDSERVE_PREFILL_H
#define PDSERVE_PREFILL_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

#define ROWS 48      /* query rows of a task: six vectors of eight */
#define KSTEP_AMX 32 /* keys per step on AMX tiles: two tiles' rows of keys, one tile's row of key pairs */

/* One call's arguments, as every task reads them. */
typedef struct {
    int dtype, dim, groups, block_size, window;
    int64_t elem, q_tok, q_head, blk_stride, tok_stride, head_stride, pos0, out_tok, out_head;
    const void *q, *k, *v;
    void *out;
    const int64_t *table;
    float scale, softcap;
} Call;

/* Row r of a tile is query head h * groups + g % groups at position pos0 + g / groups, g = tile * ROWS + r. */
static inline int64_t row_offset(const Call *c, int tile, int h, int r, int64_t tok, int64_t head) {
    int g = tile * ROWS + r;
    return ((int64_t)(g / c->groups) * tok + (int64_t)(h * c->groups + g % c->groups) * head) * c->elem;
}

/* The rows' positions (never falling with the row; -1 for the padding rows past `rows`, all last),
   running maxima and sums. */
static inline void start_rows(const Call *c, int tile, int rows, int32_t *pos, float *m, float *l) {
    for (int r = 0; r < ROWS; r++) {
        m[r] = -INFINITY, l[r] = 0.0f;
        pos[r] = r < rows ? (int32_t)(c->pos0 + (tile * ROWS + r) / c->groups) : -1;
    }
}

/* Row r's output: o[d * o_stride] / l, in the call's dtype. */
static inline void finish_row(const Call *c, int tile, int h, int r, const float *o, int o_stride, float l) {
    char *dst = (char *)c->out + row_offset(c, tile, h, r, c->out_tok, c->out_head);
    float inv = 1.0f / l;
    for (int d = 0; d < c->dim; d++) {
        float x = o[d * o_stride] * inv;
        if (c->dtype == 0)
            ((float *)dst)[d] = x;
        else
            ((uint16_t *)dst)[d] = bf16_store(x);
    }
}

/* One online-softmax step over keys p0 .. p0 + ks - 1 (st: their scores, [ks][ROWS], times `post`),
   sixteen rows at a time: the masked scores' max and exps (st becomes the weights; keys a row may
   not see weigh exactly 0), each row's running max m and sum l, and corr, the factor its sums so
   far are scaled by. With `pairs` (ks even) the weights go there instead, rounded to bfloat16
   (nearest even) as tiles of key pairs, one for each 16 rows: pairs[r0 / 16][j / 2][r] = (w[j][r],
   w[j + 1][r]) (prefill_amx.c's value tiles; the sums l stay the unrounded weights').
   Sixteen rows that all see the whole step (no mask, no softcap: every step of a prompt but the
   diagonal's) skip the mask and take the max on four chains instead of one: the same values, as a
   max does not depend on its order (NaN aside), so a row's bits still depend on its position only
   (48 rows x 32 keys: 538 against 823-897 ns a step, a C harness, host E, 2026-12-06). */
static inline void softmax_step(float *st, float *m, float *l, float *corr, const int32_t *pos, int64_t p0,
                                int ks, int window, float softcap, float post, uint32_t *pairs) {
    for (int r0 = 0; r0 < ROWS; r0 += 16) {
        v16f m16 = f32_load16(m + r0), top = m16, sum = {0}, none = (v16f){0} - INFINITY;
        v16i pos16;
        memcpy(&pos16, pos + r0, sizeof pos16);
        /* the sixteen rows' first and last positions (start_rows': rising with the row, padding last);
           a padding row makes `first` -1, so the step is not whole and `final` is not read */
        int32_t first = pos[r0 + 15] < 0 ? -1 : pos[r0], final = pos[r0 + 15];
        int whole = softcap <= 0.0f && ks % 4 == 0 && p0 + ks - 1 <= first
                    && (window <= 0 || p0 > final - window);
        if (whole) {
            v16f t[4] = {none, none, none, none};
            for (int j = 0; j < ks; j += 4) /* ks a multiple of 4 (whole) */
                for (int u = 0; u < 4; u++) {
                    float *s = st + (j + u) * ROWS + r0;
                    v16f s16 = f32_load16(s);
                    if (post != 1.0f) store16(s, s16 *= post);
                    t[u] = vmax16(t[u], s16);
                }
            top = vmax16(top, vmax16(vmax16(t[0], t[1]), vmax16(t[2], t[3])));
        } else {
            for (int j = 0; j < ks; j++) {
                float *s = st + j * ROWS + r0;
                if (post != 1.0f) store16(s, f32_load16(s) * post);
                if (softcap > 0.0f)
                    for (int x = 0; x < 16; x++) s[x] = tanhf(s[x] / softcap) * softcap;
                v16i p16 = (v16i){0} + (int32_t)(p0 + j);
                v16i sees = p16 <= pos16;
                if (window > 0) sees &= p16 > pos16 - window;
                v16f s16 = select16(sees, f32_load16(s), none);
                store16(s, s16);
                top = vmax16(top, s16);
            }
        }
        v16f base = select16(top == none, (v16f){0}, top); /* rows that saw nothing yet: any finite base */
        v16f c16 = select16(m16 == none, (v16f){0}, exp_nonpos16(m16 - base));
        uint32_t *w = pairs ? pairs + r0 / 16 * (ks / 2) * 16 : NULL;
        v16u lo = {0};
        for (int j = 0; j < ks; j++) {
            float *s = st + j * ROWS + r0;
            v16f s16 = f32_load16(s), e = select16(s16 == none, (v16f){0}, exp_nonpos16(s16 - base));
            sum += e;
            if (w == NULL) {
                store16(s, e);
            } else if (j % 2 == 0) {
                lo = bf16_rounded_bits16(e) >> 16;
            } else {
                v16u pair = lo | (bf16_rounded_bits16(e) & 0xFFFF0000u);
                memcpy(w + j / 2 * 16, &pair, sizeof pair);
            }
        }
        store16(l + r0, f32_load16(l + r0) * c16 + sum);
        store16(m + r0, top);
        store16(corr + r0, c16);
    }
}

/* prefill_amx.c, where the CPU has AMX (amx.h's HAVE_AMX) */
void prefill_amx_gather(const Call *c, int kv_heads, int64_t base, int64_t nk, int64_t last, uint16_t *kc,
                        uint16_t *vt, int threads);
int prefill_amx_task(const Call *c, int tile, int h, int rows, const uint16_t *kc, const uint16_t *vt, int64_t base,
                     int64_t nk);

#endif
