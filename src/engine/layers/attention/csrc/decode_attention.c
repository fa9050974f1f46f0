/* Decode attention straight from the paged KV pool, for the CPU.
 *
 * Each request has one new query token; it attends to the pool slots listed in its row of
 * `kv_indices`. The slots are read where they lie: no gathered copy of the K/V is made, so the
 * K/V bytes cross the memory bus once (a gather + SDPA moves them three times).
 *
 * Work is split over (request, KV head) pairs; each pair reads its K/V rows once for all the
 * query heads of its GQA group. Scores are kept per pair (two-pass softmax) in float32.
 * Built at run time by engine/layers/attention/cpu_kernels.py (gcc -O3 -fopenmp); called through
 * ctypes, which releases the GIL. The OpenMP runtime is the one torch already loaded.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)x << 16;
    return c.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } c;
    c.f = f;
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40u); /* NaN stays NaN */
    c.u += 0x7fffu + ((c.u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(c.u >> 16);
}

/* dim consecutive elements of a float32 or bfloat16 tensor as float32: in place for float32,
 * converted into `tmp` for bfloat16. */
static inline const float *load_row(const void *base, int64_t offset, int64_t dim, int dtype, float *tmp) {
    if (dtype == DTYPE_F32) return (const float *)base + offset;
    const uint16_t *src = (const uint16_t *)base + offset;
#pragma omp simd
    for (int64_t d = 0; d < dim; d++) tmp[d] = bf16_to_f32(src[d]);
    return tmp;
}

/* q, out: [bs, heads * dim]; k, v: [num_slots, kv_heads * dim] (slot stride given in elements);
 * kv_indices: [bs, max_len] int64, the first lens[b] entries of row b are used;
 * lse (may be NULL): [bs, heads] float32 log-sum-exp of the scaled scores.
 *
 * A task is one request and a block of its KV heads: all heads when there are enough requests to
 * keep every thread busy (a slot's K/V row for all heads is one contiguous run of memory, read
 * once), one head per task otherwise. */
void decode_attention(const void *q, const void *k, const void *v, const int64_t *kv_indices,
                      const int64_t *lens, int64_t bs, int64_t heads, int64_t kv_heads, int64_t dim,
                      int64_t max_len, int64_t k_stride, int64_t v_stride, float scale, int dtype,
                      void *out, float *lse, int num_threads) {
    const int64_t group = heads / kv_heads;
    const int64_t block = bs >= 2 * num_threads ? kv_heads : 1; /* KV heads per task */
    const int64_t blocks = kv_heads / block;
    const int64_t tasks = bs * blocks;
    const int64_t qh = block * group; /* query heads per task */
    const int64_t row_len = block * dim;
    const int64_t cols = max_len > 0 ? max_len : 1;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(qh * cols));
        float *qf = (float *)malloc(sizeof(float) * (size_t)(qh * dim));
        float *acc = (float *)malloc(sizeof(float) * (size_t)(qh * dim));
        float *tmp = (float *)malloc(sizeof(float) * (size_t)row_len);
        float *inv_sum = (float *)malloc(sizeof(float) * (size_t)qh);
        const int elem = dtype == DTYPE_F32 ? 4 : 2;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t b = t / blocks, h0 = (t % blocks) * block;
            const int64_t n = lens[b];
            const int64_t *idx = kv_indices + b * max_len;
            const int64_t q_off = (b * heads + h0 * group) * dim; /* the task's query heads are contiguous */
            for (int64_t j = 0; j < qh; j++) {
                const float *row = load_row(q, q_off + j * dim, dim, dtype, tmp);
                for (int64_t d = 0; d < dim; d++) qf[j * dim + d] = row[d] * scale;
            }
            for (int64_t i = 0; i < n; i++) {
                if (i + 4 < n) __builtin_prefetch((const char *)k + (idx[i + 4] * k_stride + h0 * dim) * elem);
                const float *kr = load_row(k, idx[i] * k_stride + h0 * dim, row_len, dtype, tmp);
                for (int64_t j = 0; j < qh; j++) {
                    const float *qj = qf + j * dim, *kh = kr + (j / group) * dim;
                    float s = 0.f;
#pragma omp simd reduction(+ : s)
                    for (int64_t d = 0; d < dim; d++) s += qj[d] * kh[d];
                    scores[j * cols + i] = s;
                }
            }
            for (int64_t j = 0; j < qh; j++) {
                float *sj = scores + j * cols;
                float m = -INFINITY;
                for (int64_t i = 0; i < n; i++) m = sj[i] > m ? sj[i] : m;
                float sum = 0.f;
                for (int64_t i = 0; i < n; i++) {
                    sj[i] = expf(sj[i] - m);
                    sum += sj[i];
                }
                inv_sum[j] = sum > 0.f ? 1.f / sum : 0.f; /* no keys: output 0, lse -inf */
                if (lse) lse[b * heads + h0 * group + j] = m + logf(sum);
            }
            memset(acc, 0, sizeof(float) * (size_t)(qh * dim));
            for (int64_t i = 0; i < n; i++) {
                if (i + 4 < n) __builtin_prefetch((const char *)v + (idx[i + 4] * v_stride + h0 * dim) * elem);
                const float *vr = load_row(v, idx[i] * v_stride + h0 * dim, row_len, dtype, tmp);
                for (int64_t j = 0; j < qh; j++) {
                    const float p = scores[j * cols + i];
                    const float *vh = vr + (j / group) * dim;
                    float *aj = acc + j * dim;
#pragma omp simd
                    for (int64_t d = 0; d < dim; d++) aj[d] += p * vh[d];
                }
            }
            for (int64_t j = 0; j < qh; j++) {
                const int64_t o = q_off + j * dim;
                for (int64_t d = 0; d < dim; d++) {
                    const float x = acc[j * dim + d] * inv_sum[j];
                    if (dtype == DTYPE_F32) ((float *)out)[o + d] = x;
                    else ((uint16_t *)out)[o + d] = f32_to_bf16(x);
                }
            }
        }
        free(scores);
        free(qf);
        free(acc);
        free(tmp);
        free(inv_sum);
    }
}
