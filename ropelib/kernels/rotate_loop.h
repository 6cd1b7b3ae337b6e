/* The loop of rotate.c for one storage type: rotate.c includes this
 * file once per type, with S (storage), C (compute), INDEX (an integer
 * of C's width), LOAD, STORE, VECTOR (1 when S is C: both layouts in
 * eights) and NAME(x) (the name of function x for that type) defined;
 * it undefines them at its end, for the next type. */

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

#if VECTOR
/* Eight features at once: the interleaved pairs need no shuffle across
 * them, only a swap within each pair, with the tables widened per
 * token to wc = (c0, c0, c1, c1, ...) and ws = (-s0, s0, -s1, s1, ...)
 * (ws negated for the inverse): o = x wc + swap(x) ws, each product
 * and the sum rounded, the same bits as the pairs' expression. */
typedef C NAME(eight) __attribute__((vector_size(8 * sizeof(C))));
typedef INDEX NAME(lanes) __attribute__((vector_size(8 * sizeof(C))));

static inline ROPELIB_INLINE void NAME(interleaved_wide)(
    const S *x, S *o, const C *wc, const C *ws, int64_t r) {
    int64_t j = 0;
    for (; j + 8 <= r; j += 8) {
        NAME(eight) v, c, s;
        memcpy(&v, x + j, sizeof v);
        memcpy(&c, wc + j, sizeof c);
        memcpy(&s, ws + j, sizeof s);
        const NAME(eight) w = SWAP_PAIRS(v, NAME(lanes));
        const NAME(eight) vc = v * c, wsn = w * s, out = vc + wsn;
        memcpy(o + j, &out, sizeof out);
    }
    for (; j < r; j += 2) { /* the pairs past the last eight */
        const C a = x[j], b = x[j + 1];
        const C ac = a * wc[j], bs = b * ws[j];
        const C bc = b * wc[j + 1], as = a * ws[j + 1];
        o[j] = ac + bs;
        o[j + 1] = bc + as;
    }
}
#endif

/* Prefetch the rotated features of the row ROPELIB_AHEAD heads on, in
 * cache lines (a hint: it never faults, even past the tensor, and
 * changes no result). The half layout reads each row as two streams,
 * x[i] and x[r2 + i], which the hardware prefetcher followed badly: in
 * place, beyond the L2 cache, one thread reached 66% of a plain scale's
 * bandwidth without the hint and 94% with it (interleaved: 94-95%). */
#define ROPELIB_AHEAD 2
static inline ROPELIB_INLINE void NAME(prefetch_row)(const S *row,
                                                     int64_t head,
                                                     int64_t r) {
    const uintptr_t p = (uintptr_t)row + (uintptr_t)(ROPELIB_AHEAD * head) *
                                             sizeof(S);
    for (int64_t l = 0; l < r * (int64_t)sizeof(S); l += 64)
        ROPELIB_PREFETCH((const void *)(p + (uintptr_t)l));
}

#if VECTOR
/* The "half" layout of one head in eights: a = x[j..j+8), b = x[r2 +
 * j..), the tables' eights *cv, *sv; each product rounded, then the sum,
 * as in ROPELIB_PAIR. */
static inline ROPELIB_INLINE void NAME(half_eight)(
    const S *xr, S *orow, int64_t ja, int64_t jb, const NAME(eight) *cv,
    const NAME(eight) *sv, const int inverse) {
    NAME(eight) a, b;
    memcpy(&a, xr + ja, sizeof a);
    memcpy(&b, xr + jb, sizeof b);
    const NAME(eight) ac = a * *cv, bs = b * *sv, bc = b * *cv, as = a * *sv;
    const NAME(eight) oa = inverse ? ac + bs : ac - bs;
    const NAME(eight) ob = inverse ? bc - as : bc + as;
    memcpy(orow + ja, &oa, sizeof oa);
    memcpy(orow + jb, &ob, sizeof ob);
}

/* All heads of a token, half layout, with r2 = 8 nv: the tables' eights
 * are loaded once per token and held (nv a constant after inlining). */
static inline ROPELIB_INLINE void NAME(half_heads)(
    const S *x, S *o, int64_t heads, int64_t x_head, int64_t o_head,
    const C *c, const C *s, const int nv, const int inverse) {
    NAME(eight) cv[8], sv[8];
    for (int j = 0; j < nv; ++j) {
        memcpy(&cv[j], c + 8 * j, sizeof cv[j]);
        memcpy(&sv[j], s + 8 * j, sizeof sv[j]);
    }
    for (int64_t h = 0; h < heads; ++h) {
        const S *xr = x + h * x_head;
        S *orow = o + h * o_head;
        for (int j = 0; j < nv; ++j)
            NAME(half_eight)(xr, orow, 8 * j, 8 * nv + 8 * j, &cv[j], &sv[j],
                             inverse);
        NAME(prefetch_row)(xr, x_head, 16 * nv);
    }
}
#endif

/* The heads of one token of one tensor (x, o at its head 0), in one
 * layout and direction: the loop the compiler vectorizes. ``wc``/``ws``:
 * the token's widened tables (interleaved, with VECTOR). */
static inline ROPELIB_INLINE void NAME(heads)(
    const S *x, S *o, int64_t heads, int64_t x_head, int64_t o_head,
    const C *c, const C *s, const C *wc, const C *ws, int64_t r2,
    int64_t dim, const int interleaved, const int inverse) {
    (void)wc;
    (void)ws;
#if VECTOR
    if (!interleaved && (r2 == 64 || r2 == 32 || r2 == 16)) {
        if (r2 == 64)
            NAME(half_heads)(x, o, heads, x_head, o_head, c, s, 8, inverse);
        else if (r2 == 32)
            NAME(half_heads)(x, o, heads, x_head, o_head, c, s, 4, inverse);
        else
            NAME(half_heads)(x, o, heads, x_head, o_head, c, s, 2, inverse);
        if (o != x && 2 * r2 < dim) /* out of place: copy the rest */
            for (int64_t h = 0; h < heads; ++h)
                memcpy(o + h * o_head + 2 * r2, x + h * x_head + 2 * r2,
                       (size_t)(dim - 2 * r2) * sizeof(S));
        return;
    }
#endif
    for (int64_t h = 0; h < heads; ++h) {
        const S *xr = x + h * x_head;
        S *orow = o + h * o_head;
        if (interleaved) {
#if VECTOR
            NAME(interleaved_wide)(xr, orow, wc, ws, 2 * r2);
#else
#pragma omp simd
            for (int64_t i = 0; i < r2; ++i) {
                const C a = LOAD(xr[2 * i]), b = LOAD(xr[2 * i + 1]);
                ROPELIB_PAIR(a, b, c[i], s[i], inverse, orow[2 * i],
                             orow[2 * i + 1]);
            }
#endif
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
        NAME(prefetch_row)(xr, x_head, 2 * r2);
    }
}

/* v of one token into its cache slot (v, o at head 0): heads rows of
 * v_dim values. */
static inline void NAME(copy_heads)(const S *v, S *o, int64_t heads,
                                    int64_t v_head, int64_t o_head,
                                    int64_t v_dim) {
    for (int64_t h = 0; h < heads; ++h)
        memcpy(o + h * o_head, v + h * v_head, (size_t)v_dim * sizeof(S));
}

/* Where token (b, s)'s key goes: k_out at (b, s) without a slot
 * mapping; else its cache slot, with v copied there, or NULL for
 * padding (*bad counts a slot past the cache, also left unwritten). */
static inline ROPELIB_INLINE S *NAME(key_row)(const struct call *g,
                                              int64_t b, int64_t s,
                                              int64_t *bad) {
    S *k_out = (S *)g->k_out;
    if (!g->slots) return k_out + b * g->kob + s * g->kos;
    const int64_t slot = g->slots[b * g->sb + s * g->ss];
    if (slot < 0) return NULL;
    if (slot >= g->num_slots) {
        ++*bad;
        return NULL;
    }
    const int64_t block = slot / g->block_size, row = slot % g->block_size;
    NAME(copy_heads)((const S *)g->v + b * g->vb + s * g->vs,
                     (S *)g->v_out + block * g->vob + row * g->vos,
                     g->k_heads, g->vh, g->voh, g->v_dim);
    return k_out + block * g->kob + row * g->kos;
}

/* Tokens [t0, t1) of the flattened [B, S] in one layout and direction,
 * rotating q, k or both (`which`); returns how many had a position
 * outside [0, L) or a slot past the cache (left unwritten). */
static inline ROPELIB_INLINE int64_t NAME(tokens_in)(
    const struct call *g, int64_t t0, int64_t t1, const int interleaved,
    const int inverse, const int which) {
    const C *cos = (const C *)g->cos, *sin = (const C *)g->sin;
    const S *q = (const S *)g->q, *k = (const S *)g->k;
    S *q_out = (S *)g->q_out, *k_out = (S *)g->k_out;
    const int cached = g->slots != NULL; /* k_out is a cache, not fresh */
    const int64_t r2 = g->r2, dim = g->dim, seq = g->seq;
    C wc[VECTOR ? 2 * r2 : 1], ws[VECTOR ? 2 * r2 : 1]; /* widened rows */
    int64_t bad = 0;
    for (int64_t t = t0; t < t1; ++t) {
        const int64_t b = t / seq, s = t % seq;
        if (g->touch > 0 && (t - t0) % g->touch == 0) {
            const int64_t end = t + g->touch < t1 ? t + g->touch : t1;
            if ((which & PASS_Q) && g->q_heads > 0)
                NAME(touch_pages)(q_out, t, end, g->qos);
            if ((which & PASS_K) && g->k_heads > 0 && !cached)
                NAME(touch_pages)(k_out, t, end, g->kos);
        }
        const int64_t p = g->pos[b * g->pb + s * g->ps];
        if (p < 0 || p >= g->length) {
            bad += (which & PASS_Q) != 0; /* counted once per token */
            continue;
        }
        const C *c = cos + p * r2, *sn = sin + p * r2;
        if (interleaved && VECTOR)
            for (int64_t i = 0; i < r2; ++i) {
                wc[2 * i] = wc[2 * i + 1] = c[i];
                ws[2 * i] = inverse ? sn[i] : -sn[i];
                ws[2 * i + 1] = inverse ? -sn[i] : sn[i];
            }
        if (which & PASS_Q)
            NAME(heads)(q + b * g->qb + s * g->qs,
                        q_out + b * g->qob + s * g->qos, g->q_heads, g->qh,
                        g->qoh, c, sn, wc, ws, r2, dim, interleaved,
                        inverse);
        if (!(which & PASS_K)) continue;
        S *k_row = NAME(key_row)(g, b, s, &bad);
        if (k_row)
            NAME(heads)(k + b * g->kb + s * g->ks, k_row, g->k_heads,
                        g->kh, g->koh, c, sn, wc, ws, r2, dim,
                        interleaved, inverse);
    }
    return bad;
}

/* A thread's tokens: all of q, then all of k (two long streams, which
 * ran faster than q and k by turns), or both in one pass when k and v
 * go to a cache. */
static inline ROPELIB_INLINE int64_t NAME(passes)(
    const struct call *g, int64_t t0, int64_t t1, const int interleaved,
    const int inverse) {
    if (g->slots)
        return NAME(tokens_in)(g, t0, t1, interleaved, inverse, PASS_BOTH);
    return NAME(tokens_in)(g, t0, t1, interleaved, inverse, PASS_Q) +
           NAME(tokens_in)(g, t0, t1, interleaved, inverse, PASS_K);
}

/* The passes for the call's layout and direction, each its own loop. */
static int64_t NAME(tokens)(const struct call *g, int64_t t0, int64_t t1) {
    if (g->interleaved)
        return g->conjugate ? NAME(passes)(g, t0, t1, 1, 1)
                            : NAME(passes)(g, t0, t1, 1, 0);
    return g->conjugate ? NAME(passes)(g, t0, t1, 0, 1)
                        : NAME(passes)(g, t0, t1, 0, 0);
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

#undef S
#undef C
#undef INDEX
#undef LOAD
#undef STORE
#undef VECTOR
#undef ROPELIB_AHEAD
#undef NAME
