/* The decode kernel's body for one dtype, included by paged_decode.c once per dtype (a template
   by inclusion, so debuggers, ctags and compiler messages see real lines). Before including, define:
     DECODE_NAME  the function's name (static)
     T            the element type of q, the pool and out (float, or uint16_t for bfloat16)
     LOAD(x)      one element of T to float;  STORE(x)  one float to T
     STAGED       1 where the pool's keys/values are widened per group (bfloat16), else 0
   This file #undefs them at its end. The algorithm is described at the top of paged_decode.c. */

static int DECODE_NAME(const T *q, int64_t q_tok, int64_t q_head, const T *k, const T *v,
                       int64_t blk_stride, int64_t tok_stride, int64_t head_stride,
                       const int64_t *tables, int64_t table_stride, const int64_t *lens, T *out,
                       int64_t out_tok, int64_t out_head, int n, int heads, int kv_heads, int dim,
                       int block_size, float scale, int window, float softcap, int threads) {
    int groups = heads / kv_heads, staged = STAGED, ahead = AHEAD_BYTES / (int)sizeof(T);
    int dotted = STAGED && DOT_BF16 && dim % 32 == 0; /* scores_dot: q read in place */
    int tiled = STAGED && dim % 32 == 0 && block_size % 16 == 0 && groups <= 16 && amx_ready();
    int64_t tile_floats = tiled ? 256 * (int64_t)(kv_heads * dim / 32 + 1) : 0; /* qb and cbuf */
    int widened_values = STAGED && LANES16 && dim % 32 == 0; /* values_bf16 */
    int parts = n >= 2 * threads ? 1 : kv_heads; /* few rows: split each row's heads too */
    int failed = 0;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int task = 0; task < n * parts; task++) {
        int i = task / parts, part = task % parts;
        int h0 = part * kv_heads / parts, h1 = (part + 1) * kv_heads / parts;
        int nq = (h1 - h0) * groups; /* query heads h0 * groups .. h1 * groups */
        int64_t len = lens[i];
        int64_t first = window > 0 && len > window ? len - window : 0;
        int64_t count = len - first;
        int64_t span_n = (h1 - h0 - 1) * head_stride + dim, span = span_n * (int64_t)sizeof(T);
        /* the key offsets first (int64, aligned), then the floats: q, sums, scores, and a
           group's keys (values) widened where the pool is not float32 */
        int64_t *at = malloc(sizeof(int64_t) * (size_t)count
                             + sizeof(float) * ((size_t)nq * (size_t)(2 * dim + count)
                                                + (STAGED ? (size_t)(GROUP * span_n) : 0)
                                                + (size_t)tile_floats));
        if (at == NULL) {
            #pragma omp atomic write
            failed = 1;
            continue;
        }
        float *qf = (float *)(at + count), *acc = qf + nq * dim, *sc = acc + nq * dim;
        float *wide = sc + (int64_t)nq * count; /* staged: GROUP keys' heads h0 .. h1 - 1 */
        const int64_t *table = tables + i * table_stride;
        int64_t hoff[nq]; /* query head j reads KV head h0 + j / groups */
        for (int j = 0; j < nq; j++) hoff[j] = (h0 + j / groups) * head_stride;
        /* where key first + c sits in a layer's K (V) of block 0: no division per key */
        for (int64_t c = 0, b = first / block_size, o = first % block_size; c < count; c++) {
            at[c] = table[b] * blk_stride + o * tok_stride;
            if (++o == block_size) o = 0, b++;
        }
        for (int j = 0; j < nq; j++) {
            const T *qj = q + i * q_tok + (int64_t)(h0 * groups + j) * q_head;
            for (int d = 0; !dotted && !tiled && d < dim; d++) qf[j * dim + d] = LOAD(qj[d]) * scale;
            for (int d = 0; d < dim; d++) acc[j * dim + d] = 0.0f;
        }
        if (tiled) { /* scores on tiles (decode_amx.c); scratch after the widened group's */
            float *cbuf = wide + (STAGED ? GROUP * span_n : 0);
            decode_amx_scores((const uint16_t *)(const void *)q + i * q_tok + (int64_t)h0 * groups * q_head,
                              q_head, (const uint16_t *)(const void *)k + h0 * head_stride, blk_stride,
                              tok_stride, head_stride, table, block_size, first, len, h1 - h0, groups, dim,
                              scale, sc, span, (uint32_t *)(void *)(cbuf + 256), cbuf);
        }
        /* scores, eight keys at a time: each key is read once for every query head that
           shares it, and eight dot products are summed across lanes together */
        for (int64_t c0 = 0; !tiled && c0 < count; c0 += GROUP) {
            int m = count - c0 < GROUP ? (int)(count - c0) : GROUP;
            if (dotted) { /* a short group's missing keys: key c0 again, its scores not stored */
                const uint16_t *kp[GROUP];
                for (int kh = 0; kh < h1 - h0; kh++) {
                    PREFETCH_AHEAD(k, GROUP * kh / (h1 - h0), GROUP * (kh + 1) / (h1 - h0)); /* a share */
                    for (int e = 0; e < GROUP; e++)
                        kp[e] = (const uint16_t *)(const void *)k + at[c0 + (e < m ? e : 0)] + (h0 + kh) * head_stride;
                    BY_THREES(groups, SCORES)
                }
                continue;
            }
            PREFETCH_AHEAD(k, nq, m); /* one key's prefetch per head below; here the rest */
            if (staged) widen_group((const uint16_t *)(const void *)k, at + c0, m, h0 * head_stride, span_n, wide);
            for (int j = 0; j < nq; j++) {
                if (j < m && c0 + j + ahead < count) prefetch_span(k + at[c0 + j + ahead] + h0 * head_stride, span);
                const float *qj = qf + j * dim;
                float *s = sc + j * count + c0;
                if (m == GROUP) {
                    const float *k0 = ROW(k, 0), *k1 = ROW(k, 1), *k2 = ROW(k, 2), *k3 = ROW(k, 3);
                    const float *k4 = ROW(k, 4), *k5 = ROW(k, 5), *k6 = ROW(k, 6), *k7 = ROW(k, 7);
                    v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
                    int d = 0;
                    for (; d + 8 <= dim; d += 8) {
                        v8f x = f32_load8(qj + d);
                        a0 += x * f32_load8(k0 + d), a1 += x * f32_load8(k1 + d);
                        a2 += x * f32_load8(k2 + d), a3 += x * f32_load8(k3 + d);
                        a4 += x * f32_load8(k4 + d), a5 += x * f32_load8(k5 + d);
                        a6 += x * f32_load8(k6 + d), a7 += x * f32_load8(k7 + d);
                    }
                    store8(s, sum_lanes8(a0, a1, a2, a3, a4, a5, a6, a7));
                    for (; d < dim; d++) {
                        s[0] += qj[d] * k0[d], s[1] += qj[d] * k1[d];
                        s[2] += qj[d] * k2[d], s[3] += qj[d] * k3[d];
                        s[4] += qj[d] * k4[d], s[5] += qj[d] * k5[d];
                        s[6] += qj[d] * k6[d], s[7] += qj[d] * k7[d];
                    }
                } else {
                    for (int e = 0; e < m; e++) {
                        const float *ke = ROW(k, e);
                        v8f a = {0};
                        int d = 0;
                        for (; d + 8 <= dim; d += 8) a += f32_load8(qj + d) * f32_load8(ke + d);
                        float x = sum_lanes(a);
                        for (; d < dim; d++) x += qj[d] * ke[d];
                        s[e] = x;
                    }
                }
            }
        }
        float inv[nq];
        for (int j = 0; j < nq; j++) {
            float *row = sc + j * count;
            if (softcap > 0.0f)
                for (int64_t c = 0; c < count; c++) row[c] = tanhf(row[c] / softcap) * softcap;
            v8f top8 = (v8f){0} - INFINITY, sum8 = {0};
            int64_t c = 0;
            for (; c + 8 <= count; c += 8) top8 = vmax(top8, f32_load8(row + c));
            float lanes[8], top = -INFINITY, sum;
            memcpy(lanes, &top8, sizeof lanes);
            for (int l = 0; l < 8; l++) top = lanes[l] > top ? lanes[l] : top;
            for (; c < count; c++) top = row[c] > top ? row[c] : top;
            for (c = 0; c + 8 <= count; c += 8) {
                v8f e = exp_nonpos8(f32_load8(row + c) - top);
                store8(row + c, e);
                sum8 += e;
            }
            sum = hsum(sum8);
            for (; c < count; c++) sum += row[c] = exp_nonpos(row[c] - top);
            inv[j] = 1.0f / sum;
        }
        /* values, eight keys at a time (sixteen widened in registers): a head's sums are loaded
           and stored once per group (64 of them held in registers), each key's update still its
           own, in key order */
        for (int64_t c0 = 0, step = widened_values ? VGROUP : GROUP; c0 < count; c0 += step) {
            int m = count - c0 < step ? (int)(count - c0) : (int)step;
            if (widened_values) { /* each KV head's values `ahead`, a key a turn (values_bf16) */
                const uint16_t *held[VGROUP], *pf[VGROUP];
                for (int kh = 0; kh < h1 - h0; kh++) {
                    for (int e = 0; e < VGROUP; e++)
                        pf[e] = c0 + e + ahead < count ? (const uint16_t *)(const void *)v + at[c0 + e + ahead] + (h0 + kh) * head_stride : NULL;
                    for (int e = 0; e < m; e++)
                        held[e] = (const uint16_t *)(const void *)v + at[c0 + e] + (h0 + kh) * head_stride;
                    for (int d0 = 0, pieces; d0 < dim; d0 += 32 * pieces) {
                        pieces = dim - d0 >= 64 ? 2 : 1;
                        if (pieces == 2) BY_FOURS(groups, VALUES64)
                        else BY_FOURS(groups, VALUES32)
                    }
                }
                continue;
            }
            PREFETCH_AHEAD(v, nq, m); /* one value's prefetch per head below; here the rest */
            if (staged) widen_group((const uint16_t *)(const void *)v, at + c0, m, h0 * head_stride, span_n, wide);
            for (int j = 0; j < nq; j++) {
                if (j < m && c0 + j + ahead < count) prefetch_span(v + at[c0 + j + ahead] + h0 * head_stride, span);
                const float *w = sc + j * count + c0;
                float *a = acc + j * dim;
                const float *vp[GROUP];
                for (int e = 0; e < m; e++) vp[e] = ROW(v, e);
                int d = 0;
                for (; d + 64 <= dim; d += 64) {
                    v8f x0 = f32_load8(a + d), x1 = f32_load8(a + d + 8);
                    v8f x2 = f32_load8(a + d + 16), x3 = f32_load8(a + d + 24);
                    v8f x4 = f32_load8(a + d + 32), x5 = f32_load8(a + d + 40);
                    v8f x6 = f32_load8(a + d + 48), x7 = f32_load8(a + d + 56);
                    for (int e = 0; e < m; e++) {
                        v8f we = splat(w + e);
                        const float *ve = vp[e] + d;
                        x0 += we * f32_load8(ve), x1 += we * f32_load8(ve + 8);
                        x2 += we * f32_load8(ve + 16), x3 += we * f32_load8(ve + 24);
                        x4 += we * f32_load8(ve + 32), x5 += we * f32_load8(ve + 40);
                        x6 += we * f32_load8(ve + 48), x7 += we * f32_load8(ve + 56);
                    }
                    store8(a + d, x0), store8(a + d + 8, x1), store8(a + d + 16, x2);
                    store8(a + d + 24, x3), store8(a + d + 32, x4), store8(a + d + 40, x5);
                    store8(a + d + 48, x6), store8(a + d + 56, x7);
                }
                for (; d + 8 <= dim; d += 8) {
                    v8f x = f32_load8(a + d);
                    for (int e = 0; e < m; e++) x += splat(w + e) * f32_load8(vp[e] + d);
                    store8(a + d, x);
                }
                for (; d < dim; d++) {
                    float x = a[d];
                    for (int e = 0; e < m; e++) x += w[e] * vp[e][d];
                    a[d] = x;
                }
            }
        }
        for (int j = 0; j < nq; j++) {
            T *o = out + i * out_tok + (int64_t)(h0 * groups + j) * out_head;
#if STAGED && LANES16
            if (widened_values) { /* [even | odd] per 32 dimensions back in order, as the loop below */
                for (int d = 0; d < dim; d += 32) {
                    v16f even = f32_load16(acc + j * dim + d) * inv[j], odd = f32_load16(acc + j * dim + d + 16) * inv[j];
                    bf16_store16(o + d, __builtin_shufflevector(even, odd, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6,
                                                                22, 7, 23));
                    bf16_store16(o + d + 16, __builtin_shufflevector(even, odd, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28,
                                                                     13, 29, 14, 30, 15, 31));
                }
                continue;
            }
#endif
            for (int d = 0; d < dim; d++) /* widened_values: [even | odd] per 32 dimensions */
                o[d] = STORE(acc[j * dim + (widened_values ? d / 32 * 32 + d % 2 * 16 + d % 32 / 2 : d)] * inv[j]);
        }
        free(at);
    }
    return failed ? -2 : 0; /* -2: out of memory for a task's scores */
}

#undef DECODE_NAME
#undef T
#undef LOAD
#undef STORE
#undef STAGED
