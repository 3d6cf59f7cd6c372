/* A whole decode step of a Llama-family decoder on quantized (or float32) weights, every layer in one call.
 *
 * At batch 1 a step of a small model is mostly fixed costs: each of the ~10 ops of a layer crossed from
 * Python into a kernel with its own checks, views and allocations, costs of the order of the layer's weight
 * reads (SmolLM2: docs/cpu.md, "The fused decode step"). Here the same kernels run back to back in C: this
 * file is compiled into one library with cpu_ops.c (norms, rotary, KV write, paged decode attention),
 * quant_ops.c (quantized linears on float32 activations) and quant_vnni.c (the same on int8 activations),
 * and calls their public functions in the order the Python layer does, with the same arguments, so the
 * numbers are the Python path's. Each kernel keeps its own OpenMP loop over the thread team.
 *
 * Per layer, on m rows (x: the previous sublayer's output, residual: the sum before it):
 *   residual += x; x = rms_norm(residual) * ln1          (layer 0: residual = x)
 *   qkv = x @ Wqkv^T (+ b); per-head rms_norm of q and k (q_norm / k_norm, when given); rotary on q and k
 *   k, v -> the KV pool at loc; attn = paged decode attention of q over each request's slots (or, for an
 *   extend of a few tokens, such as a speculative verify, the causal extend attention)
 *   h = attn @ Wo^T; residual += h; h = rms_norm(residual) * ln2
 *   x = (silu(h @ Wgate^T) * (h @ Wup^T)) @ Wdown^T
 * The caller applies the final norm. Everything is float32; the Python side (kernels/cpu/decode_stack.py)
 * checks shapes and indices once per step.
 */
#include <stdint.h>
#include <string.h>

/* the other translation units of this library */
void rl_rms_norm(const float *x, int64_t x_stride, const float *w, float *out, int64_t n, int64_t d, float eps,
                 int nthreads);
void rl_add_rms_norm(float *x, float *residual, const float *w, int64_t n, int64_t d, float eps, int nthreads);
void rl_rope(float *x, int64_t row_stride, int64_t n, int64_t heads, int64_t d, const int64_t *pos,
             const float *cos_t, const float *ssin_t, int nthreads);
void rl_silu_mul(const float *gu, float *out, int64_t n, int64_t inter, int nthreads);
void rl_store_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, float *k_buf, float *v_buf,
                 const int64_t *loc, int64_t n, int64_t width);
int rl_extend_attention(const float *q, int64_t q_stride, const float *k_buf, const float *v_buf,
                        const int32_t *req_to_token, int64_t r2t_stride, const int64_t *req_idx,
                        const int64_t *q_start, const int64_t *prefix_len, const int64_t *ext_len, float *out,
                        int64_t bs, int64_t hq, int64_t hkv, int64_t d, float scale, int64_t window, float softcap,
                        const float *sinks, int nthreads);
void rl_linear(const float *x, const float *w, const float *bias, float *y, int64_t m, int64_t n, int64_t k,
               int nthreads);
int rl_decode_attention(const float *q, int64_t q_stride, const float *k_buf, const float *v_buf,
                        const int32_t *req_to_token, int64_t r2t_stride, const int64_t *req_idx,
                        const int64_t *seq_lens, float *out, int64_t bs, int64_t hq, int64_t hkv, int64_t d,
                        float scale, int64_t window, float softcap, const float *sinks, int nthreads);
void rl_q4_linear(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *scales,
                  const float *offsets, const float *bias, float *y, int64_t N, int nthreads);
void rl_q8_linear(const float *x, int64_t M, int64_t K, int64_t G, const int8_t *codes, const float *scales,
                  const float *offsets, const float *bias, float *y, int64_t N, int nthreads);
int rl_q4_linear_i8(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *scales,
                    const float *offsets, const float *bias, float *y, int64_t N, int passes, int nthreads);
int rl_q8_linear_i8(const float *x, int64_t M, int64_t K, int64_t G, const int8_t *codes, const float *scales,
                    const float *offsets, const float *bias, float *y, int64_t N, int passes, int nthreads);
int rl_q4x16_linear_i8(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *scales,
                       const float *offsets, const float *bias, float *y, int64_t N, int passes, int nthreads);
int rl_q8x16_linear_i8(const float *x, int64_t M, int64_t K, int64_t G, const uint8_t *codes, const float *scales,
                       const float *offsets, const float *bias, float *y, int64_t N, int passes, int nthreads);

/* One quantized weight (kernels/cpu/quant.py: QuantWeight). layout: 0 q4, 1 q8, 2 q4x16, 3 q8x16 (interleaved
 * by 16 features: only the int8 kernels read them; quant.py gives them int8 activations up to 16 rows, the
 * most a fused step takes); 4: a float32 weight [out, in] row-major in `codes` (cpu_ops.c: rl_linear, the
 * small-row kernel a float32 PackedLinear runs; no scales or offsets).
 * int8_rows: up to how many rows it takes int8 activations (quant.py: int8_max_rows; 0: never), in `passes`
 * passes, as quant.linear does; offsets is always the full array (the int8 kernels skip it where has_offsets
 * is 0). */
typedef struct {
    int64_t layout, group, out, in, has_offsets, int8_rows;
    const void *codes;
    const float *scales, *offsets, *bias;
} rl_qweight;

typedef struct {
    const float *ln1, *ln2, *q_norm, *k_norm; /* q_norm, k_norm: NULL where the family has none */
    rl_qweight qkv, o, gate_up, down;
    float *k_buf, *v_buf; /* this layer's KV pool [slots, kv_heads, head_dim] */
    int64_t window;       /* sliding window (keys a query sees, itself included); 0: none */
    int64_t swa;          /* 1: k_buf / v_buf are indexed by the step's swa_* slots (a window slot space) */
} rl_layer;

/* One step: sizes, metadata and buffers; layer 0's input x starts the residual stream. */
typedef struct {
    int64_t m, hidden, heads, kv_heads, head_dim, passes, nthreads, r2t_stride;
    int64_t bs; /* requests; 0: a decode step (one row each, seq_lens), else an extend over q_start .. */
    double eps, qk_eps, scale;
    const int64_t *pos, *loc, *req_idx, *seq_lens, *q_start, *prefix_lens, *extend_lens;
    const int32_t *req_to_token;
    const float *cos, *ssin;
    float *x, *residual;              /* [m, hidden], in and out */
    float *qkv, *attn, *h, *gu, *act; /* scratch: [m, q + 2 kv], [m, q], [m, hidden], [m, 2 inter], [m, inter] */
    /* what swa layers read instead of loc, req_idx, req_to_token: the same tokens' slots in the window layers'
     * own slot space (the batch's rows translated, request i in row i) */
    int64_t swa_r2t_stride;
    const int64_t *swa_loc, *swa_req_idx;
    const int32_t *swa_req_to_token;
} rl_step;

/* Returns 0, or -1 where an interleaved weight's kernel could not run (no memory for the activations). */
static int qlin(const rl_step *s, const rl_qweight *w, const float *x, float *y) {
    const int nt = (int)s->nthreads, p = (int)s->passes;
    const float *off = w->has_offsets ? w->offsets : NULL;
    if (w->layout == 4) {
        rl_linear(x, (const float *)w->codes, w->bias, y, s->m, w->out, w->in, nt);
        return 0;
    }
    if (w->layout >= 2)
        return w->layout == 2 ? rl_q4x16_linear_i8(x, s->m, w->in, w->codes, w->scales, off, w->bias, y, w->out, p, nt)
                              : rl_q8x16_linear_i8(x, s->m, w->in, w->group, w->codes, w->scales, off, w->bias, y,
                                                   w->out, p, nt);
    if (s->m <= w->int8_rows) {
        int rc = w->layout == 0 ? rl_q4_linear_i8(x, s->m, w->in, w->codes, w->scales, off, w->bias, y, w->out, p, nt)
                                : rl_q8_linear_i8(x, s->m, w->in, w->group, w->codes, w->scales, off, w->bias, y,
                                                  w->out, p, nt);
        if (rc == 0) return 0;
    }
    if (w->layout == 0)
        rl_q4_linear(x, s->m, w->in, w->codes, w->scales, w->offsets, w->bias, y, w->out, nt);
    else
        rl_q8_linear(x, s->m, w->in, w->group, w->codes, w->scales, w->offsets, w->bias, y, w->out, nt);
    return 0;
}

/* Returns 0, or -1 when a kernel could not allocate its buffers. */
int rl_decode_stack(const rl_layer *layers, int64_t n_layers, const rl_step *s) {
    const int64_t m = s->m, H = s->hidden, d = s->head_dim, q_size = s->heads * d, kv_size = s->kv_heads * d;
    const float eps = (float)s->eps, qk_eps = (float)s->qk_eps;
    const int nt = (int)s->nthreads;
    for (int64_t l = 0; l < n_layers; l++) {
        const rl_layer *L = layers + l;
        const int64_t W = L->qkv.out, inter = L->gate_up.out / 2;
        if (l == 0) {
            memcpy(s->residual, s->x, sizeof(float) * m * H);
            rl_rms_norm(s->residual, H, L->ln1, s->x, m, H, eps, nt);
        } else {
            rl_add_rms_norm(s->x, s->residual, L->ln1, m, H, eps, nt);
        }
        if (qlin(s, &L->qkv, s->x, s->qkv)) return -1;
        for (int64_t i = 0; L->q_norm && i < m; i++) /* in place: the norm reads a head before writing it */
            rl_rms_norm(s->qkv + i * W, d, L->q_norm, s->qkv + i * W, s->heads, d, qk_eps, nt);
        for (int64_t i = 0; L->k_norm && i < m; i++)
            rl_rms_norm(s->qkv + i * W + q_size, d, L->k_norm, s->qkv + i * W + q_size, s->kv_heads, d, qk_eps, nt);
        rl_rope(s->qkv, W, m, s->heads + s->kv_heads, d, s->pos, s->cos, s->ssin, nt);
        const int64_t *loc = L->swa ? s->swa_loc : s->loc, *req_idx = L->swa ? s->swa_req_idx : s->req_idx;
        const int32_t *r2t = L->swa ? s->swa_req_to_token : s->req_to_token;
        const int64_t r2t_stride = L->swa ? s->swa_r2t_stride : s->r2t_stride;
        rl_store_kv(s->qkv + q_size, W, s->qkv + q_size + kv_size, W, L->k_buf, L->v_buf, loc, m, kv_size);
        if (s->bs ? rl_extend_attention(s->qkv, W, L->k_buf, L->v_buf, r2t, r2t_stride, req_idx,
                                        s->q_start, s->prefix_lens, s->extend_lens, s->attn, s->bs, s->heads,
                                        s->kv_heads, d, (float)s->scale, L->window, 0.0f, NULL, nt)
                  : rl_decode_attention(s->qkv, W, L->k_buf, L->v_buf, r2t, r2t_stride, req_idx,
                                        s->seq_lens, s->attn, m, s->heads, s->kv_heads, d, (float)s->scale,
                                        L->window, 0.0f, NULL, nt))
            return -1;
        if (qlin(s, &L->o, s->attn, s->h)) return -1;
        rl_add_rms_norm(s->h, s->residual, L->ln2, m, H, eps, nt);
        if (qlin(s, &L->gate_up, s->h, s->gu)) return -1;
        rl_silu_mul(s->gu, s->act, m, inter, nt);
        if (qlin(s, &L->down, s->act, s->x)) return -1;
    }
    return 0;
}
