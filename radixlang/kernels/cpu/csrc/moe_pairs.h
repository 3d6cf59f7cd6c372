/* What a mixture-of-experts layer's call does around its experts, shared by moe.c (float32 experts) and
 * quant_vnni.c (quantized ones): the (token, choice) pairs sorted by expert, and each token's output summed
 * back from its experts' rows. */
#ifndef RL_MOE_PAIRS_H
#define RL_MOE_PAIRS_H

#include <stdint.h>
#include <string.h>

/* A stable counting sort of pairs p = t * top_k + j by expert ids[p]: slot[p] is where pair p sits in expert
 * order, token[s] the token of slot s, and expert e holds slots start[e] .. start[e + 1] - 1. */
static inline void moe_sort_pairs(const int64_t *ids, int64_t pairs, int64_t top_k, int64_t num_experts,
                                  int64_t *slot, int64_t *token, int64_t *start) {
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
}

/* out[t] = sum_j weights[t, j] * y[slot[t, j]] (rows ld floats apart), in choice order: no atomics, the same
 * numbers whatever the threads */
static inline void moe_sum_token(float *out, const float *weights, const int64_t *slot, const float *y, int64_t ld,
                                 int64_t top_k, int64_t hidden, int64_t t) {
    float *o = out + t * hidden;
    for (int64_t c = 0; c < hidden; c++) o[c] = 0.0f;
    for (int64_t j = 0; j < top_k; j++) {
        const float wt = weights[t * top_k + j];
        const float *yr = y + slot[t * top_k + j] * ld;
#pragma omp simd
        for (int64_t c = 0; c < hidden; c++) o[c] += wt * yr[c];
    }
}

#endif
