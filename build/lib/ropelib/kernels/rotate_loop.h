/* The loop of rotate.c for one element type: rotate.c includes this
 * file once per type, with T (float or double) and NAME(x) (the name
 * of function x for that type) defined. */

/* Out of place, into fresh memory: write one byte of every page of
 * the output of tokens [from, to), so that their page faults come
 * together, before the arithmetic, and the rotation then writes pages
 * that are mapped and in the cache. */
static void NAME(touch_pages)(T *out, int64_t from, int64_t to,
                              int64_t token_stride) {
    volatile char *page = (volatile char *)(out + from * token_stride);
    volatile char *stop = (volatile char *)(out + to * token_stride);
    for (; page < stop; page += 4096) *page = 0;
}

/* One head of one token, "half" layout: the pair (x[i], x[r2 + i]). */
static void NAME(half_row)(const T *x, T *o, const T *c, const T *s,
                           T sign, int64_t r2) {
#pragma omp simd
    for (int64_t i = 0; i < r2; ++i) {
        const T a = x[i], b = x[r2 + i], si = sign * s[i];
        o[i] = a * c[i] - b * si;
        o[r2 + i] = b * c[i] + a * si;
    }
}

/* One head of one token, "interleaved": the pair (x[2i], x[2i + 1]). */
static void NAME(interleaved_row)(const T *x, T *o, const T *c,
                                  const T *s, T sign, int64_t r2) {
#pragma omp simd
    for (int64_t i = 0; i < r2; ++i) {
        const T a = x[2 * i], b = x[2 * i + 1], si = sign * s[i];
        o[2 * i] = a * c[i] - b * si;
        o[2 * i + 1] = b * c[i] + a * si;
    }
}

/* Tokens [t0, t1) of the flattened [B, S]; returns how many had a
 * position outside [0, L) (left unwritten). */
static int64_t NAME(tokens)(const struct geometry *g, const T *x, T *out,
                            const T *cos, const T *sin,
                            const int64_t *pos, int64_t t0, int64_t t1) {
    const T sign = g->conjugate ? (T)-1 : (T)1;
    int64_t bad = 0;
    for (int64_t t = t0; t < t1; ++t) {
        const int64_t b = t / g->seq, s = t % g->seq;
        if (g->touch > 0 && (t - t0) % g->touch == 0) {
            const int64_t end = t + g->touch < t1 ? t + g->touch : t1;
            NAME(touch_pages)(out, t, end, g->os);
        }
        const int64_t p = pos[b * g->pb + s * g->ps];
        if (p < 0 || p >= g->length) {
            ++bad;
            continue;
        }
        const T *c = cos + p * g->r2, *sn = sin + p * g->r2;
        for (int64_t h = 0; h < g->heads; ++h) {
            const T *xr = x + b * g->xb + s * g->xs + h * g->xh;
            T *orow = out + b * g->ob + s * g->os + h * g->oh;
            if (g->interleaved)
                NAME(interleaved_row)(xr, orow, c, sn, sign, g->r2);
            else
                NAME(half_row)(xr, orow, c, sn, sign, g->r2);
            if (orow != xr && 2 * g->r2 < g->dim) /* the rest */
                memcpy(orow + 2 * g->r2, xr + 2 * g->r2,
                       (size_t)(g->dim - 2 * g->r2) * sizeof(T));
        }
    }
    return bad;
}

/* The entry point: all tokens, split into `threads` contiguous runs,
 * one per OpenMP thread (without OpenMP: one run). */
int64_t NAME(ropelib_rotate)(const T *x, T *out, const T *cos,
                             const T *sin, const int64_t *pos,
                             const int64_t *shape, int64_t threads) {
    const struct geometry g = geometry_of(shape);
    const int64_t tokens = g.batch * g.seq;
    int64_t bad = 0;
    if (threads > tokens) threads = tokens;
    if (threads <= 1)
        return NAME(tokens)(&g, x, out, cos, sin, pos, 0, tokens);
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(+ : bad)
    {
        const int64_t n = omp_get_num_threads();
        const int64_t i = omp_get_thread_num();
        const int64_t step = (tokens + n - 1) / n, a = i * step;
        const int64_t e = a + step < tokens ? a + step : tokens;
        if (a < e) bad += NAME(tokens)(&g, x, out, cos, sin, pos, a, e);
    }
#else
    (void)threads;
    bad = NAME(tokens)(&g, x, out, cos, sin, pos, 0, tokens);
#endif
    return bad;
}
