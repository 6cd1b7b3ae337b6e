/* The rotation of ropelib.kernels.native_kernel: one pass over x, in
 * place or into out, in either layout.
 *
 * x, out: [B, S, H, D], unit stride on D, the strides given for B, S, H
 * (in elements); cos, sin: contiguous [L, r/2]; pos: int64 [B, S] with
 * the strides given (0 for a broadcast). The first r = 2 r2 features of
 * each head are rotated pair by pair,
 *
 *   "half"         (a, b) = (x[i], x[r2 + i])
 *   "interleaved"  (a, b) = (x[2i], x[2i + 1])
 *   (a, b) -> (a c - b s, b c + a s),  c = cos[p, i],  s = sign sin[p, i]
 *
 * with sign = -1 for the inverse rotation (conjugate). Both halves of a
 * pair are read before either is written, so out may be x (in place);
 * out of place, features r..D are copied. The loop is rotate_loop.h,
 * included below for float and for double.
 *
 * Threads: the tokens are split into runs, one per OpenMP thread. In a
 * process that has imported torch the library shares torch's OpenMP
 * runtime (the same libgomp.so.1): its threads are torch's own.
 *
 * A token whose position is outside [0, L) is left unwritten and
 * counted, and the count returned (callers check positions first, so
 * it is 0 unless that contract was broken).
 */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* The sizes, strides and flags of a call: `shape` holds them in this
 * order (ropelib.kernels.native_kernel.GEOMETRY). */
struct geometry {
    int64_t batch, seq, heads, dim, r2, length;
    int64_t xb, xs, xh, ob, os, oh, pb, ps;
    int64_t interleaved, conjugate, touch;
};

static struct geometry geometry_of(const int64_t *v) {
    struct geometry g = {v[0],  v[1],  v[2],  v[3],  v[4],  v[5],
                         v[6],  v[7],  v[8],  v[9],  v[10], v[11],
                         v[12], v[13], v[14], v[15], v[16]};
    return g;
}

#define T float
#define NAME(x) x##_f32
#include "rotate_loop.h"
#undef T
#undef NAME

#define T double
#define NAME(x) x##_f64
#include "rotate_loop.h"
#undef T
#undef NAME

/* A few tokens at one position (decoding): nq rows of q and nk rows of
 * k, `dim` contiguous features each, rotated by one row of the wide
 * tables (Hugging Face's form) cw = cat(c, c) and sw = cat(-s, s):
 * o[i] = x[i] cw[i] + x[(i + dim/2) % dim] sw[i], "half" layout. One
 * call for q and k with few arguments: at this size the cost of a call
 * is its overhead. */
void ropelib_rotate_rows_f32(const float *xq, float *oq, int64_t nq,
                             const float *xk, float *ok, int64_t nk,
                             const float *cw, const float *sw,
                             int64_t dim) {
    const int64_t half = dim / 2;
    for (int64_t row = 0; row < nq + nk; ++row) {
        const float *x = row < nq ? xq + row * dim : xk + (row - nq) * dim;
        float *o = row < nq ? oq + row * dim : ok + (row - nq) * dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
            o[i] = x[i] * cw[i] + x[half + i] * sw[i];
            o[half + i] = x[half + i] * cw[half + i] + x[i] * sw[half + i];
        }
    }
}
