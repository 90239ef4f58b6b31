/* One row's argmax for one dtype, included by argmax.c once per dtype (a template by inclusion).
   Define before including: ARGMAX_NAME (the function), T (the element type), LOAD8 (eight elements
   to a v8f), LOAD (one element to float); undefined again at the end. */

static int64_t ARGMAX_NAME(const T *x, int n) {
    int i = 0;
    float best = LOAD(x[0]);
    int64_t at = 0;
    if (n >= 16) { /* lane l keeps the first largest of x[l], x[l + 8], ...; then the lanes compared */
        v8f top = LOAD8(x);
        v8i where = {0, 1, 2, 3, 4, 5, 6, 7}, index = where, nan = (v8i){0};
        for (i = 8; i + 8 <= n; i += 8) {
            v8f v = LOAD8(x + i);
            index += 8;
            v8i more = v > top;
            nan |= v != v;
            top = select8(more, v, top);
            where = (more & index) | (~more & where);
        }
        nan |= top != top;
        int64_t any_nan = 0;
        for (int l = 0; l < 8; l++) any_nan |= nan[l];
        if (any_nan) { /* torch takes the first NaN */
            for (int j = 0; j < n; j++)
                if (LOAD(x[j]) != LOAD(x[j])) return j;
        }
        float lanes[8];
        memcpy(lanes, &top, sizeof lanes);
        best = lanes[0], at = where[0];
        for (int l = 1; l < 8; l++)
            if (lanes[l] > best || (lanes[l] == best && where[l] < at)) best = lanes[l], at = where[l];
    } else {
        i = 1;
        if (best != best) return 0;
    }
    for (; i < n; i++) {
        float xi = LOAD(x[i]);
        if (xi != xi) return i;
        if (xi > best) best = xi, at = i;
    }
    return at;
}

#undef ARGMAX_NAME
#undef T
#undef LOAD8
#undef LOAD
