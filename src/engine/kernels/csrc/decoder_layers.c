/* Every decoder layer of a Llama-family model for one decode step, in one call (bfloat16, CPU).
 *
 * The Python path runs each layer as ~9 native calls (RMSNorm + residual, the qkv linear, rotary,
 * the K/V store, decode attention, the o linear, RMSNorm + residual, gate_up + SiLU-and-mul, the
 * down linear) through a dozen nn.Module calls, tensor allocations and ctypes conversions: 1.8-2.2
 * ms of Python per step on the 2-core AMD EPYC (Zen 4) for the 8-layer small Llama, whatever the
 * batch (0.3-0.8 ms with this call). This file chains the same kernels with the same arguments, so
 * the result is bit for bit the Python path's; only the Python between them is gone.
 * engine/kernels/decoder_layers.py decides when it applies. Quantized linears take their kernels as the modules
 * call them: w8a8_int8 linear_w8a8 and fp8 linear_q8 (bf16 in and out), 4-bit linear_q4 or linear_w4a8 (float32
 * in and out: the rows widened from bf16 and the outputs rounded back, as layers/int4.py does); a quantized
 * gate_up is its linear, then silu_and_mul. A mixture-of-experts layer's MLP is its router (bf16 panels), moe_route
 * and moe_experts (moe.c), the calls layers/moe makes.
 */
#include "cpu_common.h"

/* out [bs, n] (bf16) = x [bs, k] (bf16) W^T (+ bias: bf16 panels only) in the linear's format (cpu_common.h). */
void format_linear(const void *x, int64_t bs, int64_t k, int format, const void *w, const float *scale,
                   const float *offset, int64_t group, int64_t n, const float *bias, void *out, int nt) {
    if (format == CHAIN_BF16) {
        linear_bf16((const uint16_t *)x, bs, k, (const uint16_t *)w, n, bias, (uint16_t *)out, nt);
        return;
    }
    if (format == CHAIN_W8A8) {
        if (linear_w8a8(x, bs, k, (const int8_t *)w, scale, bias, n, out, DTYPE_BF16, NULL, nt) != 0) abort();
        return;
    }
    if (format == CHAIN_FP8) { /* e4m3 weights (--quantization fp8), bf16 rows: linear_q8's format 1 */
        if (linear_q8(x, bs, k, w, 1, scale, bias, n, out, DTYPE_BF16, nt) != 0) abort();
        return;
    }
    float *xf = (float *)malloc(sizeof(float) * (size_t)(bs * (k + n)));
    if (xf == NULL) abort(); /* the batch's rows in float32: out of memory is not recoverable here */
    float *yf = xf + bs * k;
    for (int64_t r = 0; r < bs; r++) load_row(x, r * k, k, DTYPE_BF16, xf + r * k);
    if (format == CHAIN_Q4) linear_q4(xf, bs, k, (const uint8_t *)w, scale, offset, group, n, yf, nt);
    else if (linear_w4a8(xf, bs, k, (const uint8_t *)w, scale, offset, group, n, yf, nt) != 0) abort();
    for (int64_t r = 0; r < bs; r++) store_row(out, r * n, yf + r * n, n, DTYPE_BF16);
    free(xf);
}

/* layer_t and step_t: engine_kernels.h. */
void decode_layers(const layer_t *layers, int64_t num_layers, const step_t *step, const void *hidden_in,
                   void *hidden_out, void *residual_out) {
    const step_t *S = step;
    const int64_t bs = S->bs, hidden = S->hidden, d = S->head_dim, nt = S->num_threads;
    const int64_t q_width = S->heads * d, kv_width = S->kv_heads * d, qkv_width = q_width + 2 * kv_width;
    uint16_t *qkv = (uint16_t *)S->qkv, *q = (uint16_t *)S->q;
    for (int64_t l = 0; l < num_layers; l++) {
        const layer_t *L = layers + l;
        if (l == 0) { /* residual = x; x = norm(x) */
            memcpy(residual_out, hidden_in, sizeof(uint16_t) * (size_t)(bs * hidden));
            rms_norm(hidden_in, NULL, L->input_norm, S->normed, NULL, bs, hidden, L->eps, DTYPE_BF16, (int)nt);
        } else { /* (x, residual) = (norm(x + residual), x + residual) */
            rms_norm(hidden_out, residual_out, L->input_norm, S->normed, residual_out, bs, hidden, L->eps, DTYPE_BF16,
                     (int)nt);
        }
        format_linear(S->normed, bs, hidden, L->qkv_format, L->qkv, L->qkv_scale, L->qkv_offset, L->qkv_group,
                      qkv_width, L->qkv_bias, qkv, (int)nt);
        if (L->q_norm != NULL) /* each head's q and k rows normalised in place (small: on this thread) */
            for (int64_t b = 0; b < bs; b++) {
                uint16_t *row = qkv + b * qkv_width;
                rms_norm(row, NULL, L->q_norm, row, NULL, S->heads, d, L->qk_eps, DTYPE_BF16, 1);
                rms_norm(row + q_width, NULL, L->k_norm, row + q_width, NULL, S->kv_heads, d, L->qk_eps, DTYPE_BF16,
                         1);
            }
        rope_neox(S->positions, qkv, qkv_width, S->heads, qkv + q_width, qkv_width, S->kv_heads, L->cos_sin, d,
                  S->rotary_dim, bs, DTYPE_BF16, (int)nt);
        store_kv(qkv + q_width, qkv_width, qkv + q_width + kv_width, qkv_width, L->k_pool, L->v_pool, L->k_stride,
                 S->out_loc, bs, kv_width, 2, (int)nt);
        for (int64_t b = 0; b < bs; b++) /* the kernel reads q as [bs, heads * head_dim] */
            memcpy(q + b * q_width, qkv + b * qkv_width, sizeof(uint16_t) * (size_t)q_width);
        const decode_attention_args_t attention = {
            .q = q, .k = L->k_pool, .v = L->v_pool, .kv_indices = S->kv_indices, .lens = S->lens,
            .max_len = S->max_len, .bs = bs, .heads = S->heads, .kv_heads = S->kv_heads, .dim = d,
            .k_stride = L->k_stride, .v_stride = L->v_stride, .scale = L->scale, .dtype = DTYPE_BF16,
            .kv_dtype = DTYPE_BF16, .k_scale = 1.f, .v_scale = 1.f, .out = S->attn, /* a bf16 pool only */
            .num_groups = S->num_groups, .group_offsets = S->group_offsets, .group_members = S->group_members,
            .prefix_indices = S->prefix_indices, .prefix_lens = S->prefix_lens, .max_prefix = S->max_prefix,
            .group_of = S->group_of, .kept = S->kept != NULL ? S->kept + l * S->num_groups : NULL,
            .kept_tokens = S->kept_tokens, .num_threads = (int)nt};
        decode_attention(&attention);
        format_linear(S->attn, bs, q_width, L->o_format, L->o, L->o_scale, L->o_offset, L->o_group, hidden, L->o_bias,
                      S->o, (int)nt);
        rms_norm(S->o, residual_out, L->post_norm, S->normed, residual_out, bs, hidden, L->eps, DTYPE_BF16, (int)nt);
        if (L->moe_intermediate > 0) { /* router, top-k, experts: as layers/moe's SparseMoeBlock calls them */
            int *ids = S->moe_ids + l * bs * S->top_k;
            linear_bf16((const uint16_t *)S->normed, bs, hidden, (const uint16_t *)L->router, S->num_experts, NULL,
                        (uint16_t *)S->router_logits, (int)nt);
            moe_route(S->router_logits, bs, S->num_experts, S->top_k, S->renormalize, DTYPE_BF16, S->moe_weights, ids);
            if (moe_experts((const uint16_t *)S->normed, bs, hidden, L->moe_intermediate, S->num_experts, S->top_k,
                            S->moe_weights, ids, L->experts_format, L->experts_gate_up, L->experts_gate_up_scale,
                            L->experts_down, L->experts_down_scale, (uint16_t *)hidden_out, (int)nt) != 0)
                abort(); /* out of memory for its scratch is not recoverable here */
            continue;
        }
        if (L->gate_up_format != CHAIN_BF16) {
            format_linear(S->normed, bs, hidden, L->gate_up_format, L->gate_up, L->gate_up_scale, L->gate_up_offset,
                          L->gate_up_group, 2 * S->intermediate, L->gate_up_bias, S->gate_up, (int)nt);
            silu_and_mul(S->gate_up, S->mlp, bs, S->intermediate, DTYPE_BF16, (int)nt);
        } else {
            linear_bf16_silu_mul((const uint16_t *)S->normed, bs, hidden, (const uint16_t *)L->gate_up,
                                 2 * S->intermediate, L->gate_up_bias, (uint16_t *)S->mlp, (int)nt);
        }
        format_linear(S->mlp, bs, S->intermediate, L->down_format, L->down, L->down_scale, L->down_offset,
                      L->down_group, hidden, L->down_bias, hidden_out, (int)nt);
    }
}
