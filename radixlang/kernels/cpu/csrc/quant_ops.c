/* radixlang's quantized linear kernels: y = x @ W^T with W kept in blocks of integer codes.
 *
 * Built at first use by radixlang/kernels/cpu/build.py like cpu_ops.c (-O3 -march=native -fopenmp: the
 * compiler picks AVX-512, AVX2 or plain SSE for the vector types from the running CPU's flags) and
 * called through ctypes from radixlang/kernels/cpu/quant.py, which checks shapes and dtypes.
 *
 * Two weight layouts, both grouped along K (the input features) in groups of G weights, each group with
 * a float32 scale s and offset o, so that weight = q * s + o (one fused multiply-add):
 *   q4: two 4-bit codes per byte, 32 weights per group (G = 32) in 16 bytes: byte i holds weight i in its
 *       low nibble and weight i + 16 in its high nibble (GGUF's Q4_0 / Q4_1 order). codes [N, K / 2].
 *   q8: one signed 8-bit code per weight, G a multiple of 16. codes [N, K].
 * scales and offsets are [N, K / G]. The activations stay float32: each weight is decoded to exactly the
 * float32 value the dequantized model holds (q * s + o rounded once) and multiplied in float32, so the
 * result differs from the dequantized matmul only in the order of the sums. What is saved is memory
 * traffic: a decode step streams every weight once, 0.625 (q4) or 1.25 (q8) bytes a weight against 4.
 *
 * Rows of x are taken up to four at a time, so a weight group is decoded once for four rows (a batch of
 * decodes or a verify step); each thread owns a range of output features.
 */
#include <stdint.h>
#include <string.h>

#include "vec.h"

/* 16 bytes -> 16 int32 lanes (zero- or sign-extended): one vpmovzxbd / vpmovsxbd with AVX-512, else
 * whatever the compiler makes of the portable loop (two AVX2 widenings) */
#ifdef __AVX512F__
#include <immintrin.h>
static inline v16i widen_u8(const uint8_t *p) {
    return (v16i)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}

static inline v16i widen_s8(const int8_t *p) {
    return (v16i)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
}
#else
static inline v16i widen_u8(const uint8_t *p) {
    uint8_t b[16];
    memcpy(b, p, 16);
    v16i r;
    for (int j = 0; j < 16; j++) r[j] = b[j];
    return r;
}

static inline v16i widen_s8(const int8_t *p) {
    int8_t b[16];
    memcpy(b, p, 16);
    v16i r;
    for (int j = 0; j < 16; j++) r[j] = b[j];
    return r;
}
#endif

static inline v16f to_f(v16i v) { return __builtin_convertvector(v, v16f); }

#define MAX_ROWS 4

/* rows r0..r0+nr of y (row stride ldy) for output features [n0, n1) */
static inline __attribute__((always_inline)) void q4_tile(const float *x, int64_t ldx, const int nr, int64_t K, const uint8_t *codes, const float *scales,
                    const float *offsets, const float *bias, float *y, int64_t ldy, int64_t n0, int64_t n1) {
    const int64_t groups = K / 32;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *qn = codes + n * (K / 2);
        const float *sn = scales + n * groups, *on = offsets + n * groups;
        v16f acc[MAX_ROWS] = {{0}};
        for (int r = 0; r < nr; r++) acc[r] = (v16f){0};
        for (int64_t g = 0; g < groups; g++) {
            v16i b = widen_u8(qn + g * 16);
            v16f s = (v16f){0} + sn[g], o = (v16f){0} + on[g];
            v16f lo = to_f(b & 15) * s + o, hi = to_f(b >> 4) * s + o;
            const float *xg = x + g * 32;
            for (int r = 0; r < nr; r++) acc[r] += lo * load16(xg + r * ldx) + hi * load16(xg + r * ldx + 16);
        }
        for (int r = 0; r < nr; r++) y[r * ldy + n] = hsum16(acc[r]) + (bias ? bias[n] : 0.0f);
    }
}

static inline __attribute__((always_inline)) void q8_tile(const float *x, int64_t ldx, const int nr, int64_t K, int64_t G, const int8_t *codes,
                    const float *scales, const float *offsets, const float *bias, float *y, int64_t ldy, int64_t n0,
                    int64_t n1) {
    const int64_t groups = K / G;
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *qn = codes + n * K;
        const float *sn = scales + n * groups, *on = offsets + n * groups;
        v16f acc[MAX_ROWS] = {{0}};
        for (int r = 0; r < nr; r++) acc[r] = (v16f){0};
        for (int64_t g = 0; g < groups; g++) {
            v16f s = (v16f){0} + sn[g], o = (v16f){0} + on[g];
            for (int64_t j = 0; j < G; j += 16) {
                v16f w = to_f(widen_s8(qn + g * G + j)) * s + o;
                const float *xg = x + g * G + j;
                for (int r = 0; r < nr; r++) acc[r] += w * load16(xg + r * ldx);
            }
        }
        for (int r = 0; r < nr; r++) y[r * ldy + n] = hsum16(acc[r]) + (bias ? bias[n] : 0.0f);
    }
}

/* Output features per work item: enough to amortize the loop, small enough to balance two threads. */
#define N_CHUNK 64

void rl_q4_linear(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *scales,
                  const float *offsets, const float *bias, float *y, int64_t N, int nthreads) {
    int64_t chunks = (N + N_CHUNK - 1) / N_CHUNK;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && N * K >= 65536)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t n0 = c * N_CHUNK, n1 = n0 + N_CHUNK < N ? n0 + N_CHUNK : N;
        for (int64_t m = 0; m < M; m += MAX_ROWS) {
            int nr = M - m < MAX_ROWS ? (int)(M - m) : MAX_ROWS;
            const float *xm = x + m * K;
            float *ym = y + m * N;
            switch (nr) {  /* constant row counts: the accumulators stay in registers */
            case 1: q4_tile(xm, K, 1, K, codes, scales, offsets, bias, ym, N, n0, n1); break;
            case 2: q4_tile(xm, K, 2, K, codes, scales, offsets, bias, ym, N, n0, n1); break;
            case 3: q4_tile(xm, K, 3, K, codes, scales, offsets, bias, ym, N, n0, n1); break;
            default: q4_tile(xm, K, 4, K, codes, scales, offsets, bias, ym, N, n0, n1); break;
            }
        }
    }
}

void rl_q8_linear(const float *x, int64_t M, int64_t K, int64_t G, const int8_t *codes, const float *scales,
                  const float *offsets, const float *bias, float *y, int64_t N, int nthreads) {
    int64_t chunks = (N + N_CHUNK - 1) / N_CHUNK;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && N * K >= 65536)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t n0 = c * N_CHUNK, n1 = n0 + N_CHUNK < N ? n0 + N_CHUNK : N;
        for (int64_t m = 0; m < M; m += MAX_ROWS) {
            int nr = M - m < MAX_ROWS ? (int)(M - m) : MAX_ROWS;
            const float *xm = x + m * K;
            float *ym = y + m * N;
            switch (nr) {
            case 1: q8_tile(xm, K, 1, K, G, codes, scales, offsets, bias, ym, N, n0, n1); break;
            case 2: q8_tile(xm, K, 2, K, G, codes, scales, offsets, bias, ym, N, n0, n1); break;
            case 3: q8_tile(xm, K, 3, K, G, codes, scales, offsets, bias, ym, N, n0, n1); break;
            default: q8_tile(xm, K, 4, K, G, codes, scales, offsets, bias, ym, N, n0, n1); break;
            }
        }
    }
}

/* The float32 weight [N, K] itself (for matmuls of many rows, which run in a float32 GEMM). */
void rl_q4_dequantize(const uint8_t *codes, const float *scales, const float *offsets, float *w, int64_t N,
                      int64_t K, int nthreads) {
    const int64_t groups = K / 32;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && N * K >= 65536)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t g = 0; g < groups; g++) {
            v16i b = widen_u8(codes + n * (K / 2) + g * 16);
            v16f s = (v16f){0} + scales[n * groups + g], o = (v16f){0} + offsets[n * groups + g];
            v16f lo = to_f(b & 15) * s + o, hi = to_f(b >> 4) * s + o;
            memcpy(w + n * K + g * 32, &lo, sizeof lo);
            memcpy(w + n * K + g * 32 + 16, &hi, sizeof hi);
        }
    }
}

void rl_q8_dequantize(const int8_t *codes, int64_t G, const float *scales, const float *offsets, float *w,
                      int64_t N, int64_t K, int nthreads) {
    const int64_t groups = K / G;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && N * K >= 65536)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t g = 0; g < groups; g++) {
            v16f s = (v16f){0} + scales[n * groups + g], o = (v16f){0} + offsets[n * groups + g];
            for (int64_t j = 0; j < G; j += 16) {
                v16f v = to_f(widen_s8(codes + n * K + g * G + j)) * s + o;
                memcpy(w + n * K + g * G + j, &v, sizeof v);
            }
        }
    }
}
