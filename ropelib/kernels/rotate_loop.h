/* The loop of rotate.c for one storage type: rotate.c includes this
 * file once per type, with S (storage), C (compute), LOAD, STORE and
 * NAME(x) (the name of function x for that type) defined. */

/* Out of place, into fresh memory: write one byte of every page of
 * the output of tokens [from, to), so that their page faults come
 * together, before the arithmetic, and the rotation then writes pages
 * that are mapped and in the cache. */
static void NAME(touch_pages)(S *out, int64_t from, int64_t to,
                              int64_t token_stride) {
    volatile char *page = (volatile char *)(out + from * token_stride);
    volatile char *stop = (volatile char *)(out + to * token_stride);
    for (; page < stop; page += 4096) *page = 0;
}

/* One pair, both members: (a, b) -> (a c - b s, b c + a s), or with
 * sin negated (the inverse rotation) (a c + b s, b c - a s), exactly. */
#define ROPELIB_PAIR(a, b, c, s, inverse, out_a, out_b)        \
    do {                                                      \
        const C ac_ = (a) * (c), bs_ = (b) * (s);             \
        const C bc_ = (b) * (c), as_ = (a) * (s);             \
        (out_a) = STORE((inverse) ? ac_ + bs_ : ac_ - bs_);   \
        (out_b) = STORE((inverse) ? bc_ - as_ : bc_ + as_);   \
    } while (0)

/* The heads of one token of one tensor (x, o at its head 0), in one
 * layout and direction: the loop the compiler vectorizes. */
static inline ROPELIB_INLINE void NAME(heads)(
    const S *x, S *o, int64_t heads, int64_t x_head, int64_t o_head,
    const C *c, const C *s, int64_t r2, int64_t dim,
    const int interleaved, const int inverse) {
    for (int64_t h = 0; h < heads; ++h) {
        const S *xr = x + h * x_head;
        S *orow = o + h * o_head;
        if (interleaved) {
#pragma omp simd
            for (int64_t i = 0; i < r2; ++i) {
                const C a = LOAD(xr[2 * i]), b = LOAD(xr[2 * i + 1]);
                ROPELIB_PAIR(a, b, c[i], s[i], inverse, orow[2 * i],
                             orow[2 * i + 1]);
            }
        } else {
#pragma omp simd
            for (int64_t i = 0; i < r2; ++i) {
                const C a = LOAD(xr[i]), b = LOAD(xr[r2 + i]);
                ROPELIB_PAIR(a, b, c[i], s[i], inverse, orow[i],
                             orow[r2 + i]);
            }
        }
        if (orow != xr && 2 * r2 < dim) /* out of place: copy the rest */
            memcpy(orow + 2 * r2, xr + 2 * r2,
                   (size_t)(dim - 2 * r2) * sizeof(S));
    }
}

/* Tokens [t0, t1) of the flattened [B, S] in one layout and direction;
 * returns how many had a position outside [0, L) (left unwritten). */
static inline ROPELIB_INLINE int64_t NAME(tokens_in)(
    const struct call *g, int64_t t0, int64_t t1, const int interleaved,
    const int inverse) {
    const C *cos = (const C *)g->cos, *sin = (const C *)g->sin;
    const S *q = (const S *)g->q, *k = (const S *)g->k;
    S *q_out = (S *)g->q_out, *k_out = (S *)g->k_out;
    const int64_t r2 = g->r2, dim = g->dim, seq = g->seq;
    int64_t bad = 0;
    for (int64_t t = t0; t < t1; ++t) {
        const int64_t b = t / seq, s = t % seq;
        if (g->touch > 0 && (t - t0) % g->touch == 0) {
            const int64_t end = t + g->touch < t1 ? t + g->touch : t1;
            if (g->q_heads > 0) NAME(touch_pages)(q_out, t, end, g->qos);
            if (g->k_heads > 0) NAME(touch_pages)(k_out, t, end, g->kos);
        }
        const int64_t p = g->pos[b * g->pb + s * g->ps];
        if (p < 0 || p >= g->length) {
            ++bad;
            continue;
        }
        const C *c = cos + p * r2, *sn = sin + p * r2;
        NAME(heads)(q + b * g->qb + s * g->qs,
                    q_out + b * g->qob + s * g->qos, g->q_heads, g->qh,
                    g->qoh, c, sn, r2, dim, interleaved, inverse);
        NAME(heads)(k + b * g->kb + s * g->ks,
                    k_out + b * g->kob + s * g->kos, g->k_heads, g->kh,
                    g->koh, c, sn, r2, dim, interleaved, inverse);
    }
    return bad;
}

/* tokens_in for the call's layout and direction, each its own loop. */
static int64_t NAME(tokens)(const struct call *g, int64_t t0, int64_t t1) {
    if (g->interleaved)
        return g->conjugate ? NAME(tokens_in)(g, t0, t1, 1, 1)
                            : NAME(tokens_in)(g, t0, t1, 1, 0);
    return g->conjugate ? NAME(tokens_in)(g, t0, t1, 0, 1)
                        : NAME(tokens_in)(g, t0, t1, 0, 0);
}

/* The entry point: all tokens, split into `threads` contiguous runs,
 * one per OpenMP thread (without OpenMP: one run). Returns -1 for a
 * call of another ABI, else the number of tokens left unwritten. */
int64_t NAME(ropelib_rotate)(const struct call *g) {
    if (g->abi != ROPELIB_ABI) return -1;
    const int64_t tokens = g->batch * g->seq;
    int64_t threads = g->threads < tokens ? g->threads : tokens;
    int64_t bad = 0;
    if (threads <= 1) return NAME(tokens)(g, 0, tokens);
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(+ : bad)
    {
        const int64_t n = omp_get_num_threads();
        const int64_t i = omp_get_thread_num();
        const int64_t step = (tokens + n - 1) / n, a = i * step;
        const int64_t e = a + step < tokens ? a + step : tokens;
        if (a < e) bad += NAME(tokens)(g, a, e);
    }
#else
    bad = NAME(tokens)(g, 0, tokens);
#endif
    return bad;
}
