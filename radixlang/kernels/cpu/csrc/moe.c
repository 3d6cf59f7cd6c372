/* The routed experts of a mixture-of-experts MLP for the few tokens of a decode step, in one call.
 *
 * At batch 32 with 16 experts and top-4, each expert sees ~8 rows: a matmul of 8 rows is far too small
 * for oneDNN/MKL to stream its weight at memory speed (one F.linear per expert read SmolMoE-sized
 * experts at ~10 GB/s here, a third of the machine's read bandwidth), and rl_linear's one-weight-row
 * kernel, made for 1-4 rows, turns compute-bound past 4. Here every expert's weights are read once per
 * call from PyTorch's own row-major layout (w13 [E, 2 * inter, hidden], gate rows then up rows; w2
 * [E, hidden, inter]) in one pass per block of up to 12 of the expert's token rows: 2 weight rows at a
 * time, each 16-float chunk of them multiplied into every row of the block (24 accumulators), or 4 weight
 * rows at a time for an expert of 1-4 rows; the next weight rows are prefetched into L2 as these stream by.
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
#define MOE_ROWS 12  /* token rows one pass over the weight rows takes at most */

/* sums[f * nr + r] = dot(wr[f], xr[r]) over k for nw weight rows and nr x rows (nw * nr <= 32), in one pass
 * over the weight rows: each 16-float chunk of them is loaded once and multiplied into every x row (nw * nr
 * accumulators of the 32 vector registers, summed by one or two transposing trees). The rows pf_step floats
 * past the weight rows (the caller's next ones) are prefetched into L2 as these stream by, one cache line
 * per 16 floats: prefetched into L1, which holds the x rows (up to 12 x 3.5 KB of its 32 KB), the kernel
 * ran ~1.4x slower. Every sum takes the same order of additions whatever nw and nr are, so a token's result does not
 * depend on the other tokens of its expert. */
static inline __attribute__((always_inline)) void dots(const float *const *wr, int64_t pf_step,
                                                       const float *const *xr, int64_t k, const int nw,
                                                       const int nr, float *sums) {
    v16f acc[32] = {{0}};
    int64_t c = 0;
    for (; c + 16 <= k; c += 16) {
        v16f wv[4];
        for (int f = 0; f < nw; f++) {
            wv[f] = load16(wr[f] + c);
            __builtin_prefetch(wr[f] + pf_step + c, 0, 1);
        }
        for (int r = 0; r < nr; r++) {
            const v16f xv = load16(xr[r] + c);
            for (int f = 0; f < nw; f++) acc[f * nr + r] += wv[f] * xv;
        }
    }
    store16(sums, hsum16x16(acc));
    if (nw * nr > 16) store16(sums + 16, hsum16x16(acc + 16));
    for (; c < k; c++)
        for (int f = 0; f < nw; f++)
            for (int r = 0; r < nr; r++) sums[f * nr + r] += wr[f][c] * xr[r][c];
}

/* How many weight rows a pass takes for an expert whose row blocks are up to `block` rows: 4 for up to 4 rows
 * (a load per 4 FMAs at most, one tree per 16 sums), else 2, so that up to MOE_ROWS rows (24 accumulators)
 * share one pass. An expert's last block may be smaller than the others, but takes as many weight rows. */
static inline int pass_weight_rows(int64_t block) { return block <= 4 ? 4 : 2; }

/* dots with nw and nr compile-time constants in each branch, so its loops unroll into registers;
 * nw = 4 takes nr <= 4, nw = 2 nr <= MOE_ROWS */
static void dots_rows(const float *const *wr, int64_t pf_step, const float *const *xr, int64_t k, int nw, int nr,
                      float *sums) {
#define CASE(w, n) case n: dots(wr, pf_step, xr, k, w, n, sums); return;
    if (nw == 4) {
        switch (nr) {
            CASE(4, 4) CASE(4, 3) CASE(4, 2) default: dots(wr, pf_step, xr, k, 4, 1, sums); return;
        }
    }
    switch (nr) {
        CASE(2, 12) CASE(2, 11) CASE(2, 10) CASE(2, 9) CASE(2, 8) CASE(2, 7) CASE(2, 6) CASE(2, 5) CASE(2, 4)
        CASE(2, 3) CASE(2, 2) default: dots(wr, pf_step, xr, k, 2, 1, sums);
    }
#undef CASE
}

/* the size of the row blocks an expert's rows are split into: as few blocks as MOE_ROWS allows, of near-equal
 * size (16 rows: 8 + 8), each block but the last this many rows */
static inline int64_t row_block(int64_t rows) {
    const int64_t blocks = (rows + MOE_ROWS - 1) / MOE_ROWS;
    return (rows + blocks - 1) / blocks;
}

/* act rows [rows, inter] for features j0 .. j1 of one expert: silu(gate) * up. A pass takes the gate rows
 * j .. j + h - 1 then the up rows j .. j + h - 1, h = half its weight rows, so that lane f * nr + r (f < h)
 * of the sums is a gate and lane (h + f) * nr + r its up. */
static void gate_up_block(const float *w13, const float *xs, float *act, int64_t rows, int64_t hidden,
                          int64_t inter, int64_t j0, int64_t j1) {
    float sums[48] = {0};
    const int64_t block = row_block(rows);
    const int h = pass_weight_rows(block) / 2;
    for (int64_t j = j0; j < j1; j += h)
        for (int64_t r0 = 0; r0 < rows; r0 += block) {
            const int nr = (int)(rows - r0 < block ? rows - r0 : block);
            const float *xr[MOE_ROWS], *wr[4];
            for (int r = 0; r < nr; r++) xr[r] = xs + (r0 + r) * hidden;
            for (int f = 0; f < h; f++) {
                wr[f] = w13 + (j + f) * hidden;
                wr[h + f] = w13 + (inter + j + f) * hidden;
            }
            dots_rows(wr, h * hidden, xr, hidden, 2 * h, nr, sums);
            const v16f g = load16(sums), u = load16(sums + h * nr);
            const v16f a = g / (1.0f + rl_exp16(-g)) * u; /* silu(g) * u, lane f * nr + r */
            for (int f = 0; f < h; f++)
                for (int r = 0; r < nr; r++) act[(r0 + r) * inter + j + f] = a[f * nr + r];
        }
}

/* y rows [rows, hidden] for features o0 .. o1 of one expert's down projection */
static void down_block(const float *w2, const float *act, float *y, int64_t rows, int64_t hidden, int64_t inter,
                       int64_t o0, int64_t o1) {
    float sums[48];
    const int64_t block = row_block(rows);
    const int nw = pass_weight_rows(block);
    for (int64_t o = o0; o < o1; o += nw)
        for (int64_t r0 = 0; r0 < rows; r0 += block) {
            const int nr = (int)(rows - r0 < block ? rows - r0 : block);
            const float *ar[MOE_ROWS], *wr[4];
            for (int r = 0; r < nr; r++) ar[r] = act + (r0 + r) * inter;
            for (int f = 0; f < nw; f++) wr[f] = w2 + (o + f) * inter;
            dots_rows(wr, nw * inter, ar, inter, nw, nr, sums);
            for (int f = 0; f < nw; f++)
                for (int r = 0; r < nr; r++) y[(r0 + r) * hidden + o + f] = sums[f * nr + r];
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
