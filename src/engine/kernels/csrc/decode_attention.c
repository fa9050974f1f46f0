/* Decode attention straight from the paged KV pool, for the CPU, with a cascade for shared prefixes.
 *
 * Each request has one new query token; it attends to the pool slots listed in its row of
 * `kv_indices`. The slots are read where they lie: no gathered copy of the K/V is made, so the K/V
 * bytes cross the memory bus once (a gather + SDPA moves them three times).
 *
 * Cascade: requests whose KV begins with the same slots (a prefix the radix cache shares) form a
 * group. Phase 1 reads a group's prefix once per KV head for all the group's query rows (a small
 * matrix product instead of one pass per request; with bfloat16 data attend_step.h's, as prefill
 * attention, prefix_attend_panels); phase 2 continues each request's softmax over
 * its own suffix. The softmax is online (running max, sum and unnormalised output per query row,
 * over tiles of TILE keys), so phase 2 simply resumes the state phase 1 left: no merge step.
 *
 * A task is a set of query rows, each with the offset of its KV head within a slot: in phase 2 all
 * heads of one request when there are enough requests to keep every thread busy (a slot's K or V
 * row for all heads is one contiguous run of memory), one KV head of one request otherwise.
 * Scores of 16 keys are computed at once and reduced with one transpose-add tree. With AVX512-BF16
 * and bfloat16 data both products are `vdpbf16ps` (exact bf16 products, float32 sums; P is rounded
 * to bfloat16 for P.V, as flash attention does) with the output accumulators held in registers.
 * Built at run time by engine/kernels/library.py (gcc -O3 -march=native); called through
 * ctypes, which releases the GIL; the threads are thread_pool.c's.
 *
 * An fp8 pool (--kv-cache-dtype fp8_e5m2 / fp8_e4m3, kv_dtype 2 / 3) is read one byte per element and
 * widened in registers, never into memory: the byte becomes the float16 with the same bits (e5m2: the
 * byte is a float16's high byte; e4m3: its exponent and mantissa moved 7 places up, the sign to bit 15,
 * which is the value / 2^8, subnormals included), and F16C widens that to float32 (AVX2 + FMA + F16C,
 * Zen 1 and up; a portable loop otherwise). The layer's k_scale (and e4m3's 2^8) goes into the score
 * scale, its v_scale into the output's normalisation: no per-element multiply. These pools take the
 * generic paths (the AVX512-BF16 ones read bf16 K/V only).
 *
 * Layers that are not plain attention (engine/layers/attention/kernel_rows.py): a logit soft-cap turns a
 * tile's scaled scores into cap * tanh(score / cap) before its softmax step (every score path; the
 * bf16 panel phase 1, attend_step.h, has no cap and is not taken with one); a head's sink logit joins
 * the denominator at the normalisation; row_of / starts let each query row read its own stretch of a
 * shared table row (the new tokens of an extend, each with its window or causal limit), and a tree
 * draft's rows list their ancestors after a cascade prefix.
 */
#include "attend_step.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KV8_AVX2 1
#endif
/* With AVX2 every pool dtype takes the register-blocked row products (dot_rows, pv_rows: the rows of a
 * GQA group share each K/V read); without it fp32 / bf16 keep the plain loops. */
#if defined(KV8_AVX2)
#define KV_ROWS_AVX2 1
#else
#define KV_ROWS_AVX2 0
#endif

enum { KV_FP8_E5M2 = 2, KV_FP8_E4M3 = 3 }; /* decode_attention_args_t.kv_dtype, beside DTYPE_F32 / BF16 */

#define TILE 128 /* keys per online-softmax step (a multiple of 16) */

typedef struct {
    const void *k, *v;
    int64_t k_stride, v_stride; /* elements per pool slot */
    int64_t dim;
    int dtype;    /* q's and out's */
    float scale;  /* of the scores: the softmax scale times an fp8 pool's k_scale (and e4m3's 2^8) */
    int kv_dtype; /* the pool's: dtype, or KV_FP8_* */
    float v_scale; /* the outputs' factor: an fp8 pool's v_scale (and e4m3's 2^8), else 1 */
    float cap;     /* the logit soft-cap of the scaled scores (Gemma 2), 0: none */
} kv_t;

static inline int kv_fp8(const kv_t *kv) { return kv->kv_dtype == KV_FP8_E5M2 || kv->kv_dtype == KV_FP8_E4M3; }
static inline int kv_elem(const kv_t *kv) { return kv_fp8(kv) ? 1 : kv->kv_dtype == DTYPE_F32 ? 4 : 2; }

/* An fp8 byte as float32, e4m3 / 2^8 (see the top of the file): the portable path's conversion. */
static inline float fp8_raw(uint8_t b, int kv_dtype) {
    const float sign = (b & 0x80) ? -1.f : 1.f;
    if (kv_dtype == KV_FP8_E5M2) {
        const int e = (b >> 2) & 0x1f, m = b & 3;
        if (e == 31) return m ? NAN : sign * INFINITY;
        return sign * (e == 0 ? ldexpf((float)m / 4.f, -14) : ldexpf(1.f + (float)m / 4.f, e - 15));
    }
    const int e = (b >> 3) & 0xf, m = b & 7;
    return sign * (e == 0 ? ldexpf((float)m / 8.f, -6 - 8) : ldexpf(1.f + (float)m / 8.f, e - 7 - 8));
}

#if defined(KV8_AVX2)
/* 8 consecutive fp8 elements as float32 (e4m3 / 2^8). */
static inline __attribute__((always_inline)) __m256 fp8_widen8(const uint8_t *p, int kv_dtype) {
    const __m128i h = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    if (kv_dtype == KV_FP8_E5M2) return _mm256_cvtph_ps(_mm_slli_epi16(h, 8));
    const __m128i half = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7f)), 7),
                                      _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x80)), 8));
    return _mm256_cvtph_ps(half);
}

/* exp(x) for x <= 0, 8 lanes: Cephes' polynomial after the range reduction by ln 2, as exp512. */
static inline __m256 exp256_neg(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    /* times 2^k, k in [-126, 0]: k + 127 in the exponent field */
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#endif

/* Element e of a pool row as float32 (fp8: e4m3 / 2^8), the portable paths' read. */
static inline float kv_raw(const void *base, int64_t e, int kv_dtype) {
    if (kv_dtype == DTYPE_F32) return ((const float *)base)[e];
    if (kv_dtype == DTYPE_BF16) return bf16_to_f32(((const uint16_t *)base)[e]);
    return fp8_raw(((const uint8_t *)base)[e], kv_dtype);
}

#if defined(KV8_AVX2)
/* Elements e .. e + 8 of a pool row as float32 (fp8: e4m3 / 2^8): bf16 and fp8 widened in registers. */
static inline __attribute__((always_inline)) __m256 kv_widen8(const void *base, int64_t e, int kv_dtype) {
    if (kv_dtype == DTYPE_F32) return _mm256_loadu_ps((const float *)base + e);
    if (kv_dtype == DTYPE_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + e))), 16));
    return fp8_widen8((const uint8_t *)base + e, kv_dtype);
}
#endif

/* out[j * out_stride] = q_j . k for the nr query rows q_j = q + j * dim (consecutive in the scratch) that
 * share one K row (a GQA group; elements k_off .. of the pool k): each 8 elements of the row are read
 * (and widened) once for all the rows. Unscaled. Inlined per pool dtype by dot_rows. */
static inline __attribute__((always_inline)) void dot_rows_as(const float *q, int64_t nr, int64_t dim, const void *k,
                                                               int64_t k_off, int kv_dtype, float *out,
                                                               int64_t out_stride) {
    for (int64_t r0 = 0; r0 < nr; r0 += 4) {
        const int64_t n = nr - r0 < 4 ? nr - r0 : 4;
        const float *q0 = q + r0 * dim;
        float sums[4] = {0.f, 0.f, 0.f, 0.f};
        int64_t d = 0;
#if defined(KV8_AVX2)
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (; d + 8 <= dim; d += 8) {
            const __m256 kv8 = kv_widen8(k, k_off + d, kv_dtype);
            for (int64_t j = 0; j < n; j++) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + j * dim + d), kv8, acc[j]);
        }
        for (int64_t j = 0; j < n; j++) sums[j] = hsum8(acc[j]);
#endif
        for (; d < dim; d++) {
            const float kd = kv_raw(k, k_off + d, kv_dtype);
            for (int64_t j = 0; j < n; j++) sums[j] += q0[j * dim + d] * kd;
        }
        for (int64_t j = 0; j < n; j++) out[(r0 + j) * out_stride] = sums[j];
    }
}

static void dot_rows(const float *q, int64_t nr, int64_t dim, const void *k, int64_t k_off, int kv_dtype, float *out,
                     int64_t out_stride) {
    switch (kv_dtype) { /* constant kv_dtype in each copy: the widening is chosen once, not per element */
    case DTYPE_F32: dot_rows_as(q, nr, dim, k, k_off, DTYPE_F32, out, out_stride); break;
    case DTYPE_BF16: dot_rows_as(q, nr, dim, k, k_off, DTYPE_BF16, out, out_stride); break;
    case KV_FP8_E5M2: dot_rows_as(q, nr, dim, k, k_off, KV_FP8_E5M2, out, out_stride); break;
    default: dot_rows_as(q, nr, dim, k, k_off, KV_FP8_E4M3, out, out_stride); break;
    }
}

/* acc_j += sum_i p_j[i] * V_i over a tile's nt keys (V rows at element idx[i] * v_stride + koff of the pool
 * v, unscaled) for the nr accumulator rows acc_j = acc + j * dim that share the KV head, p_j = p + j *
 * p_stride. With AVX2, 4 rows x 16 dimensions of sums stay in registers across the keys, each 16
 * elements of a V row read (and widened) once for the 4 rows (one pass over a tile's V rows per 16
 * dimensions: the tile's rows stay in L1). Inlined per pool dtype by pv_rows. */
static inline __attribute__((always_inline)) void pv_rows_as(float *acc, int64_t nr, int64_t dim, const float *p,
                                                              int64_t p_stride, const int64_t *idx, int64_t nt,
                                                              const void *v, int64_t v_stride, int64_t koff,
                                                              int kv_dtype) {
    int64_t d0 = 0;
#if defined(KV8_AVX2)
    for (; d0 + 16 <= dim; d0 += 16)
        for (int64_t r0 = 0; r0 < nr; r0 += 4) {
            const int64_t n = nr - r0 < 4 ? nr - r0 : 4;
            __m256 a[4][2];
            for (int64_t j = 0; j < n; j++) {
                a[j][0] = _mm256_loadu_ps(acc + (r0 + j) * dim + d0);
                a[j][1] = _mm256_loadu_ps(acc + (r0 + j) * dim + d0 + 8);
            }
            for (int64_t i = 0; i < nt; i++) {
                const int64_t row = idx[i] * v_stride + koff + d0;
                const __m256 w0 = kv_widen8(v, row, kv_dtype), w1 = kv_widen8(v, row + 8, kv_dtype);
                for (int64_t j = 0; j < n; j++) {
                    const __m256 pj = _mm256_broadcast_ss(p + (r0 + j) * p_stride + i);
                    a[j][0] = _mm256_fmadd_ps(pj, w0, a[j][0]);
                    a[j][1] = _mm256_fmadd_ps(pj, w1, a[j][1]);
                }
            }
            for (int64_t j = 0; j < n; j++) {
                _mm256_storeu_ps(acc + (r0 + j) * dim + d0, a[j][0]);
                _mm256_storeu_ps(acc + (r0 + j) * dim + d0 + 8, a[j][1]);
            }
        }
#endif
    if (d0 == dim) return;
    for (int64_t i = 0; i < nt; i++) { /* the dimensions past the last 16 (all of them without AVX2) */
        const int64_t row = idx[i] * v_stride + koff;
        for (int64_t j = 0; j < nr; j++) {
            const float pj = p[j * p_stride + i];
            float *a = acc + j * dim;
            for (int64_t d = d0; d < dim; d++) a[d] += pj * kv_raw(v, row + d, kv_dtype);
        }
    }
}

static void pv_rows(float *acc, int64_t nr, int64_t dim, const float *p, int64_t p_stride, const int64_t *idx,
                    int64_t nt, const void *v, int64_t v_stride, int64_t koff, int kv_dtype) {
    switch (kv_dtype) {
    case DTYPE_F32: pv_rows_as(acc, nr, dim, p, p_stride, idx, nt, v, v_stride, koff, DTYPE_F32); break;
    case DTYPE_BF16: pv_rows_as(acc, nr, dim, p, p_stride, idx, nt, v, v_stride, koff, DTYPE_BF16); break;
    case KV_FP8_E5M2: pv_rows_as(acc, nr, dim, p, p_stride, idx, nt, v, v_stride, koff, KV_FP8_E5M2); break;
    default: pv_rows_as(acc, nr, dim, p, p_stride, idx, nt, v, v_stride, koff, KV_FP8_E4M3); break;
    }
}

/* How many rows from r on read the same KV head as row r (the task's rows come grouped by head). */
static inline int64_t same_head_run(const int64_t *koff, int64_t r, int64_t rows) {
    int64_t end = r + 1;
    while (end < rows && koff[end] == koff[r]) end++;
    return end - r;
}

typedef struct { /* one thread's scratch */
    float *scores;   /* rows x TILE */
    uint16_t *pbf;   /* rows x (TILE + 2): P in bfloat16 for the P.V products */
    float *qf;       /* rows x dim: q as float32, for the generic path */
    float *vrow;     /* dim */
    float *m, *l;    /* rows */
    float *acc;      /* rows x dim */
    const void **qrows;
    int64_t *koff;   /* rows: the offset of the row's KV head within a slot, in elements */
} work_t;

/* Slot rows are read at random places of the pool: each one's cache lines are requested ahead. */
static inline void prefetch_rows(const void *base, const int64_t *idx, int64_t n, int64_t stride, int64_t off,
                                 int elem, int64_t bytes) {
    for (int64_t i = 0; i < n; i++) {
        const char *row = (const char *)base + (idx[i] * stride + off) * elem;
        for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b);
    }
}

/* Whether most of a tile's slots follow each other in the pool (a prompt's slots usually do). */
static int mostly_consecutive(const int64_t *idx, int64_t n) {
    int64_t runs = 0;
    for (int64_t i = 1; i < n; i++) runs += idx[i] == idx[i - 1] + 1;
    return 2 * runs >= n;
}

/* Reads every cache line of the tile's K and V rows in address order before the products use them:
 * a plain sequential read is what the hardware prefetchers stream at full rate (47 GB/s on one core
 * of the 2-core AMD EPYC), while the products' own loads, a head's slice of 16 rows at a time between
 * runs of arithmetic, and software prefetches of the same lines kept only a few reads in flight
 * (12-15 GB/s a thread). 64 requests x 1,040 keys in order, 2 threads: 4.2-4.5 -> 2.95 ms a layer.
 * Slots scattered over the pool gain nothing from it (a row is only 16 lines) and keep the prefetches. */
static void touch_rows(const kv_t *kv, const int64_t *idx, int64_t n, int64_t off, int elem, int64_t bytes) {
    for (int64_t i = 0; i < n; i++) {
        const char *k = (const char *)kv->k + (idx[i] * kv->k_stride + off) * elem;
        const char *v = (const char *)kv->v + (idx[i] * kv->v_stride + off) * elem;
        for (int64_t b = 0; b < bytes; b += 64) {
            (void)*(const volatile uint32_t *)(k + b);
            (void)*(const volatile uint32_t *)(v + b);
        }
    }
}

#if defined(__AVX512F__)
/* out lane t = the sum of the 16 lanes of v[t]: a transpose-add tree, 45 instructions for 16 sums. */
static inline __m512 reduce16(const __m512 v[16]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* per 128-bit block: v2i[0]+v2i[2], v2i+1[0]+.., v2i[1]+v2i[3], .. */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per block: the 4 partial sums of 4 vectors */
        b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}
#endif

/* x[i] = exp(x[i] - sub) for i < n; returns their sum. */
static inline float exp_sub_sum(float *x, int64_t n, float sub) {
    float sum = 0.f;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 s = _mm512_setzero_ps(), m = _mm512_set1_ps(sub);
    for (; i + 16 <= n; i += 16) {
        __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i), m));
        _mm512_storeu_ps(x + i, e);
        s = _mm512_add_ps(s, e);
    }
    if (i < n) {
        __mmask16 mask = (__mmask16)((1u << (n - i)) - 1u);
        __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, x + i), m));
        _mm512_mask_storeu_ps(x + i, mask, e);
        s = _mm512_add_ps(s, _mm512_maskz_mov_ps(mask, e));
        i = n;
    }
    sum = _mm512_reduce_add_ps(s);
#endif
    for (; i < n; i++) {
        x[i] = expf(x[i] - sub);
        sum += x[i];
    }
    return sum;
}

/* s = cap * tanh(s / cap) over rows x n scores (row stride TILE): Gemma 2's soft-cap of the scaled
 * scores, before the softmax. tanh(y) = sign(y) (1 - e) / (1 + e) with e = exp(-2 |y|). */
static void soft_cap(float *scores, int64_t rows, int64_t n, float cap) {
    const float inv = 1.f / cap;
    for (int64_t r = 0; r < rows; r++) {
        float *s = scores + r * TILE;
        int64_t i = 0;
#if defined(KV8_AVX2)
        const __m256 sign = _mm256_set1_ps(-0.f), one = _mm256_set1_ps(1.f);
        for (; i + 8 <= n; i += 8) {
            const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(inv));
            const __m256 e = exp256_neg(_mm256_mul_ps(_mm256_andnot_ps(sign, y), _mm256_set1_ps(-2.f)));
            const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
            _mm256_storeu_ps(s + i, _mm256_mul_ps(_mm256_or_ps(t, _mm256_and_ps(sign, y)), _mm256_set1_ps(cap)));
        }
#endif
        for (; i < n; i++) s[i] = cap * tanhf(s[i] * inv);
    }
}

/* scores[r * TILE + i] = scale * q_r . k_i (k_i: slot idx[i], the row's KV head) for n <= TILE keys. */
static void score_tile(work_t *w, int64_t rows, const int64_t *idx, int64_t n, const kv_t *kv, int64_t row_bytes,
                       int prefetch) {
    const int64_t dim = kv->dim;
    const int elem = kv_elem(kv);
#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
    const int simd_bf16 = kv->dtype == DTYPE_BF16 && kv->kv_dtype == DTYPE_BF16 && dim % 32 == 0;
#else
    const int simd_bf16 = 0;
#endif
    const int simd_f32 = kv->dtype == DTYPE_F32 && kv->kv_dtype == DTYPE_F32 && dim % 16 == 0;
    if (simd_bf16 || simd_f32) {
        const __m512 scale = _mm512_set1_ps(kv->scale);
        for (int64_t b0 = 0; b0 < n; b0 += 16) {
            const char *krow[16];
            for (int t = 0; t < 16; t++) /* a short last block repeats its first key */
                krow[t] = (const char *)kv->k + idx[b0 + t < n ? b0 + t : b0] * kv->k_stride * elem;
            if (prefetch) { /* the next block's K rows, and this block's V rows for the P.V pass after */
                if (b0 + 16 < n)
                    prefetch_rows(kv->k, idx + b0 + 16, n - b0 - 16 < 16 ? n - b0 - 16 : 16, kv->k_stride, w->koff[0],
                                  elem, row_bytes);
                prefetch_rows(kv->v, idx + b0, n - b0 < 16 ? n - b0 : 16, kv->v_stride, w->koff[0], elem, row_bytes);
            }
            for (int64_t r = 0; r < rows; r++) {
                const char *qr = (const char *)w->qrows[r];
                const int64_t off = w->koff[r] * elem;
                __m512 acc[16];
                for (int t = 0; t < 16; t++) acc[t] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
                if (simd_bf16) {
                    for (int64_t d = 0; d < dim; d += 32) {
                        const __m512bh qv = (__m512bh)_mm512_loadu_si512(qr + d * 2);
                        for (int t = 0; t < 16; t++)
                            acc[t] = _mm512_dpbf16_ps(acc[t], qv, (__m512bh)_mm512_loadu_si512(krow[t] + off + d * 2));
                    }
                } else
#endif
                {
                    for (int64_t d = 0; d < dim; d += 16) {
                        const __m512 qv = _mm512_loadu_ps((const float *)qr + d);
                        for (int t = 0; t < 16; t++)
                            acc[t] = _mm512_fmadd_ps(qv, _mm512_loadu_ps((const float *)(krow[t] + off) + d), acc[t]);
                    }
                }
                _mm512_storeu_ps(w->scores + r * TILE + b0, _mm512_mul_ps(reduce16(acc), scale));
            }
        }
        return;
    }
#endif
    if (kv_fp8(kv) || KV_ROWS_AVX2) { /* fp8 always; every pool dtype with AVX2 */
        /* Rows outer: a run's q rows stay in L1 over the tile's K rows, which stay in L2 for the next run
         * (a cascade's phase 1 has thousands of rows: an extend's new tokens over their prefix). */
        for (int64_t r = 0, run; r < rows; r += run) {
            run = same_head_run(w->koff, r, rows);
            for (int64_t i = 0; i < n; i++)
                dot_rows(w->qf + r * dim, run, dim, kv->k, idx[i] * kv->k_stride + w->koff[r], kv->kv_dtype,
                         w->scores + r * TILE + i, TILE);
        }
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < n; i++) w->scores[r * TILE + i] *= kv->scale;
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        for (int64_t r = 0; r < rows; r++) {
            const float *kr = load_row(kv->k, idx[i] * kv->k_stride + w->koff[r], dim, kv->kv_dtype, w->vrow);
            const float *qr = w->qf + r * dim;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < dim; d++) s += qr[d] * kr[d];
            w->scores[r * TILE + i] = s * kv->scale;
        }
    }
}

#if defined(__AVX512BF16__)
/* acc[r] += sum_i P[r][i] * V_i for rows [r0, r0 + RC) that share one KV head (offset off), nt keys;
 * ND = dim / 16 accumulators per row stay in registers. Keys go in pairs: V_i and V_i+1 are
 * interleaved element-wise (one permute per 16 dims) so that vdpbf16ps multiplies them by the
 * (P_i, P_i+1) pair; an odd last key is paired with itself and weight 0. */
static inline __attribute__((always_inline)) void pv_bf16(work_t *w, int64_t r0, const int RC, const int ND,
                                                          const int64_t *idx, int64_t nt, const kv_t *kv,
                                                          int64_t off) {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    const int64_t dim = kv->dim;
    __m512 acc[24];
    for (int r = 0; r < RC; r++)
        for (int c = 0; c < ND; c++) acc[r * ND + c] = _mm512_loadu_ps(w->acc + (r0 + r) * dim + c * 16);
    for (int64_t i = 0; i < nt; i += 2) {
        const uint16_t *va = (const uint16_t *)kv->v + idx[i] * kv->v_stride + off;
        const uint16_t *vb = (const uint16_t *)kv->v + idx[i + 1 < nt ? i + 1 : i] * kv->v_stride + off;
        __m512i vn[8];
        for (int c = 0; c < ND; c += 2) {
            const __m512i a = _mm512_loadu_si512(va + c * 16), b = _mm512_loadu_si512(vb + c * 16);
            vn[c] = _mm512_permutex2var_epi16(a, lo, b);
            vn[c + 1] = _mm512_permutex2var_epi16(a, hi, b);
        }
        for (int r = 0; r < RC; r++) {
            uint32_t pair;
            memcpy(&pair, w->pbf + (r0 + r) * (TILE + 2) + i, 4);
            const __m512bh p = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int c = 0; c < ND; c++) acc[r * ND + c] = _mm512_dpbf16_ps(acc[r * ND + c], p, (__m512bh)vn[c]);
        }
    }
    for (int r = 0; r < RC; r++)
        for (int c = 0; c < ND; c++) _mm512_storeu_ps(w->acc + (r0 + r) * dim + c * 16, acc[r * ND + c]);
}

/* P.V for every row, by runs of rows with the same KV head, RC rows at a time. */
static void pv_tile_bf16(work_t *w, int64_t rows, const int64_t *idx, int64_t nt, const kv_t *kv) {
    const int ND = (int)(kv->dim / 16);
    for (int64_t r = 0; r < rows;) {
        int64_t end = r + 1;
        while (end < rows && w->koff[end] == w->koff[r]) end++;
        for (; r < end;) {
            const int64_t left = end - r;
/* RC rows per pass when that many share the head, else 2 (a GQA group of 2), else 1: each pass
 * reads and interleaves the V rows once for all its rows. */
#define PV_CASE(nd, rc)                                                      \
    if (ND == nd) {                                                          \
        if (left >= rc) {                                                    \
            pv_bf16(w, r, rc, nd, idx, nt, kv, w->koff[r]);                  \
            r += rc;                                                         \
        } else if (left >= 2) {                                              \
            pv_bf16(w, r, 2, nd, idx, nt, kv, w->koff[r]);                   \
            r += 2;                                                          \
        } else {                                                             \
            pv_bf16(w, r, 1, nd, idx, nt, kv, w->koff[r]);                   \
            r += 1;                                                          \
        }                                                                    \
        continue;                                                            \
    }
            PV_CASE(2, 8)
            PV_CASE(4, 5)
            PV_CASE(8, 2)
#undef PV_CASE
        }
    }
}
#endif

/* Online softmax of `rows` query rows over the slots idx[0..n), continuing the state (w->m, w->l,
 * w->acc) that the caller initialised or a previous call left. */
static void attend(work_t *w, int64_t rows, const int64_t *idx, int64_t n, const kv_t *kv, int64_t kv_width) {
    const int64_t dim = kv->dim;
    const int elem = kv_elem(kv);
    /* The rows read kv_width elements of each slot from koff[0] on (one head, or a run of heads). */
    const int64_t row_bytes = kv_width * elem;
#if defined(__AVX512BF16__)
    const int fast_pv = kv->dtype == DTYPE_BF16 && kv->kv_dtype == DTYPE_BF16 && (dim == 32 || dim == 64 || dim == 128);
#else
    const int fast_pv = 0;
#endif
    for (int64_t r = 0; r < rows; r++) /* the generic score path reads q as float32 */
        memcpy(w->qf + r * dim, load_row(w->qrows[r], 0, dim, kv->dtype, w->vrow), sizeof(float) * (size_t)dim);
    /* Tasks that take whole slots (every KV head of a request) read their tiles of consecutive slots
     * in one sequential pass first (touch_rows). */
    const int whole_slots = w->koff[0] == 0 && kv_width == kv->k_stride && kv_width == kv->v_stride;
    for (int64_t i0 = 0; i0 < n; i0 += TILE) {
        const int64_t nt = n - i0 < TILE ? n - i0 : TILE;
        const int streamed = whole_slots && mostly_consecutive(idx + i0, nt);
        if (streamed) touch_rows(kv, idx + i0, nt, 0, elem, row_bytes);
        score_tile(w, rows, idx + i0, nt, kv, row_bytes, !streamed);
        if (kv->cap > 0.f) soft_cap(w->scores, rows, nt, kv->cap);
        for (int64_t r = 0; r < rows; r++) {
            float *s = w->scores + r * TILE;
            const float mt = max_of(s, nt);
            const float m_new = mt > w->m[r] ? mt : w->m[r];
            const float corr = w->m[r] == -INFINITY ? 0.f : expf(w->m[r] - m_new);
            w->l[r] = w->l[r] * corr + exp_sub_sum(s, nt, m_new);
            w->m[r] = m_new;
            if (corr != 1.f) {
                float *a = w->acc + r * dim;
#pragma omp simd
                for (int64_t d = 0; d < dim; d++) a[d] *= corr;
            }
            if (fast_pv) {
                store_row(w->pbf, r * (TILE + 2), s, nt, DTYPE_BF16);
                w->pbf[r * (TILE + 2) + nt] = 0; /* the weight of an odd tile's padding key */
            }
        }
        if (i0 + nt < n && !streamed) /* the first K rows of the next tile */
            prefetch_rows(kv->k, idx + i0 + nt, n - i0 - nt < 16 ? n - i0 - nt : 16, kv->k_stride, w->koff[0], elem,
                          row_bytes);
#if defined(__AVX512BF16__)
        if (fast_pv) {
            pv_tile_bf16(w, rows, idx + i0, nt, kv);
            continue;
        }
#endif
        if (kv_fp8(kv) || KV_ROWS_AVX2) {
            for (int64_t r = 0, run; r < rows; r += run) {
                run = same_head_run(w->koff, r, rows);
                pv_rows(w->acc + r * dim, run, dim, w->scores + r * TILE, TILE, idx + i0, nt, kv->v, kv->v_stride,
                        w->koff[r], kv->kv_dtype);
            }
            continue;
        }
        for (int64_t i = 0; i < nt; i++) {
            for (int64_t r = 0; r < rows; r++) {
                const float *vr = load_row(kv->v, idx[i0 + i] * kv->v_stride + w->koff[r], dim, kv->kv_dtype, w->vrow);
                const float p = w->scores[r * TILE + i];
                float *a = w->acc + r * dim;
#pragma omp simd
                for (int64_t d = 0; d < dim; d++) a[d] += p * vr[d];
            }
        }
    }
}

#if defined(__AVX512BF16__)
/* Phase 1 with bfloat16 data (dim a multiple of 32, at most 256): up to 32 query rows of one KV head
 * against a group's prefix, as prefill attention does it (attend_step.h: register tiles, or AMX tiles
 * where the CPU has them), over the K^T and V panels of each step's keys: packed from the pool at
 * the step, or read from a kept prefix's panels (engine/layers/attention/prefix_panels.py). The state
 * left (max, sum, unnormalised output per row) is what phase 2 resumes. On the 2-core AMD EPYC Zen 4,
 * 8 groups x 16 requests over 1024-token prefixes, 8 layers' pools in one process: 3.5-3.7 -> 2.3 ms
 * a layer with kept panels, against the query rows along the vector lanes and K, V read from the pool
 * row by row (whose loads were a head's 128 bytes of every slot: latency-bound). */
#define PREFIX_MAX_DIM 256

static int prefix_fast(const kv_t *kv) {
    return kv->dtype == DTYPE_BF16 && kv->kv_dtype == DTYPE_BF16 && kv->dim % 32 == 0 && kv->dim <= PREFIX_MAX_DIM;
}

typedef struct {
    uint16_t *qa;  /* [32][dim] */
    uint16_t *kp;  /* [ATTN_KEYS / 64][dim / 2][64][2] */
    uint16_t *vp;  /* [ceil(dim / 64)][ATTN_KEYS / 2][64][2] */
    float *acc;    /* [32][dim] */
    attn_scratch_t attn;
} pa_work_t;

static void pa_alloc(pa_work_t *p, int64_t dim) {
    p->qa = (uint16_t *)calloc((size_t)(32 * dim), sizeof(uint16_t));
    p->kp = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * (size_t)(ATTN_KEYS * dim));
    p->vp = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * (size_t)((dim + 63) / 64 * 64 * ATTN_KEYS));
    p->acc = (float *)aligned_alloc(64, sizeof(float) * (size_t)(32 * dim));
    attn_scratch_alloc(&p->attn, dim);
}

static void pa_free(pa_work_t *p) {
    free(p->qa);
    free(p->kp);
    free(p->vp);
    free(p->acc);
    attn_scratch_free(&p->attn);
}

/* Panels a prefix's K^T and V take, per KV head: every ATTN_KEYS-key step's K^T
 * (pack_k_panels) then its V (pack_v_panels, ATTN_KEYS / 2 pairs a panel). */
static int64_t panel_step_elems(int64_t dim) { return ATTN_KEYS * dim + (dim + 63) / 64 * 64 * ATTN_KEYS; }

/* A kept prefix's block for one layer: per KV head a 64-byte header (the token of the fill the head's
 * panels belong to) and its panels. */
#define PANEL_HEADER 32 /* uint16 elements: 64 bytes */
static int64_t panel_head_elems(int64_t n, int64_t dim) {
    return PANEL_HEADER + (n + ATTN_KEYS - 1) / ATTN_KEYS * panel_step_elems(dim);
}

/* Phase 1 for nr <= 32 rows (q row pointers) over slots idx[0..n) of one KV head (offset koff in a
 * slot); the state goes to m[r], l[r], acc_out[r] (unnormalised). With amx the tiles are configured
 * for 16 rows by the caller. kept: this KV head's block of a kept prefix (panel_head_elems), or
 * NULL. Where its header holds `token` the panels are read as they are (packed by an earlier step);
 * where `fill` is set they are packed into it and the header set after; otherwise into the scratch.
 * then / then_bytes: memory to request into L2 during the last step (or NULL). */
static void prefix_attend_panels(pa_work_t *p, const uint16_t *const *qrows, int64_t nr, int64_t koff,
                                 const int64_t *idx, int64_t n, const kv_t *kv, float *m, float *l,
                                 float *const *acc_out, uint16_t *kept, int64_t token, int fill, int amx,
                                 const char *then, int64_t then_bytes) {
    const int64_t dim = kv->dim, step = panel_step_elems(dim);
    _Atomic int64_t *header = kept != NULL ? (_Atomic int64_t *)kept : NULL;
    const int ready = header != NULL && atomic_load_explicit(header, memory_order_acquire) == token;
    uint16_t *panels = ready || (header != NULL && fill) ? kept + PANEL_HEADER : NULL;
    for (int64_t r = 0; r < nr; r++) {
        memcpy(p->qa + r * dim, qrows[r], sizeof(uint16_t) * (size_t)dim);
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
#if defined(HAVE_AMX)
    if (amx) { /* the tiles read whole blocks of 16 rows */
        const int64_t blocks = (nr + AMX_ROWS - 1) / AMX_ROWS;
        memset(p->qa + nr * dim, 0, sizeof(uint16_t) * (size_t)((blocks * AMX_ROWS - nr) * dim));
    }
#endif
    memset(p->acc, 0, sizeof(float) * (size_t)(nr * dim));
    for (int64_t i0 = 0; i0 < n; i0 += ATTN_KEYS) {
        const int64_t nt = n - i0 < ATTN_KEYS ? n - i0 : ATTN_KEYS;
        int64_t vis[32];
        for (int64_t r = 0; r < nr; r++) vis[r] = nt;
        uint16_t *kp = panels != NULL ? panels + i0 / ATTN_KEYS * step : p->kp;
        uint16_t *vp = panels != NULL ? kp + ATTN_KEYS * dim : p->vp;
        if (!ready) {
            pack_k_panels((const uint16_t *)kv->k, kv->k_stride, idx + i0, nt, koff, dim / 2, kp);
            pack_v_panels((const uint16_t *)kv->v, kv->v_stride, idx + i0, nt, koff, dim, ATTN_KEYS / 2, vp);
        }
        /* Kept panels lie in order, read from memory: the next step's are requested meanwhile, and
         * during the last step the first of `then` (the panels this thread is likely to read next). */
        const int next = ready && i0 + ATTN_KEYS < n, last = i0 + ATTN_KEYS >= n;
        attend_step(p->qa, nr, dim, kp, vp, ATTN_KEYS / 2 * 128, vis, kv->scale, m, l, p->acc, &p->attn,
                    next ? (const char *)(kp + step) : last ? then : NULL, next ? step * 2 : last ? then_bytes : 0, amx);
    }
    if (panels != NULL && !ready) atomic_store_explicit(header, token, memory_order_release);
    for (int64_t r = 0; r < nr; r++) memcpy(acc_out[r], p->acc + r * dim, sizeof(float) * (size_t)dim);
}
#endif

static void reset_state(work_t *w, int64_t rows, int64_t dim) {
    for (int64_t r = 0; r < rows; r++) {
        w->m[r] = -INFINITY;
        w->l[r] = 0.f;
    }
    memset(w->acc, 0, sizeof(float) * (size_t)(rows * dim));
}

/* q, out: [bs, heads * dim]; k, v: [num_slots, kv_heads * dim] (slot stride given in elements);
 * kv_indices: [bs, max_len] int64, the first lens[b] entries of row b are request b's own slots (past
 * its group's prefix when it has one).
 * Cascade (num_groups > 0): group g's members are group_members[group_offsets[g] ..
 * group_offsets[g + 1]), its prefix the first prefix_lens[g] entries of row g of prefix_indices
 * [num_groups, max_prefix]; group_of[b] is request b's group or -1. */
typedef struct {
    const void *q;
    const int64_t *kv_indices, *lens;
    int64_t max_len, bs, heads, kv_heads, dim;
    int dtype;
    void *out;
    int64_t num_groups;
    const int64_t *group_offsets, *group_members, *prefix_indices, *prefix_lens;
    int64_t max_prefix;
    const int64_t *group_of;
    const int64_t *kept, *kept_tokens;
    const float *sinks;
    const int64_t *row_of, *starts;
    kv_t kv;
    int64_t group, block, blocks, max_rows, pf_blocks;
    float *pm, *pl, *pacc;
    _Atomic int64_t next_prefix, next_request; /* the next task of each phase */
} decode_job_t;

#if defined(__AVX512BF16__)
/* KV head h's block of group g's kept prefix panels (panel_head_elems), or NULL. */
static uint16_t *kept_block(const decode_job_t *J, int64_t g, int64_t h, int64_t dim) {
    if (J->kept == NULL || J->kept[g] == 0) return NULL;
    return (uint16_t *)(intptr_t)J->kept[g] + h * panel_head_elems(J->prefix_lens[g], dim);
}
#endif

static void decode_part(void *arg, int tid, int nthreads) {
    decode_job_t *J = (decode_job_t *)arg;
    (void)tid;
    const void *q = J->q;
    const int64_t *kv_indices = J->kv_indices, *lens = J->lens;
    const int64_t max_len = J->max_len, bs = J->bs, heads = J->heads, kv_heads = J->kv_heads, dim = J->dim;
    const int dtype = J->dtype;
    void *out = J->out;
    const int64_t num_groups = J->num_groups, max_prefix = J->max_prefix;
    const int64_t *group_offsets = J->group_offsets, *group_members = J->group_members;
    const int64_t *prefix_indices = J->prefix_indices, *prefix_lens = J->prefix_lens, *group_of = J->group_of;
    const kv_t kv = J->kv;
    const int64_t group = J->group, block = J->block, blocks = J->blocks, max_rows = J->max_rows;
    const int64_t pf_blocks = J->pf_blocks;
    const int elem = dtype == DTYPE_F32 ? 4 : 2;
    float *pm = J->pm, *pl = J->pl, *pacc = J->pacc;
    work_t w;
    w.scores = (float *)malloc(sizeof(float) * (size_t)(max_rows * TILE));
    w.pbf = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(max_rows * (TILE + 2)));
    w.qf = (float *)malloc(sizeof(float) * (size_t)(max_rows * dim));
    w.vrow = (float *)malloc(sizeof(float) * (size_t)dim);
    w.m = (float *)malloc(sizeof(float) * (size_t)max_rows);
    w.l = (float *)malloc(sizeof(float) * (size_t)max_rows);
    w.acc = (float *)malloc(sizeof(float) * (size_t)(max_rows * dim));
    w.qrows = (const void **)malloc(sizeof(void *) * (size_t)max_rows);
    w.koff = (int64_t *)malloc(sizeof(int64_t) * (size_t)max_rows);
#if defined(__AVX512BF16__)
    if (num_groups > 0 && prefix_fast(&kv) && kv.cap == 0.f) { /* attend_step has no soft-cap */
        /* Tasks: (group, KV head, block of 32 query rows). */
        pa_work_t pa = {0};
#if defined(HAVE_AMX)
        const int amx = amx_active();
        if (amx) amx_configure(AMX_ROWS);
#else
        const int amx = 0;
#endif
        pa_alloc(&pa, dim);
        const uint16_t *qr[32];
        float *accs[32];
        DYNAMIC_FOR(t, num_groups * kv_heads * pf_blocks, &J->next_prefix) {
            const int64_t g = t / (kv_heads * pf_blocks), h = (t / pf_blocks) % kv_heads, blk = t % pf_blocks;
            const int64_t *members = group_members + group_offsets[g];
            const int64_t rows = (group_offsets[g + 1] - group_offsets[g]) * group;
            const int64_t r0 = blk * 32, nr = rows - r0 < 32 ? rows - r0 : 32;
            if (nr <= 0) continue;
            int64_t outs[32];
            for (int64_t r = 0; r < nr; r++) {
                const int64_t rr = r0 + r;
                outs[r] = members[rr / group] * heads + h * group + rr % group;
                qr[r] = (const uint16_t *)q + outs[r] * dim;
                accs[r] = pacc + outs[r] * dim;
            }
            float mr[32], lr[32];
            /* A kept prefix's panels: packed by the first row block of each head, read by every block
             * once the header says they are whole (the others pack their own meanwhile). */
            uint16_t *kept = kept_block(J, g, h, dim);
            /* The tasks go to the threads in turn: this one's next is likely nthreads on. */
            const int64_t tn = t + nthreads, gn = tn / (kv_heads * pf_blocks), hn = (tn / pf_blocks) % kv_heads;
            const uint16_t *then = tn < num_groups * kv_heads * pf_blocks ? kept_block(J, gn, hn, dim) : NULL;
            prefix_attend_panels(&pa, qr, nr, h * dim, prefix_indices + g * max_prefix, prefix_lens[g], &kv, mr, lr,
                                 accs, kept, kept != NULL ? J->kept_tokens[g] : 0, blk == 0, amx,
                                 then != NULL ? (const char *)(then + PANEL_HEADER) : NULL,
                                 then != NULL ? panel_step_elems(dim) * 2 : 0);
            for (int64_t r = 0; r < nr; r++) {
                pm[outs[r]] = mr[r];
                pl[outs[r]] = lr[r];
            }
        }
        pa_free(&pa);
#if defined(HAVE_AMX)
        if (amx) _tile_release();
#endif
    } else
#endif
    if (num_groups > 0) {
        DYNAMIC_FOR(t, num_groups * kv_heads, &J->next_prefix) {
            const int64_t g = t / kv_heads, h = t % kv_heads;
            const int64_t *members = group_members + group_offsets[g];
            const int64_t rows = (group_offsets[g + 1] - group_offsets[g]) * group;
            for (int64_t r = 0; r < rows; r++) {
                w.qrows[r] = (const char *)q + ((members[r / group] * heads + h * group + r % group) * dim) * elem;
                w.koff[r] = h * dim;
            }
            reset_state(&w, rows, dim);
            attend(&w, rows, prefix_indices + g * max_prefix, prefix_lens[g], &kv, dim);
            for (int64_t r = 0; r < rows; r++) {
                const int64_t o = members[r / group] * heads + h * group + r % group;
                pm[o] = w.m[r];
                pl[o] = w.l[r];
                memcpy(pacc + o * dim, w.acc + r * dim, sizeof(float) * (size_t)dim);
            }
        }
    }
    pool_barrier(nthreads); /* phase 2 resumes what phase 1 left */
    DYNAMIC_FOR(t, bs * blocks, &J->next_request) {
        const int64_t b = t / blocks, h0 = (t % blocks) * block, rows = block * group;
        const int64_t first = b * heads + h0 * group; /* the task's query heads are contiguous */
        for (int64_t r = 0; r < rows; r++) {
            w.qrows[r] = (const char *)q + (first + r) * dim * elem;
            w.koff[r] = (h0 + r / group) * dim;
        }
        if (group_of != NULL && group_of[b] >= 0) {
            memcpy(w.m, pm + first, sizeof(float) * (size_t)rows);
            memcpy(w.l, pl + first, sizeof(float) * (size_t)rows);
            memcpy(w.acc, pacc + first * dim, sizeof(float) * (size_t)(rows * dim));
        } else {
            reset_state(&w, rows, dim);
        }
        const int64_t *row = kv_indices + (J->row_of != NULL ? J->row_of[b] : b) * max_len;
        attend(&w, rows, row + (J->starts != NULL ? J->starts[b] : 0), lens[b], &kv, block * dim);
        for (int64_t r = 0; r < rows; r++) {
            float inv = w.l[r] > 0.f ? kv.v_scale / w.l[r] : 0.f; /* no keys: output 0 */
            if (J->sinks != NULL && w.l[r] > 0.f) { /* the head's sink joins the denominator only */
                const float sink = J->sinks[(first + r) % heads], top = fmaxf(w.m[r], sink);
                const float kept = expf(w.m[r] - top);
                inv = kv.v_scale * kept / (w.l[r] * kept + expf(sink - top));
            }
            const float *a = w.acc + r * dim;
            const int64_t o = (first + r) * dim;
            for (int64_t d = 0; d < dim; d++) {
                if (dtype == DTYPE_F32) ((float *)out)[o + d] = a[d] * inv;
                else ((uint16_t *)out)[o + d] = f32_to_bf16(a[d] * inv);
            }
        }
    }
    free(w.scores);
    free(w.pbf);
    free(w.qf);
    free(w.vrow);
    free(w.m);
    free(w.l);
    free(w.acc);
    free(w.qrows);
    free(w.koff);
}

void decode_attention(const decode_attention_args_t *args) {
    const decode_attention_args_t *a = args;
    const int64_t bs = a->bs, heads = a->heads, kv_heads = a->kv_heads, dim = a->dim, num_groups = a->num_groups;
    const int num_threads = a->num_threads;
    const int64_t *group_offsets = a->group_offsets;
    const int64_t group = heads / kv_heads;
    /* An fp8 pool: its scales, and e4m3's 2^8 (fp8_raw's values are e4m3 / 2^8), fold into the score
     * scale and the output's normalisation. */
    const float unit = a->kv_dtype == KV_FP8_E4M3 ? 256.f : 1.f;
    const int fp8 = a->kv_dtype == KV_FP8_E5M2 || a->kv_dtype == KV_FP8_E4M3;
    const kv_t kv = {a->k, a->v, a->k_stride, a->v_stride, dim, a->dtype,
                     fp8 ? a->scale * a->k_scale * unit : a->scale, a->kv_dtype, fp8 ? a->v_scale * unit : 1.f,
                     a->logit_cap > 0.f ? a->logit_cap : 0.f};
    /* Phase 2: whole requests when they keep every thread busy, else one KV head of a request. */
    const int64_t block = bs >= 2 * num_threads ? kv_heads : 1; /* KV heads per task */
    const int64_t blocks = kv_heads / block;
    int64_t max_rows = block * group;
    int64_t pf_blocks = 1; /* blocks of 32 query rows per (group, KV head) in the bf16 phase 1 */
    for (int64_t g = 0; g < num_groups; g++) {
        const int64_t rows = (group_offsets[g + 1] - group_offsets[g]) * group;
        max_rows = rows > max_rows ? rows : max_rows;
        pf_blocks = (rows + 31) / 32 > pf_blocks ? (rows + 31) / 32 : pf_blocks;
    }
    /* Phase 1's result per (request, head): running max, sum and unnormalised output. */
    float *pm = NULL, *pl = NULL, *pacc = NULL;
    if (num_groups > 0) {
        pm = (float *)malloc(sizeof(float) * (size_t)(bs * heads));
        pl = (float *)malloc(sizeof(float) * (size_t)(bs * heads));
        pacc = (float *)malloc(sizeof(float) * (size_t)(bs * heads * dim));
    }
    decode_job_t job = {a->q, a->kv_indices, a->lens, a->max_len, bs, heads, kv_heads, dim, a->dtype, a->out,
                        num_groups, group_offsets, a->group_members, a->prefix_indices, a->prefix_lens,
                        a->max_prefix, a->group_of, a->kept, a->kept_tokens, a->sinks, a->row_of, a->starts,
                        kv, group, block, blocks,
                        max_rows, pf_blocks, pm, pl, pacc, 0, 0};
    pool_run(decode_part, &job, num_threads);
    free(pm);
    free(pl);
    free(pacc);
}

/* Elements (uint16) one layer's block of a kept prefix of n keys takes (prefix_attend_panels): 0 where
 * the cascade does not use panels (no AVX512-BF16, or a head size phase 1 does not take), so there is
 * nothing to keep. */
int64_t kept_prefix_elems(int64_t n, int64_t kv_heads, int64_t dim) {
#if defined(__AVX512BF16__)
    if (dim % 32 == 0 && dim <= PREFIX_MAX_DIM) return kv_heads * panel_head_elems(n, dim);
#endif
    (void)n; (void)kv_heads; (void)dim;
    return 0;
}
