/* The routed experts of a mixture-of-experts MLP (SwiGLU), every token count, in one call.
 *
 * Each expert's weights are read once per call in panels packed at load time (moe_pack in the Python
 * wrapper), a layout made for this loop: a panel is 32 output features side by side for every input
 * feature, [k][32] floats, read front to back. One pass over a panel serves a block of up to MOE_ROWS of
 * the expert's token rows: per input feature c, the panel's 32 floats are loaded once and multiplied by a
 * broadcast of each row's x[c] into that row's 32 sums, held in registers; the sums come out as whole
 * vectors: no horizontal sums, no tail past the last 16 inputs. An expert of
 * more rows runs one pass per block, the panel then coming from L2. The token rows of a block are
 * transposed when gathered ([k][rows]), so that the broadcasts read one pointer.
 *
 *   p13 [E][ip / 16][hidden][32]: ip = inter rounded up to 16; floats 0-15 of a row are the gate features
 *        16 b .. 16 b + 15 at one input feature, floats 16-31 the same up features, so silu(gate) * up
 *        comes out of one pass (features past inter are zero);
 *   p2  [E][hp / 32][inter][32]: hp = hidden rounded up to 32; 32 output features of the down projection.
 *
 * Against oneDNN's matmul per expert this reads the weights once for all a step's tokens (a decode step
 * of 32 tokens over 16 experts gives each ~8 rows, far too few for a matmul to stream its weight at memory
 * speed) and, at prefill sizes, keeps the FMA units busier (see docs/cpu.md for the figures).
 *
 * One parallel region, four phases split by OpenMP's barriers:
 *   1. the (token, choice) pairs sorted by expert (a counting sort, stable), their rows of x gathered
 *      into the experts' transposed row blocks;
 *   2. act = silu(x w_gate^T) * (x w_up^T), work items (expert, 16 intermediate features), written
 *      transposed for phase 3;
 *   3. y = act w2^T, work items (expert, 32 hidden features);
 *   4. out[t] = sum_j weights[t, j] * y[pair (t, j)], in choice order (no atomics: deterministic).
 * Each sum runs over the input features in order in one accumulator, whatever the block, so a token's
 * result does not depend on the other tokens of its expert. Expert ids are trusted (the router's top-k);
 * the Python wrapper checks shapes and strides. */
#include <stdint.h>
#include <string.h>

#include "moe_pairs.h"
#include "vec.h"

/* One pass holds MOE_ROWS x 32 sums in registers, as vectors of VW floats: with AVX-512, 12 rows of two zmm
 * (24 of the 32 registers); with AVX2, 4 rows of four ymm (all 16: the weights are read as FMA operands),
 * which ran faster than 2 or 3 rows at 32 tokens (docs/cpu.md; 8-float vectors there: GCC turned
 * 16-float ones into stack traffic). */
#if defined(__AVX512F__)
#define MOE_ROWS 12
#define VW 16
typedef float vpan __attribute__((vector_size(64)));
static inline vpan bcast(float v) { return (vpan){v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v}; }
#else
#define MOE_ROWS 4
#define VW 8
typedef float vpan __attribute__((vector_size(32)));
static inline vpan bcast(float v) { return (vpan){v, v, v, v, v, v, v, v}; }
#endif
#define NV (32 / VW)

/* sums[r * ld + f] = sum_c xt[c * nr + r] * panel[c * 32 + f] (f < 32) over k inputs, for nr rows */
static inline __attribute__((always_inline)) void panel_pass(const float *panel, const float *xt, int64_t k,
                                                             const int nr, float *sums, int64_t ld) {
    vpan acc[MOE_ROWS][NV];
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = bcast(0.0f);
    for (int64_t c = 0; c < k; c++) {
        vpan w[NV];
        for (int v = 0; v < NV; v++) memcpy(&w[v], panel + c * 32 + v * VW, sizeof(vpan));
        for (int r = 0; r < nr; r++) {
            const vpan xb = bcast(xt[c * nr + r]);
            for (int v = 0; v < NV; v++) acc[r][v] += w[v] * xb;
        }
    }
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < NV; v++) memcpy(sums + r * ld + v * VW, &acc[r][v], sizeof(vpan));
}

/* panel_pass with nr a compile-time constant in each branch, so its loops unroll into registers */
static void panel_rows(const float *panel, const float *xt, int64_t k, int nr, float *sums, int64_t ld) {
#define CASE(n) case n: panel_pass(panel, xt, k, n, sums, ld); return;
    switch (nr) {
#if MOE_ROWS >= 12
        CASE(12) CASE(11) CASE(10) CASE(9) CASE(8) CASE(7) CASE(6) CASE(5)
#endif
        CASE(4) CASE(3) CASE(2)
        default: panel_pass(panel, xt, k, 1, sums, ld);
    }
#undef CASE
}

/* the size of the row blocks an expert's rows are split into: as few blocks as MOE_ROWS allows, each block
 * but the last this many rows (AVX-512: 16 rows 8 + 8, 25 rows 9 + 9 + 7, 133 rows eleven of 12 and one of 1;
 * the passes are as many as with equal blocks) */
static inline int64_t row_block(int64_t rows) {
    const int64_t blocks = (rows + MOE_ROWS - 1) / MOE_ROWS;
    return (rows + blocks - 1) / blocks;
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* out [n, hidden] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for n tokens of top_k choices.
 * x [n, hidden]; ids [n, top_k] int64 in [0, num_experts); weights [n, top_k] float32; p13, p2 packed as
 * above. scratch: n * top_k * (hidden + ip + hp) floats; index: 2 * n * top_k + num_experts + 1 int64s. */
void rl_moe_experts(const float *x, const int64_t *ids, const float *weights, const float *p13, const float *p2,
                    float *out, float *scratch, int64_t *index, int64_t n, int64_t top_k, int64_t hidden,
                    int64_t inter, int64_t num_experts, int nthreads) {
    const int64_t pairs = n * top_k;
    const int64_t ip = (inter + 15) / 16 * 16, hp = (hidden + 31) / 32 * 32;
    const int64_t up_panels = ip / 16, down_panels = hp / 32;
    int64_t *slot = index;          /* [pairs]: where pair p = t * top_k + j sits in expert order */
    int64_t *token = index + pairs; /* [pairs]: the token of each slot */
    int64_t *start = token + pairs; /* [num_experts + 1]: each expert's first slot */
    /* from slot start[e] + r0 on, the block of rows r0 .. r0 + nr of expert e: xs [hidden][nr],
     * act [ip][nr] (both transposed), y [nr][hp] */
    float *xs = scratch, *act = xs + pairs * hidden, *y = act + pairs * ip;

    moe_sort_pairs(ids, pairs, top_k, num_experts, slot, token, start);

#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t e = 0; e < num_experts; e++) {
            const int64_t rows = start[e + 1] - start[e], block = row_block(rows > 0 ? rows : 1);
            for (int64_t r0 = 0; r0 < rows; r0 += block) {
                const int64_t nr = min64(rows - r0, block);
                float *dst = xs + (start[e] + r0) * hidden;
                for (int64_t r = 0; r < nr; r++) {
                    const float *src = x + token[start[e] + r0 + r] * hidden;
                    for (int64_t c = 0; c < hidden; c++) dst[c * nr + r] = src[c];
                }
            }
        }

#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_experts * up_panels; item++) {
            const int64_t e = item / up_panels, b = item % up_panels, rows = start[e + 1] - start[e];
            if (rows == 0) continue;
            const float *panel = p13 + (e * up_panels + b) * hidden * 32;
            const int64_t block = row_block(rows);
            for (int64_t r0 = 0; r0 < rows; r0 += block) {
                const int nr = (int)min64(rows - r0, block);
                float sums[MOE_ROWS * 32];
                panel_rows(panel, xs + (start[e] + r0) * hidden, hidden, nr, sums, 32);
                float *dst = act + (start[e] + r0) * ip + b * 16 * nr;
                for (int r = 0; r < nr; r++) {
                    const v16f a = silu_mul16(load16(sums + r * 32), load16(sums + r * 32 + 16));
                    for (int f = 0; f < 16; f++) dst[f * nr + r] = a[f];
                }
            }
        }

#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_experts * down_panels; item++) {
            const int64_t e = item / down_panels, b = item % down_panels, rows = start[e + 1] - start[e];
            if (rows == 0) continue;
            const float *panel = p2 + (e * down_panels + b) * inter * 32;
            const int64_t block = row_block(rows);
            for (int64_t r0 = 0; r0 < rows; r0 += block) {
                const int nr = (int)min64(rows - r0, block);
                panel_rows(panel, act + (start[e] + r0) * ip, inter, nr, y + (start[e] + r0) * hp + b * 32, hp);
            }
        }

#pragma omp for schedule(static)
        for (int64_t t = 0; t < n; t++) moe_sum_token(out, weights, slot, y, hp, top_k, hidden, t);
    }
}
