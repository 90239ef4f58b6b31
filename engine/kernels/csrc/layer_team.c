/* A prompt-sized step's whole decoder in one OpenMP region, its work split by rows
(pd_decoder_forward's path for steps of at least pd_use_team's rows on two or more threads).

The per-kernel path (layer.c) forks a team and joins it in every GEMM, attention call and large
small op: six joins a layer, each waiting for the slowest thread. On a host whose cores are shared,
that thread is often one the OS has descheduled, and a two-thread prompt then runs at a third of
one thread's speed. Here every step is one region, and everything in a layer but attention is
row-wise: the o GEMM, the residual and norm, gate|up, SiLU·up, down, the residual, then the next
layer's norm, q|k|v GEMM, rotary and K/V write each read and write only their own rows. So a layer
is two phases:

    rows      tiles of 16-64 rows (16-256 on AMX), each through the chain above (kernels on one thread, on the tile)
    attention decode rows one each, then the prompt chunks cut into pieces of about equal work (a
              piece: query positions [a, b) of one chunk, every head), in the order of their rows

Threads claim a phase's items from a counter, in order, and an item starts as soon as the items it
reads are done, not when the whole previous phase is: an attention piece once the rows items of
its layer have written the K/V of its chunk's rows up to its last query (a prefix of the tiles), a
rows item once the pieces answering its tile's rows are done (a prefix of the pieces). A thread
out of items in one phase therefore goes on with the next phase's first ones while its partner
finishes the phase's last: on two hardware threads of one core (a 2-vCPU VM's vCPUs at times are,
and then share one AMX unit and one set of vector ports) one runs GEMMs on the tiles while the
other runs attention's vector work, which two threads both on GEMMs, or both on attention, cannot
(docs/engine_speed.md, "One region per prompt step"). A thread the OS has descheduled between items costs nothing: its
partner takes the rest (a thread only waits for an item another has claimed and not finished). A
claimed item waits only on the previous phase's items, all claimed before it, so no wait is
circular. Waiting spins a while, then sleeps on the phase's counter (futex), so the core is free
for the partner it waits for. pd_team_overlap(0) makes every item wait for its whole previous
phase instead (for measurements; the same bits).

Bits: each kernel's output for a row depends on that row alone (the GEMMs' sums are batch- and
thread-invariant, the small ops row-wise) and prefill attention's on the row's position alone
(steps aligned to absolute positions), so a step gives the per-kernel path's outputs bit for bit
(tests/test_kernel_layer.py compares the two, with and without the overlap).

pd_layer_seconds: the calling thread's own work, by kind, with its waits before an item counted
to the item's kind (rows: LAYER_GEMM; attention: LAYER_PREFILL). */
#include <omp.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pdserve_kernels.h"
#include "amx.h"
#include "layer.h"
#include "prefill.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define RELAX() _mm_pause()
#else
#define RELAX() ((void)0)
#endif

#if defined(__linux__)
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#define FUTEX 1
#else
#define FUTEX 0
#endif

#define SPINS 4000 /* a wait spins this many pauses (~0.1 ms), then sleeps until the phase is done */

static int team_rows = 64; /* pd_use_team: the fewest step rows that take this path; 0 never */
static int64_t team_steps; /* steps run on this path (pd_team_steps) */

static int overlap_on = 1; /* pd_team_overlap */
static int lag_us;         /* pd_team_lag */

int64_t pd_team_steps(void) { return __atomic_load_n(&team_steps, __ATOMIC_RELAXED); }

int pd_team_lag(int us) {
    int before = lag_us;
    if (us >= 0) __atomic_store_n(&lag_us, us, __ATOMIC_RELAXED);
    return before;
}

int pd_team_overlap(int enable) {
    int before = overlap_on;
    if (enable >= 0) __atomic_store_n(&overlap_on, enable != 0, __ATOMIC_RELAXED);
    return before;
}

int pd_use_team(int rows) {
    int before = team_rows;
    if (rows >= 0) team_rows = rows;
    return before;
}

int layer_team_takes(const pd_step *S) { return team_rows > 0 && S->threads > 1 && S->tokens >= team_rows; }

/* the time since the last mark to `kind`, counted on the calling thread only (`mine`) */
#define CLOCK(kind) (t1 = layer_now(), pd_layer_seconds[kind] += mine ? t1 - t0 : 0, t0 = t1)

/* an attention piece: decode row `row` (chunk -1), or query rows [a, b) of chunk `chunk` */
typedef struct {
    int chunk, a, b, row;
} piece;

typedef struct {
    const pd_layer *layers;
    const pd_step *S;
    const void *x, *norm;
    void *outs[2], *normed;
    float eps;
    int n, tile, tiles, npieces;
    const piece *pieces;
    layer_counter *phases; /* 2 n + 1: rows 0, attention 0, rows 1, ..., rows n */
    unsigned char *done;   /* [2 n + 1][width]: item i of phase p finished */
    int width;             /* the most items a phase has */
    const int *tile_needs;  /* [tiles]: a rows item waits for the previous attention phase's first this many pieces */
    const int *piece_needs; /* [npieces]: an attention item waits for its layer's first this many tiles */
    int failed;      /* the first failing kernel's code */
} team;

/* Attention's pieces: the decode rows, one a piece; then each chunk cut where its work (a query
   row's grows with its position) reaches each of `want` equal shares, on whole tiles of the
   kernel's query rows where they divide. In the order of their rows (decode rows come first in a
   step), so a tile's rows need a prefix of the pieces. Returns the count written to out (room:
   decodes + chunks x want). */
static int cut_pieces(const pd_step *S, int groups, int want, piece *out) {
    int count = 0, align = ROWS % groups == 0 ? ROWS / groups : 16;
    for (int d = 0; d < S->decodes; d++) out[count++] = (piece){-1, 0, 0, d};
    for (int c = 0; c < S->n_chunks; c++) {
        const int64_t *chunk = S->chunks + 4 * c;
        int nq = (int)(chunk[1] - chunk[0]);
        double pos0 = (double)chunk[2], total = nq * pos0 + 0.5 * nq * (nq + 1.0);
        for (int a = 0, j = 1, b; a < nq; a = b, j++) {
            double goal = total * j / want; /* rows [0, b) do r pos0 + r (r + 1) / 2 of the work */
            for (b = a + align; b < nq && b * pos0 + 0.5 * b * (b + 1.0) < goal; b += align) {}
            if (b > nq || nq - b < align / 2 || j >= want) b = nq;
            out[count++] = (piece){c, a, b, -1};
        }
    }
    return count;
}

/* The step rows piece p answers, [q0, last]; the K/V it reads is of its chunk's rows up to `last`
   (a decode row: its own row's). */
static void piece_rows(const pd_step *S, const piece *p, int *q0, int *last) {
    int row0 = p->chunk < 0 ? p->row : (int)S->chunks[4 * p->chunk];
    *q0 = p->chunk < 0 ? row0 : row0 + p->a;
    *last = p->chunk < 0 ? row0 : row0 + p->b - 1;
}

/* What each item waits for. Attention piece p of layer l reads the K/V that layer l's rows items
   wrote for its rows (tiles 0 .. the tile of its last row: piece_needs[p] of them); rows item i of
   layer l + 1 reads the attention outputs of its tile's rows and overwrites their q|k|v (pieces 0 ..
   the last piece answering a row of the tile: tile_needs[i]). Both are prefixes: pieces run in
   the order of their rows. */
static void cut_needs(const team *t, int *tile_needs, int *piece_needs) {
    for (int i = 0; i < t->tiles; i++) tile_needs[i] = 0;
    for (int p = 0; p < t->npieces; p++) {
        int q0, last;
        piece_rows(t->S, t->pieces + p, &q0, &last);
        piece_needs[p] = last / t->tile + 1;
        for (int i = q0 / t->tile; i <= last / t->tile; i++) tile_needs[i] = p + 1;
    }
    for (int i = 0; i < t->tiles; i++) /* a tile no piece answers (none: every row is a decode or a chunk's) */
        if (tile_needs[i] == 0) tile_needs[i] = t->npieces;
}

/* Layer L's first half on rows [r0, r0 + m): norm, q|k|v, rotary, K/V into the pool. */
static int first_half(const pd_layer *L, const pd_step *S, const void *x, int r0, int m, int mine) {
    int hid = L->hidden, dim = L->dim, dt = S->dtype, rc;
    size_t es = dt == 0 ? sizeof(float) : sizeof(uint16_t);
    int q_width = L->heads * dim, kv_width = L->kv_heads * dim, qkv_n = q_width + 2 * kv_width;
    void *k = AT(S->kv, L->layer * S->layer_stride), *v = AT(k, S->layer_stride / 2);
    void *h = AT(S->h, (int64_t)r0 * hid), *qkv = AT(S->qkv, (int64_t)r0 * qkv_n);
    const void *cos = AT(S->cos, (int64_t)r0 * dim), *sin = AT(S->sin, (int64_t)r0 * dim);
    double t0 = layer_now(), t1;
    layer_rms_norm(dt, AT(x, (int64_t)r0 * hid), L->norm1, L->eps1, h, m, hid, 1);
    CLOCK(LAYER_SMALL);
    if ((rc = layer_gemm(dt, h, hid, L->qkv, L->qkv_bias, qkv, qkv_n, m, qkv_n, hid, 1)) != 0) return rc;
    CLOCK(LAYER_GEMM);
    if (dt == 0)
        pd_rope(qkv, qkv_n, L->heads + L->kv_heads, dim, cos, sin, dim, m, 1);
    else
        pd_rope_bf16(qkv, qkv_n, L->heads + L->kv_heads, dim, cos, sin, dim, m, 1);
    CLOCK(LAYER_SMALL);
    layer_kv_write(qkv, qkv_n, q_width, q_width + kv_width, kv_width, k, v, S->blk_stride, S->tok_stride,
                   S->slot_blocks + r0, S->slot_offsets + r0, m, es);
    CLOCK(LAYER_KV_WRITE);
    return 0;
}

/* Layer L's second half on rows [r0, r0 + m): x + o(attn), its norm, the MLP, the residual, into out. */
static int second_half(const pd_layer *L, const pd_step *S, const void *x, void *out, int r0, int m, int mine) {
    int hid = L->hidden, dt = S->dtype, inter = L->inter, q_width = L->heads * L->dim, rc;
    size_t es = dt == 0 ? sizeof(float) : sizeof(uint16_t);
    void *tmp = AT(S->tmp, (int64_t)r0 * hid), *h = AT(S->h, (int64_t)r0 * hid), *o = AT(out, (int64_t)r0 * hid);
    void *gu = AT(S->gu, (int64_t)r0 * 2 * inter), *act = AT(S->act, (int64_t)r0 * inter);
    const void *xr = AT(x, (int64_t)r0 * hid);
    double t0 = layer_now(), t1;
    if ((rc = layer_gemm(dt, AT(S->attn, (int64_t)r0 * q_width), q_width, L->o, L->o_bias, tmp, hid, m, hid,
                         q_width, 1)) != 0)
        return rc;
    CLOCK(LAYER_GEMM);
    if (dt == 0)
        pd_add_rms_norm(xr, hid, tmp, hid, L->norm2, L->eps2, o, h, m, hid, 1);
    else
        pd_add_rms_norm_bf16(xr, hid, tmp, hid, L->norm2, L->eps2, o, h, m, hid, 1);
    CLOCK(LAYER_SMALL);
    if ((rc = layer_gemm(dt, h, hid, L->gate_up, L->gate_up_bias, gu, 2 * inter, m, 2 * inter, hid, 1)) != 0)
        return rc;
    CLOCK(LAYER_GEMM);
    rc = dt == 0 ? pd_silu_mul(gu, 2 * inter, act, inter, m, inter, 1)
                 : pd_silu_mul_bf16(gu, 2 * inter, act, inter, m, inter, 1);
    if (rc != 0) return -3;
    CLOCK(LAYER_SMALL);
    if ((rc = layer_gemm(dt, act, inter, L->down, L->down_bias, tmp, hid, m, hid, inter, 1)) != 0) return rc;
    CLOCK(LAYER_GEMM);
    layer_add_rows(dt, o, tmp, o, (int64_t)m * hid);
    CLOCK(LAYER_SMALL);
    return 0;
}

/* Rows phase l's item i: layer l - 1's second half (l > 0), then layer l's first half (l < n) or
   the final norm (l == n), on tile i's rows. */
static int rows_item(const team *t, int l, int i, int mine) {
    const pd_step *S = t->S;
    int r0 = i * t->tile, m = S->tokens - r0 < t->tile ? S->tokens - r0 : t->tile, rc;
    const void *in = l == 0 ? t->x : t->outs[(l - 1) % 2];
    if (l > 0 && (rc = second_half(t->layers + l - 1, S, l == 1 ? t->x : t->outs[l % 2], t->outs[(l - 1) % 2],
                                   r0, m, mine)) != 0)
        return rc;
    if (l < t->n) return first_half(t->layers + l, S, in, r0, m, mine);
    size_t es = S->dtype == 0 ? sizeof(float) : sizeof(uint16_t);
    int hid = t->layers[0].hidden;
    double t0 = layer_now(), t1;
    layer_rms_norm(S->dtype, AT(in, (int64_t)r0 * hid), t->norm, t->eps, AT(t->normed, (int64_t)r0 * hid), m, hid, 1);
    CLOCK(LAYER_SMALL);
    return 0;
}

/* Attention phase l's item i: piece i of layer l's attention, on one thread. */
static int attention_item(const team *t, int l, int i, int mine) {
    const pd_layer *L = t->layers + l;
    const pd_step *S = t->S;
    const piece *p = t->pieces + i;
    int dim = L->dim, dt = S->dtype, q_width = L->heads * dim, qkv_n = q_width + 2 * L->kv_heads * dim, rc;
    size_t es = dt == 0 ? sizeof(float) : sizeof(uint16_t);
    void *k = AT(S->kv, L->layer * S->layer_stride), *v = AT(k, S->layer_stride / 2);
    double t0 = layer_now(), t1;
    if (p->chunk < 0) {
        int r = p->row;
        rc = pd_paged_decode(dt, AT(S->qkv, (int64_t)r * qkv_n), qkv_n, dim, k, v, S->blk_stride, S->tok_stride, dim,
                             S->tables + (int64_t)r * S->table_stride, S->table_stride, S->lens + r,
                             AT(S->attn, (int64_t)r * q_width), q_width, dim, 1, L->heads, L->kv_heads, dim,
                             S->block_size, L->scale, L->window, L->softcap, 1);
        CLOCK(LAYER_DECODE);
        return rc;
    }
    const int64_t *chunk = S->chunks + 4 * p->chunk;
    int64_t row = chunk[0] + p->a;
    rc = pd_paged_prefill(dt, AT(S->qkv, row * qkv_n), qkv_n, dim, k, v, S->blk_stride, S->tok_stride, dim,
                          (const int64_t *)(intptr_t)chunk[3], chunk[2] + p->a, p->b - p->a,
                          AT(S->attn, row * q_width), q_width, dim, L->heads, L->kv_heads, dim, S->block_size,
                          L->scale, L->window, L->softcap, 1);
    CLOCK(LAYER_PREFILL);
    return rc;
}

/* Whether phase c is as far as a waiter needs: with `done` (its items' flags), its first k items
   finished; without, k of its items finished. */
static int reached(layer_counter *c, const unsigned char *done, int k) {
    if (done == NULL) return __atomic_load_n(&c->done, __ATOMIC_ACQUIRE) >= k;
    for (int i = 0; i < k; i++)
        if (!__atomic_load_n(done + i, __ATOMIC_ACQUIRE)) return 0;
    return 1;
}

/* Until `reached`: spin a while, then sleep on the counter (a waiting thread that kept its core,
   spinning or yielding, would keep the OS from running a descheduled partner there: on an
   oversubscribed host the partner is what it waits for). */
static void wait_for(layer_counter *c, const unsigned char *done, int k) {
    for (int spin = 0; spin < SPINS; spin++) {
        if (reached(c, done, k)) return;
        RELAX();
    }
#if FUTEX
    __atomic_fetch_add(&c->sleepers, 1, __ATOMIC_SEQ_CST);
    for (int seen = __atomic_load_n(&c->done, __ATOMIC_SEQ_CST); !reached(c, done, k);
         seen = __atomic_load_n(&c->done, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, &c->done, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0); /* returns when done moved */
    __atomic_fetch_sub(&c->sleepers, 1, __ATOMIC_SEQ_CST);
#else
    while (!reached(c, done, k)) sched_yield();
#endif
}

/* Item i of phase c (of `items`) finished: flagged (with `done`) and counted. A sleeper waits for the
   whole phase without flags, so only the last item wakes it; with flags, for a prefix, so every one does. */
static void finish(layer_counter *c, unsigned char *done, int i, int items) {
    if (done != NULL) __atomic_store_n(done + i, 1, __ATOMIC_SEQ_CST);
    int count = __atomic_add_fetch(&c->done, 1, __ATOMIC_SEQ_CST);
#if FUTEX
    if ((done != NULL || count == items) && __atomic_load_n(&c->sleepers, __ATOMIC_SEQ_CST) > 0)
        syscall(SYS_futex, &c->done, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#else
    (void)count, (void)items;
#endif
}

void layer_wait_done(layer_counter *c, int items) { wait_for(c, NULL, items); }

void layer_finish_item(layer_counter *c, int items) { finish(c, NULL, 0, items); }

/* One thread's part of the step: every phase in turn, claiming items until none is left. A thread
   out of items in one phase starts the next phase's, each once the items it reads are finished
   (cut_needs), so on two threads of one core one runs attention while the other runs GEMMs.
   Deadlock-free: a claimed item waits only on the previous phase's items, all claimed before it. */
static void run(team *t) {
    int mine = omp_get_thread_num() == 0, lag = omp_get_thread_num() == 1 ? __atomic_load_n(&lag_us, __ATOMIC_RELAXED) : 0;
    for (int p = 0; p < 2 * t->n + 1; p++) {
        int items = p % 2 == 0 ? t->tiles : t->npieces;
        layer_counter *c = t->phases + p;
        unsigned char *done = t->done + (int64_t)p * t->width;
        for (int i; (i = __atomic_fetch_add(&c->next, 1, __ATOMIC_RELAXED)) < items;) {
            if (lag > 0) usleep((useconds_t)lag); /* a test's slow partner, holding item i */
            if (p > 0) {
                double t0 = layer_now(), t1;
                wait_for(c - 1, done - t->width, p % 2 == 0 ? t->tile_needs[i] : t->piece_needs[i]);
                CLOCK(p % 2 == 0 ? LAYER_GEMM : LAYER_PREFILL);
            }
            if (__atomic_load_n(&t->failed, __ATOMIC_RELAXED) == 0) {
                int rc = p % 2 == 0 ? rows_item(t, p / 2, i, mine) : attention_item(t, p / 2, i, mine);
                int none = 0;
                if (rc != 0) __atomic_compare_exchange_n(&t->failed, &none, rc, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
            }
            finish(c, done, i, items);
        }
    }
}

/* pd_decoder_forward's step on one region (n > 0): as the per-kernel loop's, bit for bit. */
int layer_team_forward(const pd_layer *layers, int n, const pd_step *S, const void *x, void *out0, void *out1,
                       const void *norm, float eps, void *normed) {
    /* AMX tiles: a GEMM streams a weight once a call and keeps it in cache for the call's blocks of
       32 rows, so a tile of more rows reads the layer's weights fewer times a step (and bigger tiles
       make fewer of them): two tiles a thread, up to the 256 rows a call takes. Elsewhere four a
       thread, within the float32 GEMM's 64-row cut. */
    int amx = S->dtype == 1 && amx_ready();
    int threads = S->threads, T = S->tokens, want = 4 * threads, tiles = (amx ? 2 : 4) * threads;
    int tile = (T + tiles - 1) / tiles;
    tile = (tile + 7) / 8 * 8;
    int most = amx ? 256 : 64;
    tile = tile < 16 ? 16 : tile > most ? most : tile;
    int room = S->n_chunks * want + S->decodes + 1, tiles_n = (T + tile - 1) / tile;
    int width = room > tiles_n ? room : tiles_n;
    piece *pieces = malloc(sizeof(piece) * (size_t)room);
    int *needs = malloc(sizeof(int) * (size_t)(room + tiles_n));
    unsigned char *done = calloc((size_t)(2 * n + 1) * (size_t)width, 1);
    layer_counter *phases = aligned_alloc(64, sizeof(layer_counter) * (size_t)(2 * n + 1));
    if (pieces == NULL || needs == NULL || done == NULL || phases == NULL) {
        free(pieces), free(needs), free(done), free(phases);
        return -2;
    }
    memset(phases, 0, sizeof(layer_counter) * (size_t)(2 * n + 1));
    team t = {.layers = layers, .S = S, .x = x, .norm = norm, .outs = {out0, out1}, .normed = normed, .eps = eps,
              .n = n, .tile = tile, .tiles = tiles_n, .pieces = pieces, .phases = phases, .done = done,
              .width = width, .tile_needs = needs, .piece_needs = needs + tiles_n};
    t.npieces = cut_pieces(S, layers[0].heads / layers[0].kv_heads, want, pieces);
    cut_needs(&t, needs, needs + tiles_n);
    if (!__atomic_load_n(&overlap_on, __ATOMIC_RELAXED)) { /* every item waits for the whole previous phase */
        for (int i = 0; i < tiles_n; i++) needs[i] = t.npieces;
        for (int p = 0; p < t.npieces; p++) needs[tiles_n + p] = tiles_n;
    }
    _Pragma("omp parallel num_threads(threads)") run(&t);
    __atomic_fetch_add(&team_steps, 1, __ATOMIC_RELAXED);
    free(pieces), free(needs), free(done), free(phases);
    return t.failed;
}
