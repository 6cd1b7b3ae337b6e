/* The native kernel of ropelib (ropelib/kernels/native_kernel.py): one
 * pass over q and k, in place or into new outputs, either layout.
 *
 * q, k and their outputs are [B, S, H, D] with unit stride on D and the
 * strides given for B, S and H (in elements); k may have no heads. cos
 * and sin are contiguous [L, r2] tables in the compute type (float for
 * float16, bfloat16 and float32, double for float64); pos is int64
 * [B, S] with the strides given (0 for a broadcast). The first r = 2 r2
 * features of each head are rotated pair by pair,
 *
 *   "half"         (a, b) = (x[i], x[r2 + i])
 *   "interleaved"  (a, b) = (x[2i], x[2i + 1])
 *   (a, b) -> (a c - b s, b c + a s),  c = cos[p, i],  s = sign sin[p, i]
 *
 * with sign = -1 for the inverse rotation (conjugate). Both halves of a
 * pair are read before either is written, so an output may be its
 * input; out of place, features r..D are copied.
 *
 * Rounding: each product is rounded, then the sum, in the compute type
 * (the build passes -ffp-contract=off: no fused multiply-add), and the
 * result is rounded once to the storage type, to nearest even. That is
 * exactly what the PyTorch kernel computes, so the two agree bit for
 * bit. float16 and bfloat16 are converted as PyTorch converts them.
 *
 * Threads: the tokens are split into runs, one per OpenMP thread, each
 * rotating its tokens' q and then their k; in a
 * process that has imported torch the library shares torch's OpenMP
 * runtime. A token whose position is outside [0, L) is left unwritten
 * and counted, and the count returned (the caller checks first).
 *
 * With a slot mapping (struct call's slots), k is rotated into the key
 * cache at each token's slot and v copied into the value cache beside
 * it, in the same pass (vLLM's reshape_and_cache with the rotation).
 */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Bumped whenever struct call changes: Python checks it on loading. */
#define ROPELIB_ABI 4

/* One call: native_kernel.Call mirrors this field by field. */
struct call {
    int64_t abi;
    void *q, *k, *q_out, *k_out;
    const void *cos, *sin;
    const int64_t *pos;
    int64_t batch, seq, dim, r2, length, q_heads, k_heads;
    int64_t qb, qs, qh, kb, ks, kh;     /* input strides */
    int64_t qob, qos, qoh, kob, kos, koh; /* output strides */
    int64_t pb, ps;                     /* position strides */
    int64_t interleaved, conjugate;
    int64_t touch;   /* tokens per run of page touching (0: none) */
    int64_t threads;
    /* The key/value-cache write; slots NULL: none. Otherwise k_out is
     * the key cache [blocks, block_size, k_heads, dim] with strides
     * kob, kos, koh (block, row, head), v_out the value cache with vob,
     * vos, voh, and token (b, s) goes to slot slots[b sb + s ss]: block
     * slot / block_size, row slot % block_size; v [B, S, k_heads, v_dim]
     * (strides vb, vs, vh) is copied there. A negative slot is padding,
     * not written; one >= num_slots is not written either, and counted. */
    const int64_t *slots;
    const void *v;
    void *v_out;
    int64_t v_dim, block_size, num_slots;
    int64_t vb, vs, vh, vob, vos, voh;
    int64_t sb, ss;
};

int64_t ropelib_abi(void) { return ROPELIB_ABI; }
int64_t ropelib_call_size(void) { return (int64_t)sizeof(struct call); }

static inline float bits_to_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t float_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* bfloat16 <-> float, as c10::BFloat16 converts (NaN -> 0x7FC0). */
static inline float bf16_load(uint16_t h) {
    return bits_to_float((uint32_t)h << 16);
}

static inline uint16_t bf16_store(float f) {
    const uint32_t u = float_to_bits(f);
    const uint32_t even = ((u >> 16) & 1u) + 0x7FFFu;
    return f != f ? (uint16_t)0x7FC0u : (uint16_t)((u + even) >> 16);
}

/* float16 <-> float, as c10::Half converts (fp16_ieee_*_fp32_value). */
static inline float f16_load(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const float normal = bits_to_float((two_w >> 4) + (0xE0u << 23)) *
                         0x1.0p-112f;
    const float subnormal =
        bits_to_float((two_w >> 17) | (126u << 23)) - 0.5f;
    const uint32_t magnitude = two_w < (1u << 27) ? float_to_bits(subnormal)
                                                  : float_to_bits(normal);
    return bits_to_float(sign | magnitude);
}

static inline uint16_t f16_store(float f) {
    const uint32_t w = float_to_bits(f), shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    bias = bias < 0x71000000u ? 0x71000000u : bias;
    const float abs_f = bits_to_float(w & 0x7FFFFFFFu);
    float base = (abs_f * 0x1.0p+112f) * 0x1.0p-110f;
    base = bits_to_float((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = float_to_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
    return (uint16_t)((sign >> 16) |
                      (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

/* Which tensors a pass over the tokens rotates (rotate_loop.h). */
enum { PASS_Q = 1, PASS_K = 2, PASS_BOTH = 3 };

/* The loops are specialised per layout and direction by inlining with
 * constant flags. */
#if defined(__GNUC__)
#define ROPELIB_INLINE __attribute__((always_inline))
#define ROPELIB_PREFETCH(address) __builtin_prefetch((address), 0, 3)
#else
#define ROPELIB_INLINE
#define ROPELIB_PREFETCH(address) ((void)(address))
#endif

/* Vectors of eight compute values for both layouts (float32, float64): with
 * clang or GCC 12 (__builtin_shufflevector) or an older GCC
 * (__builtin_shuffle); other compilers take the pairs one by one. */
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define ROPELIB_VECTORS 1
#define SWAP_PAIRS(v, mask) __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6)
#elif defined(__GNUC__)
#define ROPELIB_VECTORS 1
#define SWAP_PAIRS(v, mask) __builtin_shuffle(v, (mask){1, 0, 3, 2, 5, 4, 7, 6})
#else
#define ROPELIB_VECTORS 0
#endif

/* The loop, once per storage type S and compute type C. */
#define S float
#define C float
#define INDEX int32_t
#define LOAD(v) (v)
#define STORE(v) (v)
#define VECTOR ROPELIB_VECTORS
#define NAME(x) x##_f32
#include "rotate_loop.h" /* which undefines them */

#define S double
#define C double
#define INDEX int64_t
#define LOAD(v) (v)
#define STORE(v) (v)
#define VECTOR ROPELIB_VECTORS
#define NAME(x) x##_f64
#include "rotate_loop.h" /* which undefines them */

#define S uint16_t
#define C float
#define INDEX int32_t
#define LOAD(v) bf16_load(v)
#define STORE(v) bf16_store(v)
#define VECTOR 0
#define NAME(x) x##_bf16
#include "rotate_loop.h" /* which undefines them */

#define S uint16_t
#define C float
#define INDEX int32_t
#define LOAD(v) f16_load(v)
#define STORE(v) f16_store(v)
#define VECTOR 0
#define NAME(x) x##_f16
#include "rotate_loop.h" /* which undefines them */
