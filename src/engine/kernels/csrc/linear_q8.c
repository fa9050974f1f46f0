/* Linear layers over 8-bit weights for small batches (decode): y = (x W^T) * scale, per output channel.
 *
 * x [M, K] float32, W [N, K] int8 (--quantization w8a8_int8) or float8 e4m3 (fp8), scale [N] float32,
 * y [M, N] float32. A decode step reads every weight once, so its time is the weight bytes over the
 * memory bandwidth: these kernels stream one byte per weight (half of bf16's) and widen each weight to
 * float32 in registers, never in memory. Sums are float32; the scale is applied once per output.
 *
 * e4m3 to float32 without a table: moving the byte's exponent and mantissa bits (without the sign) 7
 * places up gives the float16 with the same mantissa and exponent field, worth the e4m3 value / 2^8
 * (the exponent biases are 15 and 7), subnormals included; the sign goes to bit 15. F16C widens that
 * half to float32, and the 2^8 is folded into the scale. e4m3fn's NaN (0x7f) never occurs in weights
 * quantized into its range.
 *
 * Tiles: 4 rows x 2 output channels of float32 sums (8 registers), each channel's 8 weights widened
 * once per row tile; rows in blocks of 256 KiB of activations, each block a pass over the weights. Threads (thread_pool.c) take contiguous ranges of channel pairs. AVX2 + FMA + F16C
 * where the compiler has them (Zen 1 and up), else a portable loop with the same sums in another order.
 */
#include "cpu_common.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define Q8_AVX2 1
#endif

#define Q8_ROWS 4
#define Q8_L2_BYTES (256 * 1024) /* half of Zen 1's L2 per core: room for the weights and the output */
#define FP8_SCALE 256.0f /* the e4m3 -> float16 reinterpretation's 2^-8, undone */

static inline float fp8_e4m3_to_f32(uint8_t b) {
    const int exp = (b >> 3) & 0xf, man = b & 7;
    const float mag = exp == 0 ? ldexpf((float)man / 8.0f, -6) : ldexpf(1.0f + (float)man / 8.0f, exp - 7);
    return (b & 0x80) ? -mag : mag;
}

typedef struct {
    const float *x;
    int64_t m, k;
    const void *w;
    int w_fp8;
    const float *scale;
    int64_t n;
    float *out;
} q8_job_t;

#if defined(Q8_AVX2)
/* 8 consecutive weights of one channel as float32 (e4m3: still / 2^8). */
static inline __attribute__((always_inline)) __m256 widen8(const uint8_t *p, const int fp8) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)p);
    if (!fp8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    const __m128i h = _mm_cvtepu8_epi16(bytes);
    const __m128i half = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7f)), 7),
                                      _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x80)), 8));
    return _mm256_cvtph_ps(half);
}

static inline __attribute__((always_inline)) float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* sums[r][c] = x[m0 + r] . W[c0 + c] for R rows and C (1 or 2) channels, unscaled. */
static inline __attribute__((always_inline)) void q8_tile(const q8_job_t *J, int64_t m0, const int R, int64_t c0,
                                                          const int C, float sums[Q8_ROWS][2]) {
    const int64_t k = J->k;
    const uint8_t *w = (const uint8_t *)J->w;
    int64_t d = 0;
#if defined(Q8_AVX2)
    __m256 acc[Q8_ROWS][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (; d + 8 <= k; d += 8) {
        __m256 wv[2];
        for (int c = 0; c < C; c++) wv[c] = widen8(w + (c0 + c) * k + d, J->w_fp8);
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_loadu_ps(J->x + (m0 + r) * k + d);
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) sums[r][c] = hsum(acc[r][c]);
#else
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) sums[r][c] = 0.0f;
#endif
    for (; d < k; d++)
        for (int c = 0; c < C; c++) {
            const uint8_t b = w[(c0 + c) * k + d];
            const float wf = J->w_fp8 ? fp8_e4m3_to_f32(b) / FP8_SCALE : (float)(int8_t)b;
            for (int r = 0; r < R; r++) sums[r][c] += J->x[(m0 + r) * k + d] * wf;
        }
}

static void q8_part(void *arg, int tid, int nt) {
    const q8_job_t *J = (const q8_job_t *)arg;
    const int64_t pairs = (J->n + 1) / 2;
    /* e4m3 sums are 2^-8 of the value, in the vector loop and (to match it) the scalar tail alike. */
    const float unit = J->w_fp8 ? FP8_SCALE : 1.0f;
    int64_t first, last;
    pool_range(pairs, tid, nt, &first, &last);
    /* Rows in blocks whose float32 activations stay in L2 while the thread's channels pass over them
     * (a channel pair's weights stay in L1 over a block): the weights are read once per block. */
    int64_t block = (Q8_L2_BYTES / (J->k * (int64_t)sizeof(float))) / Q8_ROWS * Q8_ROWS;
    if (block < Q8_ROWS) block = Q8_ROWS;
    for (int64_t b0 = 0; b0 < J->m; b0 += block)
    for (int64_t p = first; p < last; p++) {
        const int64_t c0 = 2 * p;
        const int C = c0 + 1 < J->n ? 2 : 1;
        const int64_t b1 = b0 + block < J->m ? b0 + block : J->m;
        for (int64_t m0 = b0; m0 < b1; m0 += Q8_ROWS) {
            const int64_t left = b1 - m0;
            float sums[Q8_ROWS][2];
            /* Constant R and C: each call unrolls into its own register tile. */
            if (left >= 4) { if (C == 2) q8_tile(J, m0, 4, c0, 2, sums); else q8_tile(J, m0, 4, c0, 1, sums); }
            else if (left == 3) { if (C == 2) q8_tile(J, m0, 3, c0, 2, sums); else q8_tile(J, m0, 3, c0, 1, sums); }
            else if (left == 2) { if (C == 2) q8_tile(J, m0, 2, c0, 2, sums); else q8_tile(J, m0, 2, c0, 1, sums); }
            else { if (C == 2) q8_tile(J, m0, 1, c0, 2, sums); else q8_tile(J, m0, 1, c0, 1, sums); }
            const int R = left >= Q8_ROWS ? Q8_ROWS : (int)left;
            for (int r = 0; r < R; r++)
                for (int c = 0; c < C; c++) J->out[(m0 + r) * J->n + c0 + c] = sums[r][c] * unit * J->scale[c0 + c];
        }
    }
}

void linear_q8(const float *x, int64_t m, int64_t k, const void *w, int w_fp8, const float *scale, int64_t n,
               float *out, int num_threads) {
    q8_job_t job = {x, m, k, w, w_fp8, scale, n, out};
    pool_run(q8_part, &job, num_threads);
}
