/* Fused element-wise ops of a decoder layer, for the CPU: RMSNorm with the residual add, rotary
 * embedding of q and k in place, SiLU-and-mul, and the store of new K/V into the paged pool.
 *
 * Each replaces several torch ops (and as many passes over the activations, and on a busy machine
 * as many thread-team barriers) by one. In bfloat16 they round where the torch ops of the reference
 * path round (after the residual add, after the normalisation, after each rotary product, after
 * SiLU), so the two paths agree up to the order of float32 sums.
 * Work is split over rows (thread_pool.c) only when there is enough of it to pay for the split.
 */
#include "cpu_common.h"

#define PARALLEL_MIN_ELEMS 65536

static inline float round_to(float x, int dtype) { return dtype == DTYPE_BF16 ? bf16_to_f32(f32_to_bf16(x)) : x; }

typedef struct {
    const void *x, *residual, *weight;
    void *out, *res_out;
    int64_t rows, n;
    float eps;
    int dtype;
} rms_job_t;

static void rms_part(void *arg, int tid, int nt) {
    const rms_job_t *J = (const rms_job_t *)arg;
    const int64_t n = J->n;
    const int dtype = J->dtype;
    float *h = (float *)malloc(sizeof(float) * (size_t)n);
    float *tmp = (float *)malloc(sizeof(float) * (size_t)n);
    float *w = (float *)malloc(sizeof(float) * (size_t)n);
    memcpy(w, load_row(J->weight, 0, n, dtype, tmp), sizeof(float) * (size_t)n);
    int64_t lo, hi;
    pool_range(J->rows, tid, nt, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) {
        memcpy(h, load_row(J->x, r * n, n, dtype, tmp), sizeof(float) * (size_t)n);
        int64_t i = 0;
        if (J->residual != NULL) {
            const float *res = load_row(J->residual, r * n, n, dtype, tmp);
#if defined(__AVX512F__)
            for (; i + 16 <= n; i += 16)
                _mm512_storeu_ps(h + i, round_to_512(_mm512_add_ps(_mm512_loadu_ps(h + i), _mm512_loadu_ps(res + i)),
                                                     dtype));
#endif
            for (; i < n; i++) h[i] = round_to(h[i] + res[i], dtype);
            store_row(J->res_out, r * n, h, n, dtype);
        }
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (i = 0; i < n; i++) ss += h[i] * h[i];
        const float inv = 1.f / sqrtf(ss / (float)n + J->eps);
        i = 0;
#if defined(__AVX512F__)
        const __m512 vinv = _mm512_set1_ps(inv);
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(h + i, _mm512_mul_ps(_mm512_loadu_ps(w + i),
                                                  round_to_512(_mm512_mul_ps(_mm512_loadu_ps(h + i), vinv), dtype)));
#endif
        for (; i < n; i++) h[i] = w[i] * round_to(h[i] * inv, dtype);
        store_row(J->out, r * n, h, n, dtype);
    }
    free(h);
    free(tmp);
    free(w);
}

/* out = weight * norm(h) with h = x (+ residual); with a residual, res_out = h. Rows of n elements,
 * contiguous; the statistics in float32, as Hugging Face computes them. */
void rms_norm(const void *x, const void *residual, const void *weight, void *out, void *res_out, int64_t rows,
              int64_t n, float eps, int dtype, int num_threads) {
    rms_job_t job = {x, residual, weight, out, res_out, rows, n, eps, dtype};
    pool_run(rms_part, &job, rows * n >= PARALLEL_MIN_ELEMS ? num_threads : 1);
}

/* Rotary embedding, GPT-NeoX layout, in place on the first `rot` dims of every head of q and k.
 * q: tokens rows of q_heads * head_size (row stride q_stride elements), likewise k;
 * cos_sin: float32 [max_pos, rot], cos of the rot/2 frequencies then their sin. */
typedef struct {
    const int64_t *positions;
    void *q, *k;
    int64_t q_stride, q_heads, k_stride, k_heads;
    const float *cos_sin;
    int64_t head_size, rot, tokens;
    int dtype;
} rope_job_t;

static void rope_part(void *arg, int tid, int nt) {
    const rope_job_t *J = (const rope_job_t *)arg;
    const int64_t rot = J->rot, half = rot / 2, head_size = J->head_size;
    const int dtype = J->dtype;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(2 * rot + head_size));
    float *cs = buf, *x = buf + rot, *sn = cs + half;
    int64_t lo, hi;
    pool_range(J->tokens, tid, nt, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) {
        const float *c = J->cos_sin + J->positions[t] * rot;
        /* The reference path multiplies by the cache cast to the activations' dtype. */
        for (int64_t i = 0; i < rot; i++) cs[i] = round_to(c[i], dtype);
        for (int pass = 0; pass < 2; pass++) {
            void *base = pass == 0 ? J->q : J->k;
            const int64_t heads = pass == 0 ? J->q_heads : J->k_heads, stride = pass == 0 ? J->q_stride : J->k_stride;
            for (int64_t hd = 0; hd < heads; hd++) {
                const int64_t off = t * stride + hd * head_size;
                const float *src = load_row(base, off, rot, dtype, x);
                float out[512]; /* the caller checks rot <= 512 */
                int64_t i = 0;
#if defined(__AVX512F__)
                for (; i + 16 <= half; i += 16) {
                    const __m512 x1 = _mm512_loadu_ps(src + i), x2 = _mm512_loadu_ps(src + i + half);
                    const __m512 c = _mm512_loadu_ps(cs + i), sv = _mm512_loadu_ps(sn + i);
                    _mm512_storeu_ps(out + i, _mm512_sub_ps(round_to_512(_mm512_mul_ps(x1, c), dtype),
                                                            round_to_512(_mm512_mul_ps(x2, sv), dtype)));
                    _mm512_storeu_ps(out + i + half, _mm512_add_ps(round_to_512(_mm512_mul_ps(x2, c), dtype),
                                                                   round_to_512(_mm512_mul_ps(x1, sv), dtype)));
                }
#endif
                for (; i < half; i++) {
                    const float x1 = src[i], x2 = src[i + half];
                    const float a = round_to(x1 * cs[i], dtype), b = round_to(x2 * sn[i], dtype);
                    const float e = round_to(x2 * cs[i], dtype), f = round_to(x1 * sn[i], dtype);
                    out[i] = a - b;
                    out[i + half] = e + f;
                }
                store_row(base, off, out, rot, dtype);
            }
        }
    }
    free(buf);
}

/* Rotary embedding, GPT-NeoX layout, in place on the first `rot` dims of every head of q and k.
 * q: tokens rows of q_heads * head_size (row stride q_stride elements), likewise k;
 * cos_sin: float32 [max_pos, rot], cos of the rot/2 frequencies then their sin. */
void rope_neox(const int64_t *positions, void *q, int64_t q_stride, int64_t q_heads, void *k, int64_t k_stride,
               int64_t k_heads, const float *cos_sin, int64_t head_size, int64_t rot, int64_t tokens, int dtype,
               int num_threads) {
    rope_job_t job = {positions, q, k, q_stride, q_heads, k_stride, k_heads, cos_sin, head_size, rot, tokens, dtype};
    pool_run(rope_part, &job, tokens * (q_heads + k_heads) * rot >= PARALLEL_MIN_ELEMS ? num_threads : 1);
}

/* out[t] = silu(x[t, :d]) * x[t, d:], x rows of 2d contiguous elements, out rows of d. */
typedef struct {
    const void *x;
    void *out;
    int64_t tokens, d;
    int dtype;
} silu_job_t;

static void silu_part(void *arg, int tid, int nt) {
    const silu_job_t *J = (const silu_job_t *)arg;
    const int64_t d = J->d;
    const int dtype = J->dtype;
    float *g = (float *)malloc(sizeof(float) * (size_t)d);
    float *u = (float *)malloc(sizeof(float) * (size_t)d);
    int64_t lo, hi;
    pool_range(J->tokens, tid, nt, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) {
        memcpy(g, load_row(J->x, t * 2 * d, d, dtype, u), sizeof(float) * (size_t)d);
        const float *up = load_row(J->x, t * 2 * d + d, d, dtype, u);
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= d; i += 16)
            _mm512_storeu_ps(g + i, silu_mul_512(_mm512_loadu_ps(g + i), _mm512_loadu_ps(up + i), dtype));
#endif
        for (; i < d; i++) g[i] = round_to(g[i] / (1.f + expf(-g[i])), dtype) * up[i];
        store_row(J->out, t * d, g, d, dtype);
    }
    free(g);
    free(u);
}

/* out[t] = silu(x[t, :d]) * x[t, d:], x rows of 2d contiguous elements, out rows of d. */
void silu_and_mul(const void *x, void *out, int64_t tokens, int64_t d, int dtype, int num_threads) {
    silu_job_t job = {x, out, tokens, d, dtype};
    pool_run(silu_part, &job, tokens * d >= PARALLEL_MIN_ELEMS ? num_threads : 1);
}

/* k_pool[loc[t]] = k[t] and v_pool[loc[t]] = v[t]: rows of `width` elements of elem_size bytes; k/v
 * rows are src_stride elements apart (slices of the fused qkv output), pool slots slot_stride. */
typedef struct {
    const void *k, *v;
    int64_t k_stride, v_stride;
    void *k_pool, *v_pool;
    int64_t slot_stride;
    const int64_t *loc;
    int64_t tokens, width, elem_size;
} store_job_t;

static void store_part(void *arg, int tid, int nt) {
    const store_job_t *J = (const store_job_t *)arg;
    const int64_t es = J->elem_size;
    const size_t bytes = (size_t)(J->width * es);
    int64_t lo, hi;
    pool_range(J->tokens, tid, nt, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) {
        memcpy((char *)J->k_pool + J->loc[t] * J->slot_stride * es, (const char *)J->k + t * J->k_stride * es, bytes);
        memcpy((char *)J->v_pool + J->loc[t] * J->slot_stride * es, (const char *)J->v + t * J->v_stride * es, bytes);
    }
}

void store_kv(const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *k_pool, void *v_pool,
              int64_t slot_stride, const int64_t *loc, int64_t tokens, int64_t width, int64_t elem_size,
              int num_threads) {
    store_job_t job = {k, v, k_stride, v_stride, k_pool, v_pool, slot_stride, loc, tokens, width, elem_size};
    pool_run(store_part, &job, tokens * width >= PARALLEL_MIN_ELEMS ? num_threads : 1);
}

/* out[r] = the index of the largest of x[r, 0..n) (rows `stride` floats apart), as torch.argmax: the
 * first one of equal maxima, and the first NaN of a row that has one (NaN counts as the largest).
 * The greedy pick of a decode step over the vocabulary: torch's argmax read [128, 32000] float32 at
 * ~13 GB/s on the 2-core AMD EPYC. */
typedef struct {
    const float *x;
    int64_t rows, n, stride;
    int64_t *out;
} argmax_job_t;

static int64_t argmax_row(const float *x, int64_t n) {
    int64_t best_i = 0, i = 0;
    float best = n > 0 ? x[0] : 0.f;
#if defined(__AVX512F__)
    if (n >= 16) {
        __m512 bv = _mm512_loadu_ps(x);
        __m512i bi = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        __m512i ci = bi;
        const __m512i step = _mm512_set1_epi32(16);
        __mmask16 nan = _mm512_cmp_ps_mask(bv, bv, _CMP_UNORD_Q);
        for (i = 16; i + 16 <= n; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            ci = _mm512_add_epi32(ci, step);
            const __mmask16 gt = _mm512_cmp_ps_mask(v, bv, _CMP_GT_OQ); /* strictly: a lane keeps its first */
            bv = _mm512_mask_mov_ps(bv, gt, v);
            bi = _mm512_mask_mov_epi32(bi, gt, ci);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        }
        if (nan) { /* the first NaN, as torch */
            for (int64_t j = 0; j < i; j++)
                if (x[j] != x[j]) return j;
        }
        best = _mm512_reduce_max_ps(bv);
        /* the smallest index among the lanes holding the maximum */
        const __mmask16 at = _mm512_cmp_ps_mask(bv, _mm512_set1_ps(best), _CMP_EQ_OQ);
        best_i = _mm512_mask_reduce_min_epi32(at, bi);
    }
#endif
    for (; i < n; i++) {
        const float v = x[i];
        if (v != v) return i; /* none before: the vector part returned, the loop checked each */
        if (v > best) {
            best = v;
            best_i = i;
        }
    }
    return best_i;
}

static void argmax_part(void *arg, int tid, int nt) {
    const argmax_job_t *J = (const argmax_job_t *)arg;
    int64_t lo, hi;
    pool_range(J->rows, tid, nt, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) J->out[r] = argmax_row(J->x + r * J->stride, J->n);
}

void argmax_rows(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t *out, int num_threads) {
    argmax_job_t job = {x, rows, n, stride, out};
    pool_run(argmax_part, &job, rows * n >= 4 * PARALLEL_MIN_ELEMS ? num_threads : 1);
}
