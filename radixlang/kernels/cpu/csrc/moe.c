/* The routed experts of a mixture-of-experts MLP for the few tokens of a decode step, in one call.
 *
 * At batch 32 with 16 experts and top-4, each expert sees ~8 rows: a matmul of 8 rows is far too small
 * for oneDNN/MKL to stream its weight at memory speed (one F.linear per expert read SmolMoE-sized
 * experts at ~10 GB/s here, a third of the machine's read bandwidth), and rl_linear's one-weight-row
 * kernel, made for 1-4 rows, turns compute-bound past 4. Here every expert's weights are read once per
 * call from PyTorch's own row-major layout (w13 [E, 2 * inter, hidden], gate rows then up rows; w2
 * [E, hidden, inter]), 4 weight rows at a time, each 16-float chunk of them multiplied into 4 token rows
 * held in L1 (16 accumulators, summed by one transposing tree): half a load per FMA.
 *
 * One parallel region, four phases split by OpenMP's barriers:
 *   1. the (token, choice) pairs sorted by expert (a counting sort, stable), their rows of x gathered;
 *   2. act[pair] = silu(x w_gate^T) * (x w_up^T), work items (expert, 32 intermediate features);
 *   3. y[pair] = act[pair] w2^T, work items (expert, 32 hidden features);
 *   4. out[t] = sum_j weights[t, j] * y[pair (t, j)], in choice order (no atomics: deterministic).
 * Expert ids are trusted (the router's top-k); the Python wrapper checks shapes and strides. */
#include <stdint.h>
#include <string.h>

#include "vec.h"

#define MOE_BLOCK 32 /* output features per work item; a multiple of 4 */

/* lane f * 4 + r of the result = dot(w row f, x row r) over k, for 4 weight rows ldw floats apart and nr
 * (1-4) x rows (lanes of rows past nr are 0). The next 4 weight rows are prefetched as these stream by: one
 * cache line of each per 16 floats read, so the next quad is in cache when the caller gets to it. */
static inline __attribute__((always_inline)) v16f dots4(const float *w, int64_t ldw, const float *const *xr,
                                                        int64_t k, const int nr) {
    v16f acc[16] = {{0}};
    int64_t c = 0;
    for (; c + 16 <= k; c += 16) {
        v16f wv[4];
        for (int f = 0; f < 4; f++) {
            __builtin_prefetch(w + (4 + f) * ldw + c);
            wv[f] = load16(w + f * ldw + c);
        }
        for (int r = 0; r < nr; r++) {
            const v16f xv = load16(xr[r] + c);
            for (int f = 0; f < 4; f++) acc[f * 4 + r] += wv[f] * xv;
        }
    }
    v16f s = hsum16x16(acc);
    for (; c < k; c++)
        for (int f = 0; f < 4; f++)
            for (int r = 0; r < nr; r++) s[f * 4 + r] += w[f * ldw + c] * xr[r][c];
    return s;
}

/* dots4 with nr a compile-time constant in each branch, so its row loop unrolls */
static v16f dots4_rows(const float *w, int64_t ldw, const float *const *xr, int64_t k, int nr) {
    switch (nr) {
        case 4: return dots4(w, ldw, xr, k, 4);
        case 3: return dots4(w, ldw, xr, k, 3);
        case 2: return dots4(w, ldw, xr, k, 2);
        default: return dots4(w, ldw, xr, k, 1);
    }
}

/* act rows [rows, inter] for features j0 .. j1 of one expert: silu(gate) * up */
static void gate_up_block(const float *w13, const float *xs, float *act, int64_t rows, int64_t hidden,
                          int64_t inter, int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; j += 4)
        for (int64_t r0 = 0; r0 < rows; r0 += 4) {
            const int nr = rows - r0 < 4 ? (int)(rows - r0) : 4;
            const float *xr[4];
            for (int r = 0; r < nr; r++) xr[r] = xs + (r0 + r) * hidden;
            const v16f g = dots4_rows(w13 + j * hidden, hidden, xr, hidden, nr);
            const v16f u = dots4_rows(w13 + (inter + j) * hidden, hidden, xr, hidden, nr);
            const v16f a = g / (1.0f + rl_exp16(-g)) * u; /* silu(g) * u, lane f * 4 + r */
            for (int r = 0; r < nr; r++)
                for (int f = 0; f < 4; f++) act[(r0 + r) * inter + j + f] = a[f * 4 + r];
        }
}

/* y rows [rows, hidden] for features o0 .. o1 of one expert's down projection */
static void down_block(const float *w2, const float *act, float *y, int64_t rows, int64_t hidden, int64_t inter,
                       int64_t o0, int64_t o1) {
    for (int64_t o = o0; o < o1; o += 4)
        for (int64_t r0 = 0; r0 < rows; r0 += 4) {
            const int nr = rows - r0 < 4 ? (int)(rows - r0) : 4;
            const float *ar[4];
            for (int r = 0; r < nr; r++) ar[r] = act + (r0 + r) * inter;
            const v16f d = dots4_rows(w2 + o * inter, inter, ar, inter, nr);
            for (int r = 0; r < nr; r++)
                for (int f = 0; f < 4; f++) y[(r0 + r) * hidden + o + f] = d[f * 4 + r];
        }
}

/* out [n, hidden] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for n tokens of top_k choices.
 * x [n, hidden]; ids [n, top_k] int64 in [0, num_experts); weights [n, top_k] float32;
 * w13 [num_experts, 2 * inter, hidden]; w2 [num_experts, hidden, inter]; hidden and inter multiples of 4.
 * scratch: n * top_k * (2 * hidden + inter) floats; index: 2 * n * top_k + num_experts + 1 int64s. */
void rl_moe_experts(const float *x, const int64_t *ids, const float *weights, const float *w13, const float *w2,
                    float *out, float *scratch, int64_t *index, int64_t n, int64_t top_k, int64_t hidden,
                    int64_t inter, int64_t num_experts, int nthreads) {
    const int64_t pairs = n * top_k;
    int64_t *slot = index;          /* [pairs]: where pair p = t * top_k + j sits in expert order */
    int64_t *token = index + pairs; /* [pairs]: the token of each slot */
    int64_t *start = token + pairs; /* [num_experts + 1]: each expert's first slot */
    float *xs = scratch, *act = xs + pairs * hidden, *y = act + pairs * inter;
    const int64_t up_blocks = (inter + MOE_BLOCK - 1) / MOE_BLOCK, down_blocks = (hidden + MOE_BLOCK - 1) / MOE_BLOCK;

    memset(start, 0, sizeof(int64_t) * (num_experts + 1));
    for (int64_t p = 0; p < pairs; p++) start[ids[p] + 1]++;
    for (int64_t e = 0; e < num_experts; e++) start[e + 1] += start[e];
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t s = start[ids[p]]++;
        slot[p] = s;
        token[s] = p / top_k;
    }
    for (int64_t e = num_experts; e > 0; e--) start[e] = start[e - 1]; /* the ++ above moved each start */
    start[0] = 0;

#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t s = 0; s < pairs; s++) memcpy(xs + s * hidden, x + token[s] * hidden, sizeof(float) * hidden);

#pragma omp for schedule(dynamic, 2)
        for (int64_t item = 0; item < num_experts * up_blocks; item++) {
            const int64_t e = item / up_blocks, rows = start[e + 1] - start[e];
            if (rows == 0) continue;
            const int64_t j0 = (item % up_blocks) * MOE_BLOCK, j1 = j0 + MOE_BLOCK < inter ? j0 + MOE_BLOCK : inter;
            gate_up_block(w13 + e * 2 * inter * hidden, xs + start[e] * hidden, act + start[e] * inter, rows, hidden,
                          inter, j0, j1);
        }

#pragma omp for schedule(dynamic, 2)
        for (int64_t item = 0; item < num_experts * down_blocks; item++) {
            const int64_t e = item / down_blocks, rows = start[e + 1] - start[e];
            if (rows == 0) continue;
            const int64_t o0 = (item % down_blocks) * MOE_BLOCK;
            const int64_t o1 = o0 + MOE_BLOCK < hidden ? o0 + MOE_BLOCK : hidden;
            down_block(w2 + e * hidden * inter, act + start[e] * inter, y + start[e] * hidden, rows, hidden, inter,
                       o0, o1);
        }

#pragma omp for schedule(static)
        for (int64_t t = 0; t < n; t++) {
            float *o = out + t * hidden;
            for (int64_t c = 0; c < hidden; c++) o[c] = 0.0f;
            for (int64_t j = 0; j < top_k; j++) {
                const float wt = weights[t * top_k + j];
                const float *yr = y + slot[t * top_k + j] * hidden;
#pragma omp simd
                for (int64_t c = 0; c < hidden; c++) o[c] += wt * yr[c];
            }
        }
    }
}
