/* A mixture-of-experts layer on the CPU: the router's top-k (moe_route) and the experts of the chosen (token,
 * slot) pairs (moe_experts: bf16 panels, int8 or fp8 weights). layers/moe calls both from Python and
 * decoder_layers.c calls them in its one-call decode step, so the two paths compute the same bits.
 *
 * The experts run as layers/moe/fused_moe_native.py's grouped loop does: the (token, slot) pairs sorted by
 * expert (tokens in order within an expert), each expert that received tokens once on its rows gathered
 * (bf16 panels: linear_bf16_silu_mul for gate_up and SiLU-and-mul where both halves are whole panel pairs;
 * else, and for int8 (linear_w8a8) and fp8 (linear_q8) experts, the linear then silu_and_mul; then the down
 * linear), and each row's bf16 output widened, scaled by its routing weight (a float32 product) and added to
 * its token's float32 sum, experts in ascending order; the sums are rounded to bf16 once. Only the Python
 * between those kernels is gone (~0.3 ms a layer at one token on the 2-core Xeon: the gathers, the
 * scatter-adds and a dozen tensor ops an expert). A quantized linear that cannot allocate its scratch aborts,
 * as in decoder_layers.c (format_linear).
 */
#include "cpu_common.h"

void moe_route(const void *logits, int64_t tokens, int64_t num_experts, int64_t top_k, int renormalize, int dtype,
               float *weights, int *ids) {
    float *p = (float *)malloc(sizeof(float) * (size_t)(2 * num_experts));
    if (p == NULL) abort(); /* a few KiB (num_experts is bounded by the model's config) */
    float *tmp = p + num_experts;
    for (int64_t t = 0; t < tokens; t++) {
        const float *l = load_row(logits, t * num_experts, num_experts, dtype, tmp);
        const float m = max_of(l, num_experts);
        float sum = 0.f;
        for (int64_t e = 0; e < num_experts; e++) {
            p[e] = expf(l[e] - m);
            sum += p[e];
        }
        for (int64_t e = 0; e < num_experts; e++) p[e] = p[e] / sum;
        float *w = weights + t * top_k;
        int *id = ids + t * top_k;
        for (int64_t j = 0; j < top_k; j++) { /* the largest not yet taken; the lowest index on a tie */
            int64_t best = -1;
            for (int64_t e = 0; e < num_experts; e++)
                if (p[e] >= 0.f && (best < 0 || p[e] > p[best])) best = e;
            if (best < 0) best = 0; /* NaN logits: every probability is NaN; expert 0, weight NaN */
            w[j] = p[best];
            id[j] = (int)best;
            p[best] = -1.f; /* taken */
        }
        if (renormalize) {
            float kept = 0.f;
            for (int64_t j = 0; j < top_k; j++) kept += w[j];
            for (int64_t j = 0; j < top_k; j++) w[j] = w[j] / kept;
        }
    }
    free(p);
}

int moe_experts(const uint16_t *x, int64_t tokens, int64_t hidden, int64_t inter, int64_t num_experts, int64_t top_k,
                const float *weights, const int *ids, int format, const int64_t *gate_up, const int64_t *gate_up_scale,
                const int64_t *down, const int64_t *down_scale, uint16_t *out, int num_threads) {
    const int64_t pairs = tokens * top_k;
    const int fused = format == CHAIN_BF16 && (2 * inter) % 128 == 0; /* linear_bf16_silu_mul's panel pairs */
    const size_t bytes = sizeof(int64_t) * (size_t)(num_experts + 1 + pairs) +
                         sizeof(float) * (size_t)(tokens * hidden) +
                         sizeof(uint16_t) * (size_t)(tokens * (2 * hidden + 3 * inter));
    char *scratch = (char *)malloc(bytes);
    if (scratch == NULL) return -1;
    /* each expert's first pair in `order` [num_experts + 1]; the (token, slot) pairs by expert [pairs]; the
     * float32 sums [tokens, hidden]; gathered rows [tokens, hidden]; gate_up [tokens, 2 inter] (unfused only);
     * SiLU-and-mul [tokens, inter]; the experts' output [tokens, hidden] (at most `tokens` rows an expert) */
    int64_t *start = (int64_t *)scratch, *order = start + num_experts + 1;
    float *acc = (float *)(order + pairs);
    uint16_t *rows = (uint16_t *)(acc + tokens * hidden);
    uint16_t *gu = rows + tokens * hidden, *h = gu + tokens * 2 * inter, *y = h + tokens * inter;
    memset(acc, 0, sizeof(float) * (size_t)(tokens * hidden));
    /* a stable counting sort of the pairs by expert (flat order within one); ids outside [0, num_experts) are
     * slots whose expert another rank holds */
    memset(start, 0, sizeof(int64_t) * (size_t)(num_experts + 1));
    for (int64_t i = 0; i < pairs; i++)
        if (ids[i] >= 0 && ids[i] < num_experts) start[ids[i] + 1]++;
    for (int64_t e = 0; e < num_experts; e++) start[e + 1] += start[e];
    for (int64_t i = 0; i < pairs; i++)
        if (ids[i] >= 0 && ids[i] < num_experts) order[start[ids[i]]++] = i;
    for (int64_t e = num_experts; e > 0; e--) start[e] = start[e - 1]; /* the fill moved each start to the next */
    start[0] = 0;
    for (int64_t e = 0; e < num_experts; e++) {
        const int64_t count = start[e + 1] - start[e];
        if (count == 0) continue;
        const int64_t *pair = order + start[e];
        const uint16_t *in = x;
        if (tokens > 1) { /* one token: its row as it is */
            for (int64_t r = 0; r < count; r++)
                memcpy(rows + r * hidden, x + (pair[r] / top_k) * hidden, sizeof(uint16_t) * (size_t)hidden);
            in = rows;
        }
        if (fused) {
            linear_bf16_silu_mul(in, count, hidden, (const uint16_t *)(intptr_t)gate_up[e], 2 * inter, NULL, h,
                                 num_threads);
        } else {
            format_linear(in, count, hidden, format, (const void *)(intptr_t)gate_up[e],
                          gate_up_scale == NULL ? NULL : (const float *)(intptr_t)gate_up_scale[e], NULL, 0, 2 * inter,
                          NULL, gu, num_threads);
            silu_and_mul(gu, h, count, inter, DTYPE_BF16, num_threads);
        }
        format_linear(h, count, inter, format, (const void *)(intptr_t)down[e],
                      down_scale == NULL ? NULL : (const float *)(intptr_t)down_scale[e], NULL, 0, hidden, NULL, y,
                      num_threads);
        for (int64_t r = 0; r < count; r++) {
            const float w = weights[pair[r]];
            float *sum = acc + (pair[r] / top_k) * hidden;
            const uint16_t *yr = y + r * hidden;
            for (int64_t d = 0; d < hidden; d++) {
                const float product = bf16_to_f32(yr[d]) * w;
                sum[d] = sum[d] + product;
            }
        }
    }
    for (int64_t t = 0; t < tokens; t++) store_row(out, t * hidden, acc + t * hidden, hidden, DTYPE_BF16);
    free(scratch);
    return 0;
}
