/* The rotation of ropelib.kernels.native_kernel: one pass over x, in place or into out.
 *
 * x, out: [B, S, H, D] with unit stride on D and the strides given for B, S and H (elements);
 * cos, sin: contiguous [L, r/2]; pos: int64 [B, S] with the strides given (0 for a broadcast).
 * Tokens t0 <= t < t1 of the flattened B * S are done, so that callers split the work between
 * threads. The first r = 2 * r2 features are rotated, pair by pair:
 *
 *   "half"        (a, b) = (x[i], x[r2 + i])
 *   "interleaved" (a, b) = (x[2 i], x[2 i + 1])
 *   (a, b) -> (a c - b s, b c + a s),  c = cos[p, i],  s = sign * sin[p, i]
 *
 * with sign = -1 for the inverse rotation (conjugate). Both halves of a pair are read before
 * either is written, so out may be x (in place). Out of place, features r..D are copied.
 * ropelib_rotate_{f32,f64}_threads(..., threads) splits the tokens into `threads` runs, one per
 * OpenMP thread. Loaded into a process that has imported torch, the library shares torch's OpenMP
 * runtime (the same libgomp.so.1), so its threads are torch's own, not a second pool.
 *
 * A token whose position is outside [0, L) is left unwritten and counted; the count is returned
 * (callers validate positions first, so it is 0 unless that contract was broken).
 *
 * touch > 0 (out a fresh, contiguous tensor): before each run of `touch` tokens, one byte of every
 * page of their output is written, so that the page faults of fresh memory come together and the
 * rotation then writes pages that are mapped and in the cache (about 10% faster than faulting
 * page by page in the middle of the arithmetic).
 */
#include <stdint.h>
#include <string.h>

#define ROTATE(NAME, T)                                                                              \
    int64_t NAME(const T *x, T *out, const T *cos, const T *sin, const int64_t *pos, int64_t seq,   \
                 int64_t heads, int64_t dim, int64_t r2, int64_t length, int64_t xb, int64_t xs,     \
                 int64_t xh, int64_t ob, int64_t os, int64_t oh, int64_t pb, int64_t ps,             \
                 int64_t t0, int64_t t1, int interleaved, int conjugate, int64_t touch) {            \
        const T sign = conjugate ? (T)-1 : (T)1;                                                     \
        int64_t bad = 0;                                                                             \
        for (int64_t t = t0; t < t1; ++t) {                                                          \
            const int64_t b = t / seq, s = t % seq;                                                  \
            if (touch > 0 && (t - t0) % touch == 0) {                                                \
                const int64_t end = t + touch < t1 ? t + touch : t1;                                 \
                volatile char *page = (volatile char *)(out + t * os);                               \
                volatile char *stop = (volatile char *)(out + end * os);                             \
                for (; page < stop; page += 4096) *page = 0;                                         \
            }                                                                                        \
            const int64_t p = pos[b * pb + s * ps];                                                  \
            if (p < 0 || p >= length) {                                                              \
                ++bad;                                                                               \
                continue;                                                                            \
            }                                                                                        \
            const T *c = cos + p * r2, *sn = sin + p * r2;                                           \
            for (int64_t h = 0; h < heads; ++h) {                                                    \
                const T *xr = x + b * xb + s * xs + h * xh;                                          \
                T *orow = out + b * ob + s * os + h * oh;                                            \
                if (interleaved) {                                                                   \
                    _Pragma("omp simd") for (int64_t i = 0; i < r2; ++i) {                           \
                        const T a = xr[2 * i], bb = xr[2 * i + 1], si = sign * sn[i];                \
                        orow[2 * i] = a * c[i] - bb * si;                                            \
                        orow[2 * i + 1] = bb * c[i] + a * si;                                        \
                    }                                                                                \
                } else {                                                                             \
                    _Pragma("omp simd") for (int64_t i = 0; i < r2; ++i) {                           \
                        const T a = xr[i], bb = xr[r2 + i], si = sign * sn[i];                       \
                        orow[i] = a * c[i] - bb * si;                                                \
                        orow[r2 + i] = bb * c[i] + a * si;                                           \
                    }                                                                                \
                }                                                                                    \
                if (orow != xr && 2 * r2 < dim)                                                      \
                    memcpy(orow + 2 * r2, xr + 2 * r2, (size_t)(dim - 2 * r2) * sizeof(T));          \
            }                                                                                        \
        }                                                                                            \
        return bad;                                                                                  \
    }

/* The tokens t0 <= t < t1 in `threads` contiguous runs, one per OpenMP thread (compiled without
 * OpenMP: one run, in the caller's thread). */
#ifdef _OPENMP
#include <omp.h>
#define PARALLEL(NAME, BODY, T)                                                                      \
    int64_t NAME(const T *x, T *out, const T *cos, const T *sin, const int64_t *pos, int64_t seq,   \
                 int64_t heads, int64_t dim, int64_t r2, int64_t length, int64_t xb, int64_t xs,     \
                 int64_t xh, int64_t ob, int64_t os, int64_t oh, int64_t pb, int64_t ps,             \
                 int64_t t0, int64_t t1, int interleaved, int conjugate, int64_t touch,              \
                 int64_t threads) {                                                                  \
        int64_t bad = 0;                                                                             \
        if (threads > t1 - t0) threads = t1 - t0;                                                    \
        if (threads <= 1)                                                                            \
            return BODY(x, out, cos, sin, pos, seq, heads, dim, r2, length, xb, xs, xh, ob, os, oh,  \
                        pb, ps, t0, t1, interleaved, conjugate, touch);                              \
        _Pragma("omp parallel num_threads(threads) reduction(+ : bad)") {                            \
            const int64_t n = omp_get_num_threads(), i = omp_get_thread_num();                       \
            const int64_t step = (t1 - t0 + n - 1) / n, a = t0 + i * step;                           \
            const int64_t b = a + step < t1 ? a + step : t1;                                         \
            if (a < b)                                                                               \
                bad += BODY(x, out, cos, sin, pos, seq, heads, dim, r2, length, xb, xs, xh, ob, os,  \
                            oh, pb, ps, a, b, interleaved, conjugate, touch);                        \
        }                                                                                            \
        return bad;                                                                                  \
    }
#else
#define PARALLEL(NAME, BODY, T)                                                                      \
    int64_t NAME(const T *x, T *out, const T *cos, const T *sin, const int64_t *pos, int64_t seq,   \
                 int64_t heads, int64_t dim, int64_t r2, int64_t length, int64_t xb, int64_t xs,     \
                 int64_t xh, int64_t ob, int64_t os, int64_t oh, int64_t pb, int64_t ps,             \
                 int64_t t0, int64_t t1, int interleaved, int conjugate, int64_t touch,              \
                 int64_t threads) {                                                                  \
        (void)threads;                                                                               \
        return BODY(x, out, cos, sin, pos, seq, heads, dim, r2, length, xb, xs, xh, ob, os, oh, pb,  \
                    ps, t0, t1, interleaved, conjugate, touch);                                      \
    }
#endif

/* A few tokens at one position (decoding): nq rows of q and nk rows of k, each `dim` contiguous
 * features, all rotated by one row of the wide tables (Hugging Face's form): cw = cat(c, c) and
 * sw = cat(-s, s), so that in the "half" layout o[i] = x[i] cw[i] + x[(i + dim/2) % dim] sw[i].
 * One call for q and k, with few arguments: at this size the cost of a call is its overhead. */
void ropelib_rotate_rows_f32(const float *xq, float *oq, int64_t nq, const float *xk, float *ok,
                             int64_t nk, const float *cw, const float *sw, int64_t dim) {
    const int64_t half = dim / 2;
    for (int64_t row = 0; row < nq + nk; ++row) {
        const float *x = row < nq ? xq + row * dim : xk + (row - nq) * dim;
        float *o = row < nq ? oq + row * dim : ok + (row - nq) * dim;
        _Pragma("omp simd") for (int64_t i = 0; i < half; ++i) {
            o[i] = x[i] * cw[i] + x[half + i] * sw[i];
            o[half + i] = x[half + i] * cw[half + i] + x[i] * sw[half + i];
        }
    }
}

ROTATE(ropelib_rotate_f32, float)
ROTATE(ropelib_rotate_f64, double)
PARALLEL(ropelib_rotate_f32_threads, ropelib_rotate_f32, float)
PARALLEL(ropelib_rotate_f64_threads, ropelib_rotate_f64, double)
