/* Linear layers over MXFP4 weights (gpt-oss's experts), read as the checkpoint holds them.
 *
 * x [M, K] float32, y [M, N] float32 (+ bias [N] float32 where given). A weight row (one output channel)
 * is K / 32 blocks of 32 inputs: 16 bytes of 4-bit e2m1 codes (input 2j in the low nibble of byte j,
 * input 2j + 1 in its high one) and one e8m0 byte s, the block's scale 2^(s - 127). Every e2m1 value is
 * a float16 whose low byte is zero, so with AVX2 one byte shuffle (pshufb) over a 16-entry table gives 16
 * codes' high bytes at once (the low nibbles of a block, then its high ones, against a copy of the
 * activations reordered alike), an interleave with zeros makes them float16 and F16C widens 8 of them to
 * float32, in registers, never stored; the block's scale (a power of two: exact) multiplies the decoded
 * weights (several rows) or the block's sum (one row). Each weight equals dequantize_mxfp4's exactly;
 * only the order of the float32 sums differs from a dequantized float matmul. A decode step streams
 * 4.25 bits per weight.
 *
 * Tiles, row blocks and threads as linear_q4.c: 4 rows x 2 output channels of float32 sums, each
 * channel's block decoded once per 4 rows; rows in blocks whose activations stay in L2; threads take
 * contiguous ranges of channel pairs. AVX2 + FMA + F16C where the compiler has them (Zen 1 and up), else a
 * portable loop computing the same products.
 */
#include <string.h>

#include "cpu_common.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define MXFP4_AVX2 1
#endif

#define MXFP4_ROWS 4
#define MXFP4_BLOCK 32 /* inputs per block: 16 bytes of codes and one scale byte */
#define MXFP4_L2_BYTES (256 * 1024)


typedef struct {
    const float *x;
    int64_t m, k;
    const uint8_t *blocks, *scales;
    const float *bias;
    int64_t n;
    float *out;
} mxfp4_job_t;

/* 2^(s - 127), as ldexp computes it: s in the float's exponent field; s = 0 is the subnormal 2^-127 (only
 * the mantissa's top bit), s = 255 the exponent of infinity. */
static inline float mxfp4_scale(uint8_t s) {
    const uint32_t bits = s != 0 ? (uint32_t)s << 23 : 0x00400000u;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* sums[r][c] = x[m0 + r] . W[c0 + c] for R rows and C (1 or 2) channels. */
static inline __attribute__((always_inline)) void mxfp4_tile(const mxfp4_job_t *J, int64_t m0, const int R, int64_t c0,
                                                             const int C, float sums[MXFP4_ROWS][2]) {
    const int64_t k = J->k, groups = k / MXFP4_BLOCK;
#if defined(MXFP4_AVX2)
    /* A single row (decode) sums each block unscaled (gacc) and applies the scale once per block; several
     * rows share each decoded weight, scaled once, and keep one sum per (row, channel): the registers hold
     * either, not both. */
    __m256 acc[MXFP4_ROWS][2], gacc[2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    const __m128i low4 = _mm_set1_epi8(0xf);
    const __m128i zero = _mm_setzero_si128();
    const __m128i high_bytes = _mm_setr_epi8(0x00, 0x38, 0x3c, 0x3e, 0x40, 0x42, 0x44, 0x46, (char)0x80, (char)0xb8,
                                             (char)0xbc, (char)0xbe, (char)0xc0, (char)0xc2, (char)0xc4, (char)0xc6);
    for (int64_t g = 0; g < groups; g++) {
        __m128i halves[2][4]; /* [channel][inputs 8 * part ... + 7]: float16 weights, in input order */
        __m256 scale[2];
        for (int c = 0; c < C; c++) {
            const int64_t block = (c0 + c) * groups + g;
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(J->blocks + block * (MXFP4_BLOCK / 2)));
            const __m128i lo = _mm_and_si128(bytes, low4);
            const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
            /* The activations were reordered (linear_mxfp4): the low nibbles meet the even inputs. */
            const __m128i first = _mm_shuffle_epi8(high_bytes, lo);  /* inputs 0, 2, ..., 30 */
            const __m128i second = _mm_shuffle_epi8(high_bytes, hi); /* inputs 1, 3, ..., 31 */
            halves[c][0] = _mm_unpacklo_epi8(zero, first);
            halves[c][1] = _mm_unpackhi_epi8(zero, first);
            halves[c][2] = _mm_unpacklo_epi8(zero, second);
            halves[c][3] = _mm_unpackhi_epi8(zero, second);
            scale[c] = _mm256_set1_ps(mxfp4_scale(J->scales[block]));
            if (R == 1) gacc[c] = _mm256_setzero_ps();
        }
        for (int part = 0; part < 4; part++) { /* inputs 8 * part ... + 7 of the block */
            __m256 wv[2];
            for (int c = 0; c < C; c++) {
                wv[c] = _mm256_cvtph_ps(halves[c][part]);
                if (R > 1) wv[c] = _mm256_mul_ps(wv[c], scale[c]);
            }
            for (int r = 0; r < R; r++) {
                const __m256 xv = _mm256_loadu_ps(J->x + (m0 + r) * k + g * MXFP4_BLOCK + 8 * part);
                for (int c = 0; c < C; c++) {
                    if (R == 1) gacc[c] = _mm256_fmadd_ps(xv, wv[c], gacc[c]);
                    else acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
                }
            }
        }
        if (R == 1)
            for (int c = 0; c < C; c++) acc[0][c] = _mm256_fmadd_ps(gacc[c], scale[c], acc[0][c]);
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) sums[r][c] = hsum8(acc[r][c]);
#else
    /* The e2m1 magnitudes by a code's low three bits (its high bit is the sign). */
    static const float mxfp4_magnitudes[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float sum = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                const int64_t block = (c0 + c) * groups + g;
                const uint8_t *bytes = J->blocks + block * (MXFP4_BLOCK / 2);
                const float scale = mxfp4_scale(J->scales[block]);
                for (int i = 0; i < MXFP4_BLOCK; i++) {
                    const uint8_t code = (i % 2) ? (bytes[i / 2] >> 4) : (bytes[i / 2] & 0xf);
                    const float w = (code & 8 ? -mxfp4_magnitudes[code & 7] : mxfp4_magnitudes[code & 7]) * scale;
                    sum += J->x[(m0 + r) * k + g * MXFP4_BLOCK + i] * w;
                }
            }
            sums[r][c] = sum;
        }
#endif
}

static void mxfp4_part(void *arg, int tid, int nt) {
    const mxfp4_job_t *J = (const mxfp4_job_t *)arg;
    const int64_t pairs = (J->n + 1) / 2;
    int64_t first, last;
    pool_range(pairs, tid, nt, &first, &last);
    int64_t block = (MXFP4_L2_BYTES / (J->k * (int64_t)sizeof(float))) / MXFP4_ROWS * MXFP4_ROWS;
    if (block < MXFP4_ROWS) block = MXFP4_ROWS;
    for (int64_t b0 = 0; b0 < J->m; b0 += block)
    for (int64_t p = first; p < last; p++) {
        const int64_t c0 = 2 * p;
        const int C = c0 + 1 < J->n ? 2 : 1;
        const int64_t b1 = b0 + block < J->m ? b0 + block : J->m;
        for (int64_t m0 = b0; m0 < b1; m0 += MXFP4_ROWS) {
            const int64_t left = b1 - m0;
            float sums[MXFP4_ROWS][2];
            /* Constant R and C: each call unrolls into its own register tile. */
            if (left >= 4) { if (C == 2) mxfp4_tile(J, m0, 4, c0, 2, sums); else mxfp4_tile(J, m0, 4, c0, 1, sums); }
            else if (left == 3) { if (C == 2) mxfp4_tile(J, m0, 3, c0, 2, sums); else mxfp4_tile(J, m0, 3, c0, 1, sums); }
            else if (left == 2) { if (C == 2) mxfp4_tile(J, m0, 2, c0, 2, sums); else mxfp4_tile(J, m0, 2, c0, 1, sums); }
            else { if (C == 2) mxfp4_tile(J, m0, 1, c0, 2, sums); else mxfp4_tile(J, m0, 1, c0, 1, sums); }
            const int R = left >= MXFP4_ROWS ? MXFP4_ROWS : (int)left;
            for (int r = 0; r < R; r++)
                for (int c = 0; c < C; c++)
                    J->out[(m0 + r) * J->n + c0 + c] = sums[r][c] + (J->bias != NULL ? J->bias[c0 + c] : 0.0f);
        }
    }
}

int linear_mxfp4(const float *x, int64_t m, int64_t k, const uint8_t *blocks, const uint8_t *scales,
                 const float *bias, int64_t n, float *out, int num_threads) {
    if (k <= 0 || k % MXFP4_BLOCK != 0 || n <= 0 || m < 0) return -2;
#if defined(MXFP4_AVX2)
    /* Each block's activations reordered, even inputs then odd ones, as the nibbles are (a copy of x). */
    float *split = (float *)malloc((size_t)(m * k) * sizeof(float) + 1);
    if (split == NULL) return -1;
    for (int64_t i = 0; i < m * k; i += MXFP4_BLOCK)
        for (int j = 0; j < MXFP4_BLOCK / 2; j++) {
            split[i + j] = x[i + 2 * j];
            split[i + MXFP4_BLOCK / 2 + j] = x[i + 2 * j + 1];
        }
    mxfp4_job_t job = {split, m, k, blocks, scales, bias, n, out};
    pool_run(mxfp4_part, &job, num_threads);
    free(split);
#else
    mxfp4_job_t job = {x, m, k, blocks, scales, bias, n, out};
    pool_run(mxfp4_part, &job, num_threads);
#endif
    return 0;
}
