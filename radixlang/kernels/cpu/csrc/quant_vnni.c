/* radixlang's quantized linears with int8 activations: integer dot products (VNNI) over the codes of
 * quant_ops.c's q4 and q8 layouts (see there), for the few rows of a decode step.
 *
 * Built on first use like quant_ops.c (-O3 -march=native): with AVX512-VNNI (+BW, VL) each instruction
 * (vpdpbusd) multiplies 64 unsigned bytes by 64 signed bytes and adds each 4 products into one of 16
 * int32 lanes; with AVX-VNNI (AVX2 machines) the same on 32 bytes. Without either, rl_vnni_level()
 * says 0 and quant.py keeps the float32 kernels of quant_ops.c.
 *
 * Each row of x is first quantized per group of A = 32 values (16 where K is not a multiple of 32) to
 * int8, symmetrically: xs = max|x| / 127, u = x / xs in [-127, 127], q1 = round(u), so that
 * |x - xs * q1| <= xs / 2. With a weight q * s + o per weight group of G, the output feature n is
 *     y[n] = sum over 4-weight lanes l of  s_l * xs_l * dot_i32(q_l, q1_l)  +  sum over groups g of o_g * X_g
 * where X_g is the float32 sum of x over the group (exact up to float32 rounding, not quantized).
 * That is one pass, llama.cpp's way. Its error is up to 1/254 of the group's largest |x| per value; a
 * group holding one of a model's outlier activations (SmolLM2's reach 30x the group mean) loses most of
 * its other values that way. So x can also be taken in two or three passes: q2 = round(128 (u - q1)) in
 * [-64, 64], q3 = round(128 (128 (u - q1) - q2)), u ~ q1 + q2 / 128 + q3 / 128^2, each pass one more
 * vpdpbusd into the same int32 lanes after a shift left by 7. The error per value is then at most
 * xs / 2 / 128^(passes - 1): about 15 and 22 significant bits.
 * q4 codes (0..15) are the unsigned operand as they are. q8 codes are signed: they enter as q + 128
 * (one xor), and the extra 128 * sum(q_k) of each lane and pass is taken off: the first two passes' by
 * starting the accumulator at -128 sum(q1) - sum(q2), the third's by one subtraction. The integer
 * dots are exact and stay within int32 (per lane |sum q q1| <= 4 x 128 x 127, times 128^2 < 2^31); the
 * error against the float32 kernel is the activation rounding (and float32's own, once per lane).
 *
 * Rows are taken four at a time, so a chunk of codes is unpacked once for four rows; each thread owns
 * a range of output features. The weight scales are expanded to the 16 (or 8) lanes of a vector.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moe_pairs.h"
#include "vec.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RL_VNNI 2
#elif defined(__AVXVNNI__) && defined(__AVX2__) && defined(__FMA__)
#define RL_VNNI 1
#else
#define RL_VNNI 0
#endif

/* 2: AVX512-VNNI, 1: AVX-VNNI, 0: none (the functions below then do nothing and return -1) */
int rl_vnni_level(void) { return RL_VNNI; }

/* One call's quantized activations, each row padded with zeros to Kp (a multiple of 64) values. */
typedef struct {
    int64_t Kp, Gp;  /* padded K; weight groups per row padded to a multiple of 16 */
    int8_t *xq[3];   /* [M, Kp] the codes of each pass */
    float *xs;       /* [M, Kp / 4] the scale of each 4-value lane, divided by 128^(passes - 1) */
    float *sum;      /* [M, Gp] the float32 sum of x over each weight group */
    int32_t *corr;   /* [M, Kp / 4] q8: -128 sum(q1) - sum(q2) of each lane */
    int32_t *corr3;  /* [M, Kp / 4] q8 with three passes: -128 sum(q3) */
    int32_t *sum16[3]; /* [M, Kp / 16] q8x16: -128 x the sum of each pass's codes over 16 values */
    void *mem;
} act_t;

static inline float round_even(float v) { return (v + 12582912.0f) - 12582912.0f; }  /* |v| < 2^22 */

static inline int8_t clamp8(float v, float lim) { return (int8_t)(v > lim ? lim : v < -lim ? -lim : v); }

static inline int32_t lane_sum(const int8_t *q) { return q[0] + q[1] + q[2] + q[3]; }

static int act_init(act_t *a, const float *x, int64_t M, int64_t K, int64_t G, int signed_codes, int passes) {
    const int64_t A = K % 32 ? 16 : 32, groups = K / G;
    a->Kp = (K + 63) / 64 * 64;
    a->Gp = (groups + 15) / 16 * 16;
    const size_t lanes = (size_t)(M * a->Kp / 4), bytes = (size_t)(M * a->Kp);
    a->mem = calloc(1, lanes * 12 + lanes * 3 + (size_t)(M * a->Gp) * 4 + 3 * bytes + 64);
    if (!a->mem) return -1;
    a->xs = (float *)a->mem;
    a->corr = (int32_t *)(a->xs + lanes);
    a->corr3 = a->corr + lanes;
    for (int k = 0; k < 3; k++) a->sum16[k] = a->corr3 + lanes + k * lanes / 4;
    a->sum = (float *)(a->sum16[2] + lanes / 4);
    for (int k = 0; k < 3; k++) a->xq[k] = (int8_t *)(a->sum + M * a->Gp) + k * bytes;
    const float unit = passes == 1 ? 1.0f : passes == 2 ? 1.0f / 128 : 1.0f / 16384;
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * K;
        int8_t *q1 = a->xq[0] + m * a->Kp, *q2 = a->xq[1] + m * a->Kp, *q3 = a->xq[2] + m * a->Kp;
        float *xs = a->xs + m * a->Kp / 4;
        for (int64_t g = 0; g < K / A; g++) {
            const float *xg = xm + g * A;
            float mx = 0.0f;
            for (int64_t j = 0; j < A; j++) {
                float v = xg[j] < 0 ? -xg[j] : xg[j];
                mx = v > mx ? v : mx;
            }
            const float inv = mx > 0.0f ? 127.0f / mx : 0.0f;
            for (int64_t j = g * A; j < (g + 1) * A; j++) {
                const float u = xm[j] * inv, r1 = round_even(u);  /* |u| <= 127 (+ rounding) */
                q1[j] = clamp8(r1, 127.0f);
                if (passes >= 2) {  /* what is left, in [-1/2, 1/2], in steps of 1/128 */
                    const float v = (u - r1) * 128.0f, r2 = round_even(v);
                    q2[j] = clamp8(r2, 64.0f);
                    if (passes == 3) q3[j] = clamp8(round_even((v - r2) * 128.0f), 64.0f);
                }
            }
            for (int64_t l = 0; l < A / 4; l++) xs[g * A / 4 + l] = mx / 127.0f * unit;
        }
        if (signed_codes == 2) {  /* the q8x16 kernel's correction (see there) */
            for (int k = 0; k < passes; k++) {
                const int8_t *q = a->xq[k] + m * a->Kp;
                for (int64_t c = 0; c < K / 16; c++) {
                    int32_t t = 0;
                    for (int j = 0; j < 16; j++) t += q[16 * c + j];
                    a->sum16[k][m * a->Kp / 16 + c] = -128 * t;
                }
            }
        } else if (signed_codes) {
            int32_t *corr = a->corr + m * a->Kp / 4, *corr3 = a->corr3 + m * a->Kp / 4;
            for (int64_t l = 0; l < K / 4; l++) {
                corr[l] = -128 * lane_sum(q1 + 4 * l) - (passes >= 2 ? lane_sum(q2 + 4 * l) : 0);
                corr3[l] = -128 * lane_sum(q3 + 4 * l);
            }
        }
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int64_t j = 0; j < G; j++) s += xm[g * G + j];
            a->sum[m * a->Gp + g] = s;
        }
    }
    return 0;
}

/* The rows of one tile: pointers into act_t at row m0 + r. */
typedef struct {
    const int8_t *q[3][4];
    const float *xs[4], *sum[4];
    const int32_t *corr[4], *corr3[4];
} rows_t;

static inline void rows_at(rows_t *t, const act_t *a, int64_t m0, int nr) {
    const int64_t lanes = a->Kp / 4;
    for (int r = 0; r < nr; r++) {
        for (int k = 0; k < 3; k++) t->q[k][r] = a->xq[k] + (m0 + r) * a->Kp;
        t->xs[r] = a->xs + (m0 + r) * lanes;
        t->sum[r] = a->sum + (m0 + r) * a->Gp;
        t->corr[r] = a->corr + (m0 + r) * lanes;
        t->corr3[r] = a->corr3 + (m0 + r) * lanes;
    }
}

#define MAX_ROWS 4
#define N_CHUNK 64

#if RL_VNNI == 2
static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

/* q4: the 32 bytes of two groups -> 64 codes in x's order (per group: 16 low nibbles, 16 high) */
static inline __m512i q4_codes(const uint8_t *p, __mmask32 m) {
    __m256i b = _mm256_maskz_loadu_epi8(m, p);
    __m512i v = _mm512_permutexvar_epi64(_mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0), _mm512_castsi256_si512(b));
    v = _mm512_srlv_epi64(v, _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0));
    return _mm512_and_si512(v, _mm512_set1_epi8(15));
}

/* the weight scale of each int32 lane of chunk c: group (64 c + 4 l) / G, for 64 % G == 0 or G % 64 == 0 */
static inline __m512 lane_scales(const float *sn, int64_t c, int64_t G, int64_t groups) {
    if (G >= 64) return _mm512_set1_ps(sn[c * 64 / G]);
    const int64_t per = 64 / G, g0 = c * per, have = groups - g0 < per ? groups - g0 : per;
    __m512 s = _mm512_maskz_loadu_ps((__mmask16)((1u << have) - 1), sn + g0);
    __m512i idx = G == 32 ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                          : _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(idx, s);
}

/* acc[r] += the products of chunk c (64 weights) of one output feature's codes qn with row r */
static inline __attribute__((always_inline)) void chunk512(__m512 *acc, const rows_t *t, const int nr,
                                                           const uint8_t *qn, const float *sn, int64_t c, int64_t K,
                                                           const int64_t G, int64_t groups, const int q4,
                                                           const int passes) {
    const int64_t left = K - c * 64;
    __m512i w;
    if (q4)
        w = q4_codes(qn + c * 32, left >= 64 ? 0xFFFFFFFFu : 0xFFFFu);
    else
        w = _mm512_xor_si512(_mm512_maskz_loadu_epi8(left >= 64 ? ~0ull : (1ull << left) - 1, qn + c * 64),
                             _mm512_set1_epi8((char)0x80));
    const __m512 s = lane_scales(sn, c, G, groups);
    for (int r = 0; r < nr; r++) {
        __m512i d = q4 ? _mm512_setzero_si512() : _mm512_loadu_si512(t->corr[r] + c * 16);
        d = _mm512_dpbusd_epi32(d, w, _mm512_loadu_si512(t->q[0][r] + c * 64));
        for (int k = 1; k < passes; k++)
            d = _mm512_dpbusd_epi32(_mm512_slli_epi32(d, 7), w, _mm512_loadu_si512(t->q[k][r] + c * 64));
        if (passes == 3 && !q4) d = _mm512_add_epi32(d, _mm512_loadu_si512(t->corr3[r] + c * 16));
        __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(d), s);
        acc[r] = _mm512_fmadd_ps(p, _mm512_loadu_ps(t->xs[r] + c * 16), acc[r]);
    }
}

static inline __attribute__((always_inline)) void tile(const act_t *a, int64_t m0, const int nr, int64_t K,
                                                       const int64_t G, const int q4, const int passes,
                                                       const uint8_t *codes, const float *scales,
                                                       const float *offsets, const float *bias, float *y, int64_t N,
                                                       int64_t n0, int64_t n1) {
    const int64_t groups = K / G, chunks = (K + 63) / 64, row_bytes = q4 ? K / 2 : K;
    rows_t t;
    rows_at(&t, a, m0, nr);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *qn = codes + n * row_bytes;
        const float *sn = scales + n * groups, *on = offsets ? offsets + n * groups : NULL;
        /* two accumulators a row, for even and odd chunks: one row alone is otherwise bound by the latency
         * of its chain of fused multiply-adds */
        __m512 acc[2][MAX_ROWS];
        for (int r = 0; r < nr; r++) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
        int64_t c = 0;
        for (; c + 2 <= chunks; c += 2) {
            chunk512(acc[0], &t, nr, qn, sn, c, K, G, groups, q4, passes);
            chunk512(acc[1], &t, nr, qn, sn, c + 1, K, G, groups, q4, passes);
        }
        if (c < chunks) chunk512(acc[0], &t, nr, qn, sn, c, K, G, groups, q4, passes);
        /* the offset term: sum over groups of o_g * X_g, 16 groups a vector (X padded with zeros); none
         * where the weight has no offsets (Q8_0, Q6_K: offsets NULL) */
        for (int64_t g = 0; offsets && g < groups; g += 16) {
            __m512 o = _mm512_maskz_loadu_ps(groups - g >= 16 ? 0xFFFF : (__mmask16)((1u << (groups - g)) - 1), on + g);
            for (int r = 0; r < nr; r++) acc[1][r] = _mm512_fmadd_ps(o, _mm512_loadu_ps(t.sum[r] + g), acc[1][r]);
        }
        for (int r = 0; r < nr; r++)
            y[(m0 + r) * N + n] = hsum(_mm512_add_ps(acc[0][r], acc[1][r])) + (bias ? bias[n] : 0.0f);
    }
}
#elif RL_VNNI == 1
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline __m256 lane_scales(const float *sn, int64_t c, int64_t G, int64_t groups) {
    if (G >= 32) return _mm256_set1_ps(sn[c * 32 / G]);
    const float lo = sn[2 * c], hi = 2 * c + 1 < groups ? sn[2 * c + 1] : 0.0f;  /* G == 16 */
    return _mm256_set_m128(_mm_set1_ps(hi), _mm_set1_ps(lo));
}

/* acc[r] += the products of chunk c (32 weights) of one output feature's codes qn with row r */
static inline __attribute__((always_inline)) void chunk256(__m256 *acc, const rows_t *t, const int nr,
                                                           const uint8_t *qn, const float *sn, int64_t c, int64_t K,
                                                           const int64_t G, int64_t groups, const int q4,
                                                           const int passes) {
    __m256i w;
    if (q4) {  /* K % 32 == 0: whole groups */
        __m128i b = _mm_loadu_si128((const __m128i *)(qn + c * 16)), f = _mm_set1_epi8(15);
        w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), f), _mm_and_si128(b, f));
    } else {
        __m256i m = K - c * 32 >= 32 ? _mm256_set1_epi32(-1) : _mm256_set_epi32(0, 0, 0, 0, -1, -1, -1, -1);
        w = _mm256_xor_si256(_mm256_maskload_epi32((const int *)(qn + c * 32), m), _mm256_set1_epi8((char)0x80));
    }
    const __m256 s = lane_scales(sn, c, G, groups);
    for (int r = 0; r < nr; r++) {
        __m256i d = q4 ? _mm256_setzero_si256() : _mm256_loadu_si256((const __m256i *)(t->corr[r] + c * 8));
        d = _mm256_dpbusd_avx_epi32(d, w, _mm256_loadu_si256((const __m256i *)(t->q[0][r] + c * 32)));
        for (int k = 1; k < passes; k++)
            d = _mm256_dpbusd_avx_epi32(_mm256_slli_epi32(d, 7), w,
                                        _mm256_loadu_si256((const __m256i *)(t->q[k][r] + c * 32)));
        if (passes == 3 && !q4) d = _mm256_add_epi32(d, _mm256_loadu_si256((const __m256i *)(t->corr3[r] + c * 8)));
        __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(d), s);
        acc[r] = _mm256_fmadd_ps(p, _mm256_loadu_ps(t->xs[r] + c * 8), acc[r]);
    }
}

static inline __attribute__((always_inline)) void tile(const act_t *a, int64_t m0, const int nr, int64_t K,
                                                       const int64_t G, const int q4, const int passes,
                                                       const uint8_t *codes, const float *scales,
                                                       const float *offsets, const float *bias, float *y, int64_t N,
                                                       int64_t n0, int64_t n1) {
    const int64_t groups = K / G, chunks = (K + 31) / 32, row_bytes = q4 ? K / 2 : K;
    rows_t t;
    rows_at(&t, a, m0, nr);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *qn = codes + n * row_bytes;
        const float *sn = scales + n * groups, *on = offsets ? offsets + n * groups : NULL;
        __m256 acc[2][MAX_ROWS];  /* even and odd chunks, as in the AVX-512 tile */
        for (int r = 0; r < nr; r++) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
        int64_t c = 0;
        for (; c + 2 <= chunks; c += 2) {
            chunk256(acc[0], &t, nr, qn, sn, c, K, G, groups, q4, passes);
            chunk256(acc[1], &t, nr, qn, sn, c + 1, K, G, groups, q4, passes);
        }
        if (c < chunks) chunk256(acc[0], &t, nr, qn, sn, c, K, G, groups, q4, passes);
        for (int64_t g = 0; offsets && g < groups; g += 8) {  /* the offset term, 8 groups a vector (if any) */
            __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(groups - g)), _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0));
            __m256 o = _mm256_maskload_ps(on + g, keep);
            for (int r = 0; r < nr; r++) acc[1][r] = _mm256_fmadd_ps(o, _mm256_loadu_ps(t.sum[r] + g), acc[1][r]);
        }
        for (int r = 0; r < nr; r++)
            y[(m0 + r) * N + n] = hsum(_mm256_add_ps(acc[0][r], acc[1][r])) + (bias ? bias[n] : 0.0f);
    }
}
#endif

/* y [M, N] = x [M, K] @ W^T (+ bias). q4: G == 32, codes [N, K / 2]; q8: 64 % G == 0 or G % 64 == 0
 * (G a multiple of 16), codes [N, K]. offsets may be NULL where they are all 0 (Q8_0, Q6_K): no offset term
 * is read or added then. Returns 0, or -1 when it cannot run (no VNNI, a group it does
 * not take, no memory); the caller then uses the float32 kernel. */
static int linear(const float *x, int64_t M, int64_t K, int64_t G, int q4, const uint8_t *codes,
                  const float *scales, const float *offsets, const float *bias, float *y, int64_t N, int passes,
                  int nthreads) {
#if RL_VNNI
    if (G % 16 || K % G || (64 % G && G % 64) || (q4 && G != 32) || passes < 1 || passes > 3) return -1;
    act_t a;
    if (act_init(&a, x, M, K, G, !q4, passes)) return -1;
    int64_t n_chunks = (N + N_CHUNK - 1) / N_CHUNK;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && N * K >= 65536)
    for (int64_t c = 0; c < n_chunks; c++) {
        int64_t n0 = c * N_CHUNK, n1 = n0 + N_CHUNK < N ? n0 + N_CHUNK : N;
        for (int64_t m = 0; m < M; m += MAX_ROWS) {
            int nr = M - m < MAX_ROWS ? (int)(M - m) : MAX_ROWS;
            /* constant row counts, layouts, passes and small groups: the accumulators stay in registers */
            const int kind = (q4 ? 0 : G == 16 ? 1 : G == 32 ? 2 : 3) * 3 + passes - 1;
            switch (kind * 4 + nr - 1) {
#define TILE(k, r, g, is_q4, p) \
    case (k) * 4 + (r) - 1: tile(&a, m, r, K, g, is_q4, p, codes, scales, offsets, bias, y, N, n0, n1); break;
#define TILES(k, g, is_q4, p) TILE(k, 1, g, is_q4, p) TILE(k, 2, g, is_q4, p) TILE(k, 3, g, is_q4, p) TILE(k, 4, g, is_q4, p)
#define KIND(k, g, is_q4) TILES(3 * k, g, is_q4, 1) TILES(3 * k + 1, g, is_q4, 2) TILES(3 * k + 2, g, is_q4, 3)
            KIND(0, 32, 1) KIND(1, 16, 0) KIND(2, 32, 0) KIND(3, G, 0)
#undef KIND
#undef TILES
#undef TILE
            }
        }
    }
    free(a.mem);
    return 0;
#else
    (void)x; (void)M; (void)K; (void)G; (void)q4; (void)codes; (void)scales; (void)offsets; (void)bias;
    (void)y; (void)N; (void)passes; (void)nthreads; (void)act_init;
    return -1;
#endif
}

/* passes: 1 (x as int8 codes), 2 or 3 (plus int8 codes of what the earlier passes leave; see the header) */
int rl_q4_linear_i8(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *scales,
                    const float *offsets, const float *bias, float *y, int64_t N, int passes, int nthreads) {
    return linear(x, M, K, 32, 1, codes, scales, offsets, bias, y, N, passes, nthreads);
}

int rl_q8_linear_i8(const float *x, int64_t M, int64_t K, int64_t G, const int8_t *codes, const float *scales,
                    const float *offsets, const float *bias, float *y, int64_t N, int passes, int nthreads) {
    return linear(x, M, K, G, 0, (const uint8_t *)codes, scales, offsets, bias, y, N, passes, nthreads);
}

/* q4 codes interleaved by 16 output features (quant.py: QuantWeight.interleaved), for AVX512-VNNI.
 *
 * The kernel above takes one output feature at a time: each 64 codes cost their unpacking, the lane
 * scales, one vpdpbusd a pass, a conversion and two float ops, and every feature ends in a horizontal
 * sum; it streamed SmolLM2's weights well below the read bandwidth (docs/cpu.md), bound by those
 * instructions, not by memory. Here the 16 lanes of a vector are 16 output features: block b (features 16 b ..
 * 16 b + 15) of group g (inputs 32 g .. 32 g + 31) is 256 bytes, four parts of 64: in part i, bytes
 * 4 r .. 4 r + 3 hold feature 16 b + r's codes of inputs 32 g + 8 i + j (j < 4) in their low nibbles and
 * of 32 g + 8 i + 4 + j in their high nibbles. So one unpacked vector times the broadcast 4 activation
 * codes of a step is one vpdpbusd for 16 features, and eight steps make a group. The scales and offsets
 * of a block are [groups, 16] (one vector load a group). Per group and row: the passes' int32 sums
 * (three independent chains), combined exactly as in the kernel above ((d1 << 14) + (d2 << 7) + d3:
 * |d1| <= 32 x 15 x 127, within int32), converted once, times the weight scales and the activation
 * group's scale, plus the offsets times the activation group's float32 sum. The same numbers as the
 * kernel above up to the order of the float32 sums over groups. N % 16 == 0, K % 32 == 0. */
#if RL_VNNI == 2
#define PF_GROUPS 8
#define X16_MAX_ROWS 8  /* rows a pass over an interleaved block takes (a speculative verify's 5 in one) */
static inline __attribute__((always_inline)) void q4x16_block(const act_t *a, int64_t m0, const int nr, int64_t K,
                                                              const int passes, const uint8_t *codes,
                                                              const float *scales, const float *offsets,
                                                              const float *bias, float *y, int64_t N, int64_t b) {
    const int64_t groups = K / 32, lanes = a->Kp / 4;
    const uint8_t *cb = codes + b * groups * 256;
    const float *sb = scales + b * groups * 16, *ob = offsets ? offsets + b * groups * 16 : NULL;
    const __m512i low = _mm512_set1_epi8(15);
    __m512 acc[X16_MAX_ROWS];
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i w[8];
        for (int i = 0; i < 4; i++) _mm_prefetch((const char *)(cb + (g + PF_GROUPS) * 256 + i * 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(sb + (g + PF_GROUPS) * 16), _MM_HINT_T0);
        if (ob) _mm_prefetch((const char *)(ob + (g + PF_GROUPS) * 16), _MM_HINT_T0);
        for (int i = 0; i < 4; i++) {
            const __m512i v = _mm512_loadu_si512(cb + g * 256 + i * 64);
            w[2 * i] = _mm512_and_si512(v, low);
            w[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        const __m512 s = _mm512_loadu_ps(sb + g * 16);
        for (int r = 0; r < nr; r++) {
            const int64_t row = m0 + r;
            __m512i d[3];
            for (int p = 0; p < passes; p++) {
                const int32_t *xq = (const int32_t *)(a->xq[p] + row * a->Kp + g * 32);
                d[p] = _mm512_setzero_si512();
                if (nr * passes < 6) {  /* few chains: two per pass hide vpdpbusd's latency (exact: int32 sums) */
                    __m512i e = _mm512_setzero_si512();
                    for (int st = 0; st < 8; st += 2) {
                        d[p] = _mm512_dpbusd_epi32(d[p], w[st], _mm512_set1_epi32(xq[st]));
                        e = _mm512_dpbusd_epi32(e, w[st + 1], _mm512_set1_epi32(xq[st + 1]));
                    }
                    d[p] = _mm512_add_epi32(d[p], e);
                } else {
                    for (int st = 0; st < 8; st++) d[p] = _mm512_dpbusd_epi32(d[p], w[st], _mm512_set1_epi32(xq[st]));
                }
            }
            __m512i t = d[0];
            for (int p = 1; p < passes; p++) t = _mm512_add_epi32(_mm512_slli_epi32(t, 7), d[p]);
            const __m512 xs = _mm512_set1_ps(a->xs[row * lanes + g * 8]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(s, xs), acc[r]);
            if (ob) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(ob + g * 16), _mm512_set1_ps(a->sum[row * a->Gp + g]), acc[r]);
        }
    }
    const __m512 bv = bias ? _mm512_loadu_ps(bias + b * 16) : _mm512_setzero_ps();
    for (int r = 0; r < nr; r++) _mm512_storeu_ps(y + (m0 + r) * N + b * 16, _mm512_add_ps(acc[r], bv));
}
#endif

int rl_q4x16_linear_i8(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *scales,
                       const float *offsets, const float *bias, float *y, int64_t N, int passes, int nthreads) {
#if RL_VNNI == 2
    if (K % 32 || N % 16 || passes < 1 || passes > 3) return -1;
    act_t a;
    if (act_init(&a, x, M, K, 32, 0, passes)) return -1;
    const int64_t blocks = N / 16;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && N * K >= 65536)
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t m = 0; m < M; m += X16_MAX_ROWS) {
            const int nr = M - m < X16_MAX_ROWS ? (int)(M - m) : X16_MAX_ROWS;
            switch ((passes - 1) * 8 + nr - 1) {
#define BLOCK(p, r) \
    case ((p) - 1) * 8 + (r) - 1: q4x16_block(&a, m, r, K, p, codes, scales, offsets, bias, y, N, b); break;
#define BLOCKS(p) BLOCK(p, 1) BLOCK(p, 2) BLOCK(p, 3) BLOCK(p, 4) BLOCK(p, 5) BLOCK(p, 6) BLOCK(p, 7) \
    BLOCK(p, 8)
                BLOCKS(1) BLOCKS(2) BLOCKS(3)
#undef BLOCKS
#undef BLOCK
            }
        }
    }
    free(a.mem);
    return 0;
#else
    (void)x; (void)M; (void)K; (void)codes; (void)scales; (void)offsets; (void)bias; (void)y; (void)N;
    (void)passes; (void)nthreads;
    return -1;
#endif
}

/* q8 codes interleaved by 16 output features (quant.py: QuantWeight.interleave), for AVX512-VNNI.
 *
 * As q4x16 above, the 16 lanes of a vector are 16 output features: block b (features 16 b .. 16 b + 15)
 * holds K / 4 vectors of 64 bytes, one per 4 inputs, in which bytes 4 r .. 4 r + 3 are feature 16 b + r's
 * codes of those inputs, stored as q + 128 (0..255). So the codes are vpdpbusd's unsigned operand and the
 * broadcast activation codes its signed one: each product sum is dot(q, x) + 128 sum(x), and the second
 * term is taken off by starting each group's chain at -128 x the activation codes' sum over the group
 * (act_t.sum16, made per 16 values). A pass's exact dot over a group of 32 reaches 32 x 127 x 127, so the
 * passes are combined in float32 (d1 128^2 + d2 128 + d3, one rounding) rather than by shifts. Scales and
 * offsets are [groups, 16] per block, as for q4x16. Weight groups of 16 (Q6_K) or 32 (Q8_0, Q5_K); the
 * activations' groups are 32. N % 16 == 0, K % 32 == 0. */
#if RL_VNNI == 2
#define PF8_GROUPS 4
static inline __attribute__((always_inline)) void q8x16_block(const act_t *a, int64_t m0, const int nr, int64_t K,
                                                              const int64_t G, const int passes, const uint8_t *codes,
                                                              const float *scales, const float *offsets,
                                                              const float *bias, float *y, int64_t N, int64_t b) {
    const int64_t chunks = K / 32, groups = K / G, lanes = a->Kp / 4, per = 32 / G;  /* per: weight groups a chunk */
    const uint8_t *cb = codes + b * K * 16;
    const float *sb = scales + b * groups * 16, *ob = offsets ? offsets + b * groups * 16 : NULL;
    __m512 acc[X16_MAX_ROWS];
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; c++) {
        __m512i w[8];
        for (int i = 0; i < 8; i++) _mm_prefetch((const char *)(cb + (c + PF8_GROUPS) * 512 + i * 64), _MM_HINT_T0);
        for (int i = 0; i < 8; i++) w[i] = _mm512_loadu_si512(cb + c * 512 + i * 64);
        for (int r = 0; r < nr; r++) {
            const int64_t row = m0 + r;
            const __m512 xs = _mm512_set1_ps(a->xs[row * lanes + c * 8]);
            for (int h = 0; h < per; h++) {  /* each weight group of the chunk: 8 / per steps of 4 inputs */
                const int steps = 8 / per, s0 = h * steps;
                const int64_t at = row * a->Kp / 16 + c * 2 + h * (2 / per);
                __m512 f = _mm512_setzero_ps();
                for (int p = 0; p < passes; p++) {
                    const int32_t *xq = (const int32_t *)(a->xq[p] + row * a->Kp + c * 32);
                    const int32_t *cs = a->sum16[p] + at;
                    __m512i d = _mm512_set1_epi32(per == 1 ? cs[0] + cs[1] : cs[0]);
                    if (nr * passes < 6) {  /* as in q4x16_block: two chains when there are few */
                        __m512i e = _mm512_setzero_si512();
                        for (int st = s0; st < s0 + steps; st += 2) {
                            d = _mm512_dpbusd_epi32(d, w[st], _mm512_set1_epi32(xq[st]));
                            e = _mm512_dpbusd_epi32(e, w[st + 1], _mm512_set1_epi32(xq[st + 1]));
                        }
                        d = _mm512_add_epi32(d, e);
                    } else {
                        for (int st = s0; st < s0 + steps; st++) d = _mm512_dpbusd_epi32(d, w[st], _mm512_set1_epi32(xq[st]));
                    }
                    f = p ? _mm512_fmadd_ps(f, _mm512_set1_ps(128.0f), _mm512_cvtepi32_ps(d)) : _mm512_cvtepi32_ps(d);
                }
                const int64_t g = c * per + h;
                acc[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(_mm512_loadu_ps(sb + g * 16), xs), acc[r]);
                if (ob) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(ob + g * 16), _mm512_set1_ps(a->sum[row * a->Gp + g]), acc[r]);
            }
        }
    }
    const __m512 bv = bias ? _mm512_loadu_ps(bias + b * 16) : _mm512_setzero_ps();
    for (int r = 0; r < nr; r++) _mm512_storeu_ps(y + (m0 + r) * N + b * 16, _mm512_add_ps(acc[r], bv));
}
#endif

int rl_q8x16_linear_i8(const float *x, int64_t M, int64_t K, int64_t G, const uint8_t *codes, const float *scales,
                       const float *offsets, const float *bias, float *y, int64_t N, int passes, int nthreads) {
#if RL_VNNI == 2
    if (K % 32 || N % 16 || (G != 16 && G != 32) || passes < 1 || passes > 3) return -1;
    act_t a;
    if (act_init(&a, x, M, K, G, 2, passes)) return -1;
    const int64_t blocks = N / 16;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && N * K >= 65536)
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t m = 0; m < M; m += X16_MAX_ROWS) {
            const int nr = M - m < X16_MAX_ROWS ? (int)(M - m) : X16_MAX_ROWS;
            switch (((G == 16) * 3 + passes - 1) * 8 + nr - 1) {
#define BLOCK(g, p, r) \
    case (((g) == 16) * 3 + (p) - 1) * 8 + (r) - 1: \
        q8x16_block(&a, m, r, K, g, p, codes, scales, offsets, bias, y, N, b); break;
#define BLOCKS(g, p) BLOCK(g, p, 1) BLOCK(g, p, 2) BLOCK(g, p, 3) BLOCK(g, p, 4) BLOCK(g, p, 5) BLOCK(g, p, 6) \
    BLOCK(g, p, 7) BLOCK(g, p, 8)
                BLOCKS(32, 1) BLOCKS(32, 2) BLOCKS(32, 3) BLOCKS(16, 1) BLOCKS(16, 2) BLOCKS(16, 3)
#undef BLOCKS
#undef BLOCK
            }
        }
    }
    free(a.mem);
    return 0;
#else
    (void)x; (void)M; (void)K; (void)G; (void)codes; (void)scales; (void)offsets; (void)bias; (void)y; (void)N;
    (void)passes; (void)nthreads;
    return -1;
#endif
}

/* A layer's quantized SwiGLU experts for the few rows of a decode step, in one call (gguf_experts.py:
 * QuantExperts). Run from Python, each expert cost two kernel calls, a SiLU call and the dispatch's sort /
 * gather / scatter ops, a fixed cost per expert on top of its kernels (docs/cpu.md); here the sort, the
 * gather, SiLU and the weighted sum are loops in C and the experts run on the int8 kernels above.
 *
 * w13 / w2: per expert, the addresses of its codes, scales and offsets (0: all offsets are 0), as int64
 * [E, 3]; layout: 0 q4, 1 q8, 2 q4x16, 3 q8x16 (quant.py: LAYOUTS), group: the q8 weight group. With at
 * least as many experts holding rows as threads, the experts are shared among the threads (each runs
 * its kernels on one thread: one parallel region for the layer); else each runs on every thread.
 * Returns 1, having done nothing, when an expert holds more than max_rows rows (the caller runs its
 * per-expert path), -1 when a kernel cannot run (no VNNI, a layout or group it does not take), else 0.
 * scratch: n * top_k * (2 * hidden + 3 * inter) floats; index: 2 * n * top_k + num_experts + 1 int64s. */
static int expert_linear(int layout, int64_t group, const int64_t *w, const float *x, int64_t M, int64_t K,
                         float *y, int64_t N, int passes, int nthreads) {
    const uint8_t *codes = (const uint8_t *)(intptr_t)w[0];
    const float *scales = (const float *)(intptr_t)w[1], *offsets = (const float *)(intptr_t)w[2];
    switch (layout) {
        case 0: return rl_q4_linear_i8(x, M, K, codes, scales, offsets, NULL, y, N, passes, nthreads);
        case 1: return rl_q8_linear_i8(x, M, K, group, (const int8_t *)codes, scales, offsets, NULL, y, N, passes,
                                       nthreads);
        case 2: return rl_q4x16_linear_i8(x, M, K, codes, scales, offsets, NULL, y, N, passes, nthreads);
        case 3: return rl_q8x16_linear_i8(x, M, K, group, codes, scales, offsets, NULL, y, N, passes, nthreads);
        default: return -1;
    }
}

/* one expert's rows: h = xs w13^T, act = silu(gate) * up, y = act w2^T */
static int run_expert(const float *xs, int64_t rows, int64_t hidden, int64_t inter, int layout13, int64_t group13,
                      const int64_t *w13, int layout2, int64_t group2, const int64_t *w2, float *h, float *act,
                      float *y, int passes, int nthreads) {
    if (expert_linear(layout13, group13, w13, xs, rows, hidden, h, 2 * inter, passes, nthreads)) return -1;
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = h + r * 2 * inter;
        silu_mul_row(gate, gate + inter, act + r * inter, inter);
    }
    return expert_linear(layout2, group2, w2, act, rows, inter, y, hidden, passes, nthreads);
}

int rl_quant_moe_i8(const float *x, const int64_t *ids, const float *weights, int64_t n, int64_t top_k,
                    int64_t hidden, int64_t inter, int64_t num_experts, int layout13, int64_t group13,
                    const int64_t *w13, int layout2, int64_t group2, const int64_t *w2, int64_t max_rows,
                    int passes, float *scratch, int64_t *index, float *out, int nthreads) {
    const int64_t pairs = n * top_k;
    int64_t *slot = index, *token = index + pairs, *start = token + pairs;
    float *xs = scratch, *h = xs + pairs * hidden, *act = h + pairs * 2 * inter, *y = act + pairs * inter;
    moe_sort_pairs(ids, pairs, top_k, num_experts, slot, token, start);
    int64_t active = 0;
    for (int64_t e = 0; e < num_experts; e++) {
        if (start[e + 1] - start[e] > max_rows) return 1;
        active += start[e + 1] > start[e];
    }
    for (int64_t s = 0; s < pairs; s++) memcpy(xs + s * hidden, x + token[s] * hidden, sizeof(float) * hidden);

    int failed = 0;
    const int outer = nthreads > 1 && active >= nthreads; /* experts over threads, else threads in each */
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) if (outer) reduction(| : failed)
    for (int64_t e = 0; e < num_experts; e++) {
        const int64_t s = start[e], rows = start[e + 1] - s;
        if (rows == 0) continue;
        failed |= run_expert(xs + s * hidden, rows, hidden, inter, layout13, group13, w13 + 3 * e, layout2, group2,
                             w2 + 3 * e, h + s * 2 * inter, act + s * inter, y + s * hidden, passes,
                             outer ? 1 : nthreads) != 0;
    }
    if (failed) return -1;

    for (int64_t t = 0; t < n; t++) moe_sum_token(out, weights, slot, y, hidden, top_k, hidden, t);
    return 0;
}
