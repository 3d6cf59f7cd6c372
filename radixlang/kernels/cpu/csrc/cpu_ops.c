/* radixlang's CPU kernels: the small ops of a Llama layer fused, and paged decode attention.
 *
 * Built at first use by radixlang/kernels/cpu/build.py (the C compiler of the machine, -O3
 * -march=native -fopenmp) and called through ctypes with raw pointers; the Python wrappers in
 * radixlang/kernels/cpu/__init__.py check shapes, dtypes and strides. Everything here is float32.
 *
 * Threads: OpenMP, linked against the libgomp.so.1 that PyTorch has already loaded, so these
 * loops run on the same thread team as PyTorch's own ops (a second team would make both slower).
 * The caller passes the thread count: PyTorch's setting is per calling thread.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Small ops go parallel only above this many floats: below it the fork/join costs more than the loop. */
#define PAR_MIN 32768
#define PREFETCH 4

#include "vec.h"

/* x[i] = exp(x[i] - shift) for i < n; returns the sum of the results */
static inline float rl_exp_n(float *x, int64_t n, float shift) {
    v16f acc = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const v16f v = rl_exp16(load16(x + i) - shift);
        store16(x + i, v);
        acc += v;
    }
    float sum = hsum16(acc);
    for (; i < n; i++) {
        x[i] = rl_exp(x[i] - shift);
        sum += x[i];
    }
    return sum;
}

static inline float rl_dot(const float *a, const float *b, int64_t d) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t j = 0; j < d; j++) acc += a[j] * b[j];
    return acc;
}

static inline void norm_row(const float *x, const float *w, float *out, int64_t d, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < d; j++) ss += x[j] * x[j];
    float inv = 1.0f / sqrtf(ss / (float)d + eps);
#pragma omp simd
    for (int64_t j = 0; j < d; j++) out[j] = x[j] * inv * w[j];
}

/* out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w. x rows are x_stride floats apart; out is contiguous. */
void rl_rms_norm(const float *x, int64_t x_stride, const float *w, float *out, int64_t n, int64_t d, float eps,
                 int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && n * d >= PAR_MIN)
    for (int64_t i = 0; i < n; i++) norm_row(x + i * x_stride, w, out + i * d, d, eps);
}

/* The residual stream's step: residual += x, then x = rms_norm(residual) * w. Both contiguous [n, d]. */
void rl_add_rms_norm(float *x, float *residual, const float *w, int64_t n, int64_t d, float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && n * d >= PAR_MIN)
    for (int64_t i = 0; i < n; i++) {
        float *xi = x + i * d, *ri = residual + i * d;
#pragma omp simd
        for (int64_t j = 0; j < d; j++) ri[j] += xi[j];
        norm_row(ri, w, xi, d, eps);
    }
}

/* Rotary embedding in place, Hugging Face's rotate_half layout: for each of `heads` heads of d floats
 * (head h of row i at x + i * row_stride + h * d), x = x * cos[pos] + roll(x, d/2) * ssin[pos], where
 * ssin is sin with its first half negated: the first half becomes x1 cos - x2 sin, the second x2 cos + x1 sin. */
void rl_rope(float *x, int64_t row_stride, int64_t n, int64_t heads, int64_t d, const int64_t *pos,
             const float *cos_t, const float *ssin_t, int nthreads) {
    int64_t half = d / 2;
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && n * heads * d >= PAR_MIN)
    for (int64_t i = 0; i < n; i++) {
        const float *c = cos_t + pos[i] * d, *s = ssin_t + pos[i] * d;
        for (int64_t h = 0; h < heads; h++) {
            float *xh = x + i * row_stride + h * d;
#pragma omp simd
            for (int64_t j = 0; j < half; j++) {
                float x1 = xh[j], x2 = xh[j + half];
                xh[j] = x1 * c[j] + x2 * s[j];
                xh[j + half] = x2 * c[j + half] + x1 * s[j + half];
            }
        }
    }
}

/* SwiGLU's activation: out[i, j] = silu(gu[i, j]) * gu[i, inter + j]; gu [n, 2 * inter], out [n, inter]. */
void rl_silu_mul(const float *gu, float *out, int64_t n, int64_t inter, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && n * inter >= PAR_MIN)
    for (int64_t i = 0; i < n; i++) {
        const float *gate = gu + i * 2 * inter;
        silu_mul_row(gate, gate + inter, out + i * inter, inter);
    }
}

/* Write n tokens' k and v rows (width floats each; rows k_stride and v_stride floats apart, e.g. views
 * into the fused qkv output) into the KV pool at slots loc. Pool rows are width floats. */
void rl_store_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, float *k_buf, float *v_buf,
                 const int64_t *loc, int64_t n, int64_t width) {
    for (int64_t i = 0; i < n; i++) {
        memcpy(k_buf + loc[i] * width, k + i * k_stride, sizeof(float) * width);
        memcpy(v_buf + loc[i] * width, v + i * v_stride, sizeof(float) * width);
    }
}

/* Decode attention over the paged KV pool: one query per request.
 *
 * q: [bs, hq, d] with rows q_stride floats apart. k_buf, v_buf: [slots, hkv, d] contiguous.
 * Request b attends to the first seq_lens[b] slots of row req_idx[b] of req_to_token (int32,
 * r2t_stride per row). out: [bs, hq, d] contiguous. Grouped-query attention: the rep = hq / hkv query
 * heads of a kv head are scored together, so each key and value row is read once per request and kv
 * head. Work items are (request, kv head) pairs; an item keeps its scores whole (an exact softmax) in
 * a per-thread buffer of rep * max(seq_lens) floats.
 * Optional features (rl_attn_features, as transformers applies them): a sliding window (the query sees its
 * last `window` keys, itself included), soft-capping of the scaled scores (cap * tanh(s / cap)), and a sink
 * logit per query head that joins each softmax's denominator only (GPT-OSS). */
typedef struct {
    int64_t window;      /* 0: none */
    float softcap;       /* 0: none */
    const float *sinks;  /* [hq] or NULL */
} rl_attn_features;

/* s[t] = cap * tanh(s[t] / cap) for t < n, as sign(u) (1 - e) / (1 + e) with e = exp(-2 |u|), u = s / cap */
static void softcap_n(float *s, int64_t n, float cap) {
    const float inv = 1.0f / cap;
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {
        const v16f u = load16(s + t) * inv;
        const v16i sign = (v16i)u & (int32_t)0x80000000;
        const v16f a = (v16f)((v16i)u ^ sign);  /* |u| */
        const v16f e = rl_exp16(a * -2.0f), th = (1.0f - e) / (1.0f + e);
        store16(s + t, (v16f)((v16i)th ^ sign) * cap);
    }
    for (; t < n; t++) {
        const float u = s[t] * inv, a = u < 0 ? -u : u, e = rl_exp(-2.0f * a), th = (1.0f - e) / (1.0f + e);
        s[t] = (u < 0 ? -th : th) * cap;
    }
}

/* the softmax of s[0 .. n) in place, unnormalised; returns 1 / its sum, the sink's exp(sink - max) counted */
static inline float softmax_n(float *s, int64_t n, const rl_attn_features *f, int64_t head) {
    if (f->softcap > 0.0f) softcap_n(s, n, f->softcap);
    float mx = s[0];
#pragma omp simd reduction(max : mx)
    for (int64_t t = 1; t < n; t++) mx = s[t] > mx ? s[t] : mx;
    const float sink = f->sinks ? f->sinks[head] : 0.0f;
    if (f->sinks && sink > mx) mx = sink;
    float sum = rl_exp_n(s, n, mx);
    if (f->sinks) sum += rl_exp(sink - mx);
    return 1.0f / sum;
}

static inline __attribute__((always_inline)) void decode_item(
    const float *q, float *o, const float *k_buf, const float *v_buf, const int32_t *slots, int64_t len,
    int64_t h, int64_t rep, int64_t kv_row, float scale, float *scores, const rl_attn_features *f, const int64_t d) {
    if (f->window > 0 && len > f->window) {  /* the query (position len - 1) sees the last `window` keys */
        slots += len - f->window;
        len = f->window;
    }
    /* slots need not be adjacent (a pool that has served many requests hands out scattered ones):
     * fetch the row PREFETCH tokens ahead. Sixteen keys at a time when d is a multiple of 16: each
     * query row's sixteen dot products are reduced together (hsum16x16) */
    int64_t t0 = 0;
    if (d % 16 == 0) {
        for (; t0 + 16 <= len; t0 += 16) {
            const float *kr[16];
            for (int j = 0; j < 16; j++) {
                kr[j] = k_buf + (int64_t)slots[t0 + j] * kv_row + h * d;
                if (t0 + 16 + j < len) __builtin_prefetch(k_buf + (int64_t)slots[t0 + 16 + j] * kv_row + h * d);
            }
            for (int64_t r = 0; r < rep; r++) {
                const float *qh = q + r * d;
                v16f acc[16];
                for (int j = 0; j < 16; j++) {
                    v16f a = load16(qh) * load16(kr[j]);
                    for (int64_t c = 16; c < d; c += 16) a += load16(qh + c) * load16(kr[j] + c);
                    acc[j] = a;
                }
                store16(scores + r * len + t0, hsum16x16(acc) * scale);
            }
        }
    }
    for (int64_t t = t0; t < len; t++) {
        if (t + PREFETCH < len) __builtin_prefetch(k_buf + (int64_t)slots[t + PREFETCH] * kv_row + h * d);
        const float *kt = k_buf + (int64_t)slots[t] * kv_row + h * d;
        for (int64_t r = 0; r < rep; r++) scores[r * len + t] = rl_dot(q + r * d, kt, d) * scale;
    }
    for (int64_t r = 0; r < rep; r++) {
        float *sr = scores + r * len;
        const float inv = softmax_n(sr, len, f, h * rep + r);
#pragma omp simd
        for (int64_t t = 0; t < len; t++) sr[t] *= inv;
    }
    memset(o, 0, sizeof(float) * rep * d);
    for (int64_t t = 0; t < len; t++) {
        if (t + PREFETCH < len) __builtin_prefetch(v_buf + (int64_t)slots[t + PREFETCH] * kv_row + h * d);
        const float *vt = v_buf + (int64_t)slots[t] * kv_row + h * d;
        for (int64_t r = 0; r < rep; r++) {
            const float p = scores[r * len + t];
            float *orow = o + r * d;
#pragma omp simd
            for (int64_t j = 0; j < d; j++) orow[j] += p * vt[j];
        }
    }
}

/* the usual head sizes get their own copies, with d a constant the compiler unrolls */
static void decode_item_64(const float *q, float *o, const float *k_buf, const float *v_buf, const int32_t *slots,
                           int64_t len, int64_t h, int64_t rep, int64_t kv_row, float scale, float *scores,
                           const rl_attn_features *f) {
    decode_item(q, o, k_buf, v_buf, slots, len, h, rep, kv_row, scale, scores, f, 64);
}

static void decode_item_128(const float *q, float *o, const float *k_buf, const float *v_buf, const int32_t *slots,
                            int64_t len, int64_t h, int64_t rep, int64_t kv_row, float scale, float *scores,
                            const rl_attn_features *f) {
    decode_item(q, o, k_buf, v_buf, slots, len, h, rep, kv_row, scale, scores, f, 128);
}

int rl_decode_attention(const float *q, int64_t q_stride, const float *k_buf, const float *v_buf,
                        const int32_t *req_to_token, int64_t r2t_stride, const int64_t *req_idx,
                        const int64_t *seq_lens, float *out, int64_t bs, int64_t hq, int64_t hkv, int64_t d,
                        float scale, int64_t window, float softcap, const float *sinks, int nthreads) {
    const int64_t rep = hq / hkv, items = bs * hkv, kv_row = hkv * d;
    const rl_attn_features feat = {window, softcap, sinks}, *f = &feat;
    int64_t max_len = 1;
    for (int64_t b = 0; b < bs; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && items > 1)
    {
        float *scores = malloc(sizeof(float) * rep * max_len);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int64_t b = it / hkv, h = it % hkv, len = seq_lens[b];
            const int32_t *slots = req_to_token + req_idx[b] * r2t_stride;
            const float *qh = q + b * q_stride + h * rep * d;
            float *oh = out + (b * hq + h * rep) * d;
            if (scores == NULL || len <= 0) {
                memset(oh, 0, sizeof(float) * rep * d);
            } else if (d == 64) {
                decode_item_64(qh, oh, k_buf, v_buf, slots, len, h, rep, kv_row, scale, scores, f);
            } else if (d == 128) {
                decode_item_128(qh, oh, k_buf, v_buf, slots, len, h, rep, kv_row, scale, scores, f);
            } else {
                decode_item(qh, oh, k_buf, v_buf, slots, len, h, rep, kv_row, scale, scores, f, d);
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* one weight row against rows i0 .. i0 + cols - 1 of x (2 <= cols <= 4), into out[0 .. cols) */
static inline __attribute__((always_inline)) void row_dots(const float *wo, const float *x, int64_t k, int64_t i0,
                                                           const int cols, float *out) {
    v16f acc[4] = {{0}, {0}, {0}, {0}};
    int64_t j = 0;
    for (; j + 16 <= k; j += 16) {
        const v16f wv = load16(wo + j);
        for (int c = 0; c < cols; c++) acc[c] += wv * load16(x + (i0 + c) * k + j);
    }
    for (int c = 0; c < cols; c++) {
        float s = hsum16(acc[c]);
        for (int64_t t = j; t < k; t++) s += wo[t] * x[(i0 + c) * k + t];
        out[c] = s;
    }
}

/* y[i, o] = sum_j x[i, j] * w[o, j] (+ bias[o]) for a few rows of x: the weight stays in PyTorch's
 * row-major [n, k] layout and is read once, row after row (one sequential stream per thread, which
 * the hardware prefetcher keeps ahead of); each weight row, in L1 once read, is scored against the
 * rows of x up to four at a time, each 16-float chunk of the weight loaded once for all of them.
 * At batch 1 this reads the weights near memory bandwidth: over SmolLM2's linears it beat oneDNN's
 * packed matmul at 1-3 rows and matched it at 4-5 (docs/cpu.md has the figures). (Interleaving four
 * weight rows per block, or four accumulators along k at one row, both ran slower.) */
void rl_linear(const float *x, const float *w, const float *bias, float *y, int64_t m, int64_t n, int64_t k,
               int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && n * k >= PAR_MIN)
    for (int64_t o = 0; o < n; o++) {
        const float *wo = w + o * k;
        const float b = bias ? bias[o] : 0.0f;
        float r[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        int64_t i0 = 0;
        for (; i0 + 4 <= m; i0 += 4) {
            row_dots(wo, x, k, i0, 4, r);
            for (int c = 0; c < 4; c++) y[(i0 + c) * n + o] = r[c] + b;
        }
        switch (m - i0) {
            case 3: row_dots(wo, x, k, i0, 3, r); break;
            case 2: row_dots(wo, x, k, i0, 2, r); break;
            case 1: r[0] = rl_dot(wo, x + i0 * k, k); break;
            default: break;
        }
        for (int64_t c = 0; c < m - i0; c++) y[(i0 + c) * n + o] = r[c] + b;
    }
}

/* Extend (multi-token, causal) attention over paged KV: prefill, chunked prefill, questions after a
 * cached few-shot prefix.
 * q: [tokens, hq, d], rows q_stride floats apart; out: [tokens, hq, d] contiguous. Request b owns
 * query rows q_start[b] .. q_start[b] + ext_len[b] - 1, at positions prefix_len[b] + t, and query t
 * sees the first prefix_len[b] + t + 1 slots of row req_idx[b] of req_to_token (its own new k/v
 * must already be in the pool). d must be a multiple of 64, at most 256.
 * Work items are (request, kv head, chunk of up to 8 blocks of EXT_QB query tokens). An item copies
 * the keys its chunk can see, transposed ([d][keys]), into a per-thread buffer once; then for each
 * block it scores the rep * EXT_QB query rows (the grouped heads together) against the keys that
 * block can see as a small matrix product, 8 rows x 32 keys
 * per register block; an exact softmax per row; then P @ V with values read straight from the pool,
 * 6 rows x 64 dims per register block (24 accumulators: each value row loaded serves 6 rows; 4 rows
 * per block ran the whole kernel slower). torch's flash SDPA ran these shapes at a fraction of this
 * kernel's rate, after gathering and repeating every request's k/v for each query head (docs/cpu.md). */
#define EXT_QB 16

static void ext_scores(const float *const *qr, const float *kt, int64_t nk_pad, int64_t j0, int64_t d,
                       float scale, float *const *sr) {
    v16f a[8][2];
    for (int r = 0; r < 8; r++) a[r][0] = a[r][1] = (v16f){0};
    for (int64_t c = 0; c < d; c++) {
        const float *kc = kt + c * nk_pad + j0;
        const v16f k0 = load16(kc), k1 = load16(kc + 16);
        for (int r = 0; r < 8; r++) {
            const float b = qr[r][c];  /* scalar * vector: a broadcast load (v16f{0} + x would add) */
            a[r][0] += b * k0;
            a[r][1] += b * k1;
        }
    }
    for (int r = 0; r < 8; r++) {
        store16(sr[r] + j0, a[r][0] * scale);
        store16(sr[r] + j0 + 16, a[r][1] * scale);
    }
}

#define EXT_PVR 6

/* out rows [EXT_PVR][64 dims from c0] = sum_j p[r][j] * v[j][c0 .. c0 + 64), scaled by inv[r] */
static void ext_pv(const float *const *pr, const float *v_buf, const int32_t *slots, int64_t nk, int64_t kv_off,
                   int64_t kv_row, int64_t c0, const float *inv, float *const *orow) {
    v16f a[EXT_PVR][4] = {{{0}}};
    for (int64_t j = 0; j < nk; j++) {
        if (j + PREFETCH < nk) __builtin_prefetch(v_buf + (int64_t)slots[j + PREFETCH] * kv_row + kv_off + c0);
        const float *vj = v_buf + (int64_t)slots[j] * kv_row + kv_off + c0;
        const v16f v0 = load16(vj), v1 = load16(vj + 16), v2 = load16(vj + 32), v3 = load16(vj + 48);
        for (int r = 0; r < EXT_PVR; r++) {
            const float p = pr[r][j];
            a[r][0] += p * v0; a[r][1] += p * v1; a[r][2] += p * v2; a[r][3] += p * v3;
        }
    }
    for (int r = 0; r < EXT_PVR; r++)
        for (int x = 0; x < 4; x++) store16(orow[r] + c0 + 16 * x, a[r][x] * inv[r]);
}

/* query blocks of one request and kv head per work item: the item gathers the keys once for all its blocks */
#define EXT_CHUNK (8 * EXT_QB)

static inline int64_t ext_chunks(int64_t n) { return (n + EXT_CHUNK - 1) / EXT_CHUNK; }

int rl_extend_attention(const float *q, int64_t q_stride, const float *k_buf, const float *v_buf,
                        const int32_t *req_to_token, int64_t r2t_stride, const int64_t *req_idx,
                        const int64_t *q_start, const int64_t *prefix_len, const int64_t *ext_len, float *out,
                        int64_t bs, int64_t hq, int64_t hkv, int64_t d, float scale, int64_t window, float softcap,
                        const float *sinks, int nthreads) {
    const int64_t rep = hq / hkv, kv_row = hkv * d, rows_max = rep * EXT_QB;
    const rl_attn_features feat = {window, softcap, sinks}, *f = &feat;
    int64_t items = 0, nk_max = 32;
    for (int64_t b = 0; b < bs; b++) {
        items += hkv * ext_chunks(ext_len[b]);
        const int64_t nk = (prefix_len[b] + ext_len[b] + 31) / 32 * 32;
        nk_max = nk > nk_max ? nk : nk_max;
    }
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && items > 1)
    {
        float *kt = malloc(sizeof(float) * d * nk_max);
        float *sc = malloc(sizeof(float) * (rows_max + 7) * nk_max), *inv = malloc(sizeof(float) * rows_max);
        if (kt == NULL || sc == NULL || inv == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (kt == NULL || sc == NULL || inv == NULL) continue;
            /* item it -> (request b, kv head h, chunk): walk the requests' item counts */
            int64_t b = 0, rest = it;
            while (rest >= hkv * ext_chunks(ext_len[b])) {
                rest -= hkv * ext_chunks(ext_len[b]);
                b++;
            }
            const int64_t h = rest % hkv, t_begin = (rest / hkv) * EXT_CHUNK;
            const int64_t t_end = ext_len[b] - t_begin < EXT_CHUNK ? ext_len[b] : t_begin + EXT_CHUNK;
            /* key indices below are relative to k0: with a window, the chunk's first query (position
             * prefix + t_begin) sees no key before it, nor does any later query */
            const int64_t first = prefix_len[b] + t_begin;
            const int64_t k0 = window > 0 && first + 1 > window ? first + 1 - window : 0;
            const int64_t nk_all = prefix_len[b] + t_end - k0, ks = (nk_all + 31) / 32 * 32;
            const int32_t *slots = req_to_token + req_idx[b] * r2t_stride + k0;
            /* keys transposed, kt[c][j] = k(slot j)[h][c] (row stride ks), 16 keys at a time so that each
             * store run fills a cache line; the padding keys are zero (their scores are masked) */
            for (int64_t j0 = 0; j0 < nk_all; j0 += 16) {
                const int64_t nj = nk_all - j0 < 16 ? nk_all - j0 : 16;
                const float *kr[16];
                for (int64_t j = 0; j < nj; j++) kr[j] = k_buf + (int64_t)slots[j0 + j] * kv_row + h * d;
                for (int64_t c = 0; c < d; c++) {
                    float *dst = kt + c * ks + j0;
                    for (int64_t j = 0; j < nj; j++) dst[j] = kr[j][c];
                }
            }
            for (int64_t c = 0; c < d; c++) memset(kt + c * ks + nk_all, 0, sizeof(float) * (ks - nk_all));
            for (int64_t t0 = t_begin; t0 < t_end; t0 += EXT_QB) {
                const int64_t nt = t_end - t0 < EXT_QB ? t_end - t0 : EXT_QB;
                const int64_t nk = prefix_len[b] + t0 + nt - k0, nk_pad = (nk + 31) / 32 * 32, rows = nt * rep;
                /* query row i = token t0 + i / rep, head h * rep + i % rep; rows past the end repeat the last */
                const float *qr[8];
                float *sr[8];
                for (int64_t i0 = 0; i0 < rows; i0 += 8) {
                    for (int r = 0; r < 8; r++) {
                        const int64_t i = i0 + r < rows ? i0 + r : rows - 1;
                        qr[r] = q + (q_start[b] + t0 + i / rep) * q_stride + (h * rep + i % rep) * d;
                        sr[r] = sc + (i0 + r) * nk_pad;
                    }
                    for (int64_t j0 = 0; j0 < nk_pad; j0 += 32) ext_scores(qr, kt, ks, j0, d, scale, sr);
                }
                for (int64_t i = 0; i < rows; i++) {  /* query position pos sees keys lo .. end - 1 */
                    float *s = sc + i * nk_pad;
                    const int64_t pos = prefix_len[b] + t0 + i / rep, end = pos + 1 - k0;
                    const int64_t lo = window > 0 && pos + 1 > window ? pos + 1 - window - k0 : 0;
                    inv[i] = softmax_n(s + lo, end - lo, f, h * rep + i % rep);
                    memset(s, 0, sizeof(float) * lo);
                    memset(s + end, 0, sizeof(float) * (nk_pad - end));
                }
                const float *pr[EXT_PVR];
                float *orow[EXT_PVR], spare[EXT_PVR][256];
                for (int64_t i0 = 0; i0 < rows; i0 += EXT_PVR) {
                    float iv[EXT_PVR];
                    for (int r = 0; r < EXT_PVR; r++) {
                        const int64_t i = i0 + r;
                        pr[r] = sc + (i < rows ? i : rows - 1) * nk_pad;
                        iv[r] = inv[i < rows ? i : rows - 1];
                        orow[r] = i < rows ? out + ((q_start[b] + t0 + i / rep) * hq + h * rep + i % rep) * d
                                           : spare[r];
                    }
                    const int64_t last = i0 + EXT_PVR - 1 < rows ? i0 + EXT_PVR - 1 : rows - 1;
                    const int64_t nk_rows = prefix_len[b] + t0 + last / rep + 1 - k0;
                    for (int64_t c0 = 0; c0 < d; c0 += 64)
                        ext_pv(pr, v_buf, slots, nk_rows, h * d, kv_row, c0, iv, orow);
                }
            }
        }
        free(kt);
        free(sc);
        free(inv);
    }
    return failed ? -1 : 0;
}
