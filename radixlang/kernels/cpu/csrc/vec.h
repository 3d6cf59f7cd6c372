/* Vector helpers shared by radixlang's kernels (cpu_ops.c, moe.c, quant_ops.c): 16-float vectors on GCC/Clang
 * vector types, which the compiler lowers to one zmm register with AVX-512 and two ymm with AVX2
 * (-march=native picks), loads and stores, horizontal sums, and exp. */
#ifndef RL_VEC_H
#define RL_VEC_H

#include <stdint.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

/* unaligned 16-float loads and stores (memcpy is how C spells them; it compiles to one instruction) */
static inline v16f load16(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, v16f v) { memcpy(p, &v, sizeof v); }

static inline float hsum16(v16f v) {
    float s = 0.0f;
    for (int j = 0; j < 16; j++) s += v[j];
    return s;
}

/* sixteen 16-lane vectors -> one vector whose lane i is the sum of v[i]: a transposing tree of
 * shuffles and adds (45 operations where sixteen separate horizontal sums take ~130) */
#if defined(__clang__)
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (v16i){__VA_ARGS__})
#endif
static inline v16f hsum16x16(v16f *v) {
    v16f h[8], q[4], e[2];
    for (int p = 0; p < 8; p++)  /* lanes 0-7: key 2p (two halves added), 8-15: key 2p + 1 */
        h[p] = SHUF(v[2 * p], v[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + SHUF(v[2 * p], v[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int p = 0; p < 4; p++)  /* four lanes per key */
        q[p] = SHUF(h[2 * p], h[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + SHUF(h[2 * p], h[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int p = 0; p < 2; p++)  /* two lanes per key */
        e[p] = SHUF(q[2 * p], q[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + SHUF(q[2 * p], q[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SHUF(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + SHUF(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* exp(x) for the softmax and SiLU: 2^k * exp(r) with r = x - k ln2 (ln2 split in two for precision)
 * and a degree-6 polynomial for exp(r) on |r| <= ln2/2 (Cephes' coefficients); relative error ~2e-7.
 * Inputs are clamped to [-87, 88], so exp of a very negative number is ~1e-38 rather than 0.
 * Written on GCC/Clang vector types, 16 floats at a time, because the compiler does not vectorize
 * the float-to-bits step of a scalar version; rl_exp_n applies it to an array. */
static inline v16f rl_exp16(v16f x) {
    const v16f lo = (v16f){0} - 87.0f, hi = (v16f){0} + 88.0f;
    v16i below = x < lo, above = x > hi;
    x = (v16f)((below & (v16i)lo) | (above & (v16i)hi) | (~(below | above) & (v16i)x));
    v16f y = x * 1.44269504088896341f + 0.5f;
    v16i k = __builtin_convertvector(y, v16i);  /* truncates: step down where y < 0 to get floor */
    k += (v16i)(__builtin_convertvector(k, v16f) > y);
    v16f kf = __builtin_convertvector(k, v16f);
    v16f r = x - kf * 0.693359375f + kf * 2.12194440e-4f;
    v16f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    v16f e = p * r * r + r + 1.0f;
    return e * (v16f)((k + 127) << 23);
}

static inline float rl_exp(float x) {
    v16f v = (v16f){0} + x;
    return rl_exp16(v)[0];
}

/* SwiGLU's activation silu(g) * u = g / (1 + exp(-g)) * u, 16 lanes at a time */
static inline v16f silu_mul16(v16f g, v16f u) { return g / (1.0f + rl_exp16(-g)) * u; }

/* o[j] = silu(g[j]) * u[j] for j < n */
static inline void silu_mul_row(const float *g, const float *u, float *o, int64_t n) {
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) store16(o + j, silu_mul16(load16(g + j), load16(u + j)));
    for (; j < n; j++) o[j] = g[j] / (1.0f + rl_exp(-g[j])) * u[j];
}

#endif
