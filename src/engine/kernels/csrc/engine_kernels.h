/* The native kernel library's boundary with Python: every function it exports and every struct they
 * take, and nothing else (the library is built with -fvisibility=hidden; ENGINE_API marks what is
 * exported). Every source includes this file, so the compiler holds each definition to its prototype
 * here; engine/kernels/boundary.py reads this file to declare the ctypes argument and return types and
 * to check its typed Python mirrors (the family protocols and the Structures) against it, when the
 * library loads. Keep to the subset that parser reads: one declaration per `;`, `typedef struct { ... }
 * name_t;` with fields of int, int64_t, float or pointers, and no macros in declarations but ENGINE_API.
 * `Family:` comments name the Python accessor (engine/kernels/library.py) that binds what follows.
 */
#ifndef ENGINE_KERNELS_H
#define ENGINE_KERNELS_H
#include <stdint.h>

#define ENGINE_API __attribute__((visibility("default")))

/* Family: library (not switchable: what this build holds). */

/* Bits of what this build was compiled with: 1 AVX-512F, 2 AVX512-BF16, 4 AMX tiles (bf16), 8 AVX512-VNNI,
 * 16 AMX-INT8 (0: the portable paths only). */
ENGINE_API int engine_kernels_isa(void);
/* Whether the bf16 and int8 kernels may use the AMX tiles (ENGINE_CPU_AMX), and whether they do. */
ENGINE_API void amx_set(int on);
ENGINE_API int amx_active(void);

/* Family: ops (cpu_ops.c, moe.c; dtype 0 float32, 1 bfloat16). */

ENGINE_API void rms_norm(const void *x, const void *residual, const void *weight, void *out, void *res_out,
                         int64_t rows, int64_t n, float eps, int dtype, int num_threads);
ENGINE_API void rope_neox(const int64_t *positions, void *q, int64_t q_stride, int64_t q_heads, void *k,
                          int64_t k_stride, int64_t k_heads, const float *cos_sin, int64_t head_size, int64_t rot,
                          int64_t tokens, int dtype, int num_threads);
ENGINE_API void silu_and_mul(const void *x, void *out, int64_t tokens, int64_t d, int dtype, int num_threads);
ENGINE_API void store_kv(const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *k_pool,
                         void *v_pool, int64_t slot_stride, const int64_t *loc, int64_t tokens, int64_t width,
                         int64_t elem_size, int num_threads);
ENGINE_API void argmax_rows(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t *out, int num_threads);
/* moe.c: each token's top_k experts of the softmax (float32) over its router logits [tokens, num_experts]
 * (float32 or bfloat16, dtype): weights [tokens, top_k] float32, rescaled to sum to one with renormalize, and
 * ids [tokens, top_k] int32, the largest weight first (the lower index on a tie). */
ENGINE_API void moe_route(const void *logits, int64_t tokens, int64_t num_experts, int64_t top_k, int renormalize,
                          int dtype, float *weights, int *ids);

/* Family: linear (linear_bf16.c, linear_q8.c, linear_w8a8.c, linear_q4.c, linear_mxfp4.c, moe.c). */

/* 0 where the CPU lacks AVX512-BF16: the other three are then never called. */
ENGINE_API int linear_bf16_available(void);
ENGINE_API void pack_linear_bf16(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed, int num_threads);
ENGINE_API void linear_bf16(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                            const float *bias, uint16_t *out, int num_threads);
ENGINE_API void linear_bf16_silu_mul(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                                     const float *bias, uint16_t *out, int num_threads);
/* moe.c: out [tokens, hidden] (bf16) = sum over the slots of weights [tokens, top_k] x the expert ids
 * [tokens, top_k] names (int32; one outside [0, num_experts) is skipped) of x's row through that expert:
 * gate_up[e] ([2 inter, hidden]: gate rows, then up), SiLU-and-mul, down[e] ([hidden, inter]), in `format`
 * (cpu_common.h's CHAIN_*: bf16 panels, int8 with int8 activations, e4m3); gate_up / down hold the weights'
 * addresses and gate_up_scale / down_scale their per-channel float32 scales' (NULL for bf16). Returns 0, or -1
 * when its scratch could not be allocated (nothing written). */
ENGINE_API int moe_experts(const uint16_t *x, int64_t tokens, int64_t hidden, int64_t inter, int64_t num_experts,
                           int64_t top_k, const float *weights, const int *ids, int format, const int64_t *gate_up,
                           const int64_t *gate_up_scale, const int64_t *down, const int64_t *down_scale, uint16_t *out,
                           int num_threads);
/* linear_q8.c: out [m, n] = (x [m, k] . w [n, k]^T) * scale [n] + bias [n], w int8 (w_format 0), float8 e4m3
 * (1) or bfloat16 (2); scale and bias float32 or NULL; x and out float32 (dtype 0) or bfloat16 (1). Returns 0,
 * or -1 when scratch for bf16 activations could not be allocated (nothing written). */
ENGINE_API int linear_q8(const void *x, int64_t m, int64_t k, const void *w, int w_format, const float *scale,
                         const float *bias, int64_t n, void *out, int dtype, int num_threads);
/* linear_q8.c, block-wise fp8 (DeepSeek-V3's checkpoints): out [m, n] = x . W^T (+ bias), W [n, k] e4m3 whose
 * block (i, j) of [block_n, block_k] weights is scaled by scale[i * ceil(k / block_k) + j]; x and out as
 * linear_q8's. Returns 0; -1 when scratch for bf16 activations could not be allocated; -2 when block_k is not a
 * positive multiple of 8 or block_n not positive (nothing written). */
ENGINE_API int linear_fp8_block(const void *x, int64_t m, int64_t k, const uint8_t *w, const float *scale,
                                int64_t block_n, int64_t block_k, const float *bias, int64_t n, void *out, int dtype,
                                int num_threads);
/* linear_w8a8.c, SGLang's w8a8_int8: each row of x (float32 or bfloat16, dtype) quantized to int8 per row, its
 * scale written to x_scale [m] (or kept in scratch: NULL); out [m, n] = (q_x . w^T) * x_scale * scale (+ bias, float32 or NULL), w int8,
 * summed exactly in int32. Returns 0, or -1 when its scratch could not be allocated (nothing written). */
ENGINE_API int linear_w8a8(const void *x, int64_t m, int64_t k, const int8_t *w, const float *scale, const float *bias,
                           int64_t n, void *out, int dtype, float *x_scale, int num_threads);
/* linear_q4.c: out [m, n] = x [m, k] . W^T with W [n, k] 4-bit codes packed by layers/int4.py, W = code * scale
 * + bias per group of `group` inputs (a multiple of 32 dividing k); scale and bias [n, k / group]. */
ENGINE_API void linear_q4(const float *x, int64_t m, int64_t k, const uint8_t *w, const float *scale,
                          const float *bias, int64_t group, int64_t n, float *out, int num_threads);
/* linear_q4.c: linear_q4's product with x quantized to int8 per row and weight group (q_x = round(x * 127 / max
 * |x| over the group)), the integer sums exact; w, scale and bias in linear_w4a8's layout (the rows in blocks of 16:
 * linear_q4.c, layers/int4.py). Returns 0, or -1 when its scratch could not be allocated (nothing
 * written). */
ENGINE_API int linear_w4a8(const float *x, int64_t m, int64_t k, const uint8_t *w, const float *scale,
                           const float *bias, int64_t group, int64_t n, float *out, int num_threads);
/* linear_mxfp4.c: out [m, n] = x [m, k] . W^T (+ bias [n], float32 or NULL) with W [n, k] in MXFP4 as gpt-oss's
 * checkpoints hold it: blocks [n, k / 32, 16] e2m1 codes, scales [n, k / 32] e8m0; x and out float32. Returns 0,
 * -1 when scratch for the reordered activations could not be allocated, or -2 when k is not a positive multiple
 * of 32 or n not positive (nothing written). */
ENGINE_API int linear_mxfp4(const float *x, int64_t m, int64_t k, const uint8_t *blocks, const uint8_t *scales,
                            const float *bias, int64_t n, float *out, int num_threads);

/* Family: lora (lora_delta.c). */

/* out [m, n] (rows out_stride elements apart) += each row's LoRA delta: (x[r] . A[s]^T) over each section's R
 * columns of the shrunk row, times that section's columns of Bt[s], s = row_slots[r] (rows of slot 0 left
 * alone); x [m, k] (rows x_stride apart) and out float32 (dtype 0) or bfloat16 (1), A [num_slots, sections x
 * rank, k] and Bt [num_slots, rank, n] float32 (w_dtype 0) or bfloat16 (1), sections [num_sections][2] (column
 * offset, width). Returns 0; -1 when its scratch could not be allocated, -2 for a slot or section out of range
 * (nothing written either way). */
ENGINE_API int lora_delta(const void *x, int64_t x_stride, void *out, int64_t out_stride, int64_t m, int64_t k,
                          const int64_t *row_slots, int64_t num_slots, const void *a, const void *b, int w_dtype,
                          int64_t rank, const int64_t *sections, int64_t num_sections, int64_t n, int dtype,
                          int num_threads);

/* Family: attention (decode_attention.c, extend_attention.c). */

/* One decode step of one layer: one query row per request over pool slots kv_indices[b][0 .. lens[b]),
 * preceded for the members of a cascade group by the group's shared prefix (num_groups 0: none). Also
 * any attention whose rows each see a list of slots: extends and tree verifies with one row per new
 * token (row_of / starts, or a table row per token). */
typedef struct {
    const void *q; /* [bs, heads * dim] */
    const void *k, *v; /* the pool: [slots][kv_heads][dim], k_stride / v_stride elements per slot */
    const int64_t *kv_indices; /* [bs, max_len] */
    const int64_t *lens; /* [bs] */
    int64_t max_len, bs, heads, kv_heads, dim, k_stride, v_stride;
    float scale;
    int dtype;
    /* the pool's element type: dtype's, or 2 fp8 e5m2, 3 fp8 e4m3 (K/V read as k_scale * stored, v_scale * stored) */
    int kv_dtype;
    float k_scale, v_scale;
    void *out; /* like q */
    int64_t num_groups;
    const int64_t *group_offsets; /* [num_groups + 1] into group_members */
    const int64_t *group_members; /* rows of the batch */
    const int64_t *prefix_indices; /* [num_groups, max_prefix] */
    const int64_t *prefix_lens; /* [num_groups] */
    int64_t max_prefix;
    const int64_t *group_of; /* [bs]: the row's group, -1 for none */
    /* kept prefix panels: [num_groups] block addresses (0: none) and fill tokens, or NULL */
    const int64_t *kept, *kept_tokens;
    /* scores become logit_cap * tanh(score / logit_cap) before the softmax (Gemma 2); 0: none */
    float logit_cap;
    /* [heads] float32: a logit per query head that joins the softmax's denominator only (gpt-oss), or NULL */
    const float *sinks;
    /* [bs] each query row's row of kv_indices (NULL: its own) and the first entry it reads there (NULL:
     * 0): the rows of one request's new tokens share its table row, each reading its own window of it */
    const int64_t *row_of, *starts;
    int num_threads;
} decode_attention_args_t;

ENGINE_API void decode_attention(const decode_attention_args_t *args);

/* Causal bf16 prefill attention of every new token over its request's prefix and new tokens, all read
 * from the pool: request b's slots are kv_indices[b][0 .. prefix_lens[b] + ext_lens[b]), its new tokens
 * q rows q_starts[b] .. + ext_lens[b]. dim even and <= 256. */
typedef struct {
    const uint16_t *q; /* rows of q_stride elements */
    int64_t q_stride;
    const uint16_t *k, *v;
    int64_t k_stride, v_stride;
    const int64_t *kv_indices; /* [bs, max_seq] */
    int64_t max_seq;
    const int64_t *q_starts, *ext_lens, *prefix_lens; /* [bs] */
    int64_t bs, heads, kv_heads, dim;
    float scale;
    uint16_t *out; /* rows of out_stride elements */
    int64_t out_stride;
    int num_threads;
} extend_attention_args_t;

/* 0 where the CPU lacks AVX512-BF16: extend_attention is then never called. */
ENGINE_API int extend_attention_available(void);
ENGINE_API void extend_attention(const extend_attention_args_t *args);
/* Elements one layer's block of a kept cascade prefix of n keys takes (0: the cascade keeps none). */
ENGINE_API int64_t kept_prefix_elems(int64_t n, int64_t kv_heads, int64_t dim);

/* Family: decoder_layers (decoder_layers.c). */

/* One layer's weights and KV pool, set once (decoder_layers.py rebuilds them when either changes). */
typedef struct {
    const void *input_norm, *post_norm; /* bf16 [hidden] */
    const void *qkv, *o, *gate_up, *down; /* linear_bf16.c panels, or the formats below */
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias; /* float32 or NULL */
    const float *cos_sin; /* float32 [max_pos, rotary_dim] */
    void *k_pool, *v_pool; /* [slots, kv_heads, head_dim] */
    int64_t k_stride, v_stride; /* elements per slot */
    float eps, scale;
    const void *q_norm, *k_norm; /* bf16 [head_dim]: Qwen3's per-head RMSNorm before rotary, or NULL */
    float qk_eps;
    /* Each linear's format (decoder_layers.c: CHAIN_*): bf16 panels (above), int8 [n, k] with per-channel scales
     * (--quantization w8a8_int8, linear_w8a8), e4m3 [n, k] with per-channel scales (fp8, linear_q8), or 4-bit
     * codes with per-group scales and offsets, against float or int8 activations (linear_q4, linear_w4a8, each in
     * its own layout: layers/int4.py); the scales and offsets NULL for bf16, the offsets and groups unused but for
     * 4-bit. */
    int qkv_format, o_format, gate_up_format, down_format;
    const float *qkv_scale, *o_scale, *gate_up_scale, *down_scale;
    const float *qkv_offset, *o_offset, *gate_up_offset, *down_offset;
    int64_t qkv_group, o_group, gate_up_group, down_group;
    /* A mixture-of-experts layer (moe_intermediate > 0; gate_up and down unused): the router's bf16 panels
     * [num_experts, hidden] (no bias), and its experts as moe_experts takes them: their format, each expert's
     * gate_up and down weight addresses and (8-bit) their scales' addresses. */
    const void *router;
    int experts_format;
    const int64_t *experts_gate_up, *experts_gate_up_scale, *experts_down, *experts_down_scale;
    int64_t moe_intermediate;
} layer_t;

/* The model's shape and one step's batch: positions, new slots, the decode kernel's tables, scratch. */
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, rotary_dim, intermediate;
    int64_t bs;
    const int64_t *positions, *out_loc;
    const int64_t *kv_indices, *lens;
    int64_t max_len;
    int64_t num_groups;
    const int64_t *group_offsets, *group_members, *prefix_indices, *prefix_lens;
    int64_t max_prefix;
    const int64_t *group_of;
    /* kept prefix panels (decode_attention.c): [num_layers][num_groups] block addresses (0: none) and
     * [num_groups] fill tokens, or NULL */
    const int64_t *kept, *kept_tokens;
    /* scratch: [bs, hidden], [bs, qkv width], [bs, q width] x 2, [bs, hidden], [bs, intermediate], and
     * [bs, 2 x intermediate] for a quantized gate_up (its linear and SiLU-and-mul are two calls) */
    void *normed, *qkv, *q, *attn, *o, *mlp, *gate_up;
    /* The MoE layers' routing (moe_route: top_k of num_experts, renormalized or not), its scratch (router
     * logits [bs, num_experts] bf16, weights [bs, top_k] float32) and the chosen experts of every layer
     * [num_layers, bs, top_k] int32 (what the expert distribution recorder counts); unused without MoE layers. */
    int64_t num_experts, top_k;
    int renormalize;
    void *router_logits;
    float *moe_weights;
    int *moe_ids;
    int num_threads;
} step_t;

/* hidden_in [bs, hidden]: the embedded tokens; hidden_out: the last layer's output; residual_out: the
 * residual stream after it (what the final norm adds, as LlamaModel.forward passes them on). */
ENGINE_API void decode_layers(const layer_t *layers, int64_t num_layers, const step_t *step, const void *hidden_in,
                              void *hidden_out, void *residual_out);

#endif
