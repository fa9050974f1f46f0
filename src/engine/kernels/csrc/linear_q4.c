/* Linear layers over 4-bit weights for small batches (decode): AWQ / GPTQ checkpoints, repacked at load.
 *
 * x [M, K] float32, y [M, N] float32. The weight [N, K] holds unsigned 4-bit codes q in groups of G
 * consecutive inputs of a row (G a multiple of 32); each group has a scale s and an offset b = -zero * s,
 * so W[c, d] = q * s + b. A row is stored as K / 32 blocks of 16 bytes: byte j of a block holds input j of
 * the block in its low nibble and input j + 16 in its high one (layers/int4.py packs it), so one 16-byte
 * load and two masks give 32 codes in input order, widened to float32 in registers (never in memory). The
 * codes are summed against the activations per group and the group's scale applied once to that sum; the
 * offsets contribute offset * (the row's sum over the group), computed once per call. A decode step
 * streams half a byte per weight, a quarter of bf16. Sums are float32.
 *
 * Tiles, row blocks and threads as linear_q8.c: 4 rows x 2 output channels of float32 sums, each channel's
 * weights dequantized once per 4 rows; rows in blocks whose activations stay in L2; threads take
 * contiguous ranges of channel pairs. AVX2 + FMA where the compiler has them (Zen 1 and up), else a
 * portable loop computing the same products.
 */
#include "amx.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define Q4_AVX2 1
#endif

#define Q4_ROWS 4
#define Q4_BLOCK 32 /* inputs per 16-byte block */
#define Q4_L2_BYTES (256 * 1024)

typedef struct {
    const float *x;
    int64_t m, k;
    const uint8_t *w;
    const float *scale, *bias;
    int64_t group, n;
    float *out;
    const float *xsum; /* [m, k / group]: each row's sum over each group of inputs */
} q4_job_t;

static inline uint8_t q4_code(const uint8_t *row, int64_t d) {
    const uint8_t byte = row[(d / Q4_BLOCK) * (Q4_BLOCK / 2) + (d % Q4_BLOCK) % (Q4_BLOCK / 2)];
    return (d % Q4_BLOCK) < Q4_BLOCK / 2 ? (byte & 0xf) : (byte >> 4);
}

/* sums[r][c] = x[m0 + r] . W[c0 + c] for R rows and C (1 or 2) channels. */
static inline __attribute__((always_inline)) void q4_tile(const q4_job_t *J, int64_t m0, const int R, int64_t c0,
                                                          const int C, float sums[Q4_ROWS][2]) {
    const int64_t k = J->k, groups = k / J->group;
#if defined(Q4_AVX2)
    /* Per group, sum x * code (gacc), then fold in the group's scale once: x . W = sum over groups of
     * scale * (x . codes) + offset * (sum of x over the group), the second term from J->xsum. */
    __m256 acc[Q4_ROWS][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    const __m128i low4 = _mm_set1_epi8(0xf);
    for (int64_t g = 0; g < groups; g++) {
        __m256 gacc[Q4_ROWS][2];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) gacc[r][c] = _mm256_setzero_ps();
        for (int64_t d = g * J->group; d < (g + 1) * J->group; d += Q4_BLOCK) {
            __m128i codes[2][2]; /* [channel][low inputs 0-15, high inputs 16-31] */
            for (int c = 0; c < C; c++) {
                const __m128i bytes = _mm_loadu_si128((const __m128i *)(J->w + (c0 + c) * (k / 2) + d / 2));
                codes[c][0] = _mm_and_si128(bytes, low4);
                codes[c][1] = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
            }
            for (int part = 0; part < 4; part++) { /* inputs d + 8 * part ... + 7 */
                __m256 qv[2];
                for (int c = 0; c < C; c++) {
                    const __m128i half = codes[c][part / 2];
                    qv[c] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32((part % 2) ? _mm_srli_si128(half, 8) : half));
                }
                for (int r = 0; r < R; r++) {
                    const __m256 xv = _mm256_loadu_ps(J->x + (m0 + r) * k + d + 8 * part);
                    for (int c = 0; c < C; c++) gacc[r][c] = _mm256_fmadd_ps(xv, qv[c], gacc[r][c]);
                }
            }
        }
        for (int c = 0; c < C; c++) {
            const __m256 s = _mm256_set1_ps(J->scale[(c0 + c) * groups + g]);
            for (int r = 0; r < R; r++) acc[r][c] = _mm256_fmadd_ps(gacc[r][c], s, acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            const float v = hsum8(acc[r][c]);
            float offsets = 0.0f;
            for (int64_t g = 0; g < groups; g++) offsets += J->bias[(c0 + c) * groups + g] * J->xsum[(m0 + r) * groups + g];
            sums[r][c] = v + offsets;
        }
#else
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            const uint8_t *row = J->w + (c0 + c) * (k / 2);
            float sum = 0.0f;
            for (int64_t d = 0; d < k; d++) {
                const int64_t g = d / J->group;
                const float wf = (float)q4_code(row, d) * J->scale[(c0 + c) * groups + g] + J->bias[(c0 + c) * groups + g];
                sum += J->x[(m0 + r) * k + d] * wf;
            }
            sums[r][c] = sum;
        }
#endif
}

static void q4_part(void *arg, int tid, int nt) {
    const q4_job_t *J = (const q4_job_t *)arg;
    const int64_t pairs = (J->n + 1) / 2;
    int64_t first, last;
    pool_range(pairs, tid, nt, &first, &last);
    int64_t block = (Q4_L2_BYTES / (J->k * (int64_t)sizeof(float))) / Q4_ROWS * Q4_ROWS;
    if (block < Q4_ROWS) block = Q4_ROWS;
    for (int64_t b0 = 0; b0 < J->m; b0 += block)
    for (int64_t p = first; p < last; p++) {
        const int64_t c0 = 2 * p;
        const int C = c0 + 1 < J->n ? 2 : 1;
        const int64_t b1 = b0 + block < J->m ? b0 + block : J->m;
        for (int64_t m0 = b0; m0 < b1; m0 += Q4_ROWS) {
            const int64_t left = b1 - m0;
            float sums[Q4_ROWS][2];
            /* Constant R and C: each call unrolls into its own register tile. */
            if (left >= 4) { if (C == 2) q4_tile(J, m0, 4, c0, 2, sums); else q4_tile(J, m0, 4, c0, 1, sums); }
            else if (left == 3) { if (C == 2) q4_tile(J, m0, 3, c0, 2, sums); else q4_tile(J, m0, 3, c0, 1, sums); }
            else if (left == 2) { if (C == 2) q4_tile(J, m0, 2, c0, 2, sums); else q4_tile(J, m0, 2, c0, 1, sums); }
            else { if (C == 2) q4_tile(J, m0, 1, c0, 2, sums); else q4_tile(J, m0, 1, c0, 1, sums); }
            const int R = left >= Q4_ROWS ? Q4_ROWS : (int)left;
            for (int r = 0; r < R; r++)
                for (int c = 0; c < C; c++) J->out[(m0 + r) * J->n + c0 + c] = sums[r][c];
        }
    }
}

void linear_q4(const float *x, int64_t m, int64_t k, const uint8_t *w, const float *scale, const float *bias,
               int64_t group, int64_t n, float *out, int num_threads) {
    const int64_t groups = k / group;
    float *xsum = (float *)malloc((size_t)(m * groups) * sizeof(float));
    if (xsum == NULL) abort(); /* a few KiB per call: out of memory is not recoverable here */
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < groups; g++) {
            float sum = 0.0f;
            for (int64_t d = g * group; d < (g + 1) * group; d++) sum += x[r * k + d];
            xsum[r * groups + g] = sum;
        }
    q4_job_t job = {x, m, k, w, scale, bias, group, n, out, xsum};
    pool_run(q4_part, &job, num_threads);
    free(xsum);
}

/* ---------------------------------------------------------------------------------------- w4a8
 * linear_w4a8: the same weights against int8 activations (ENGINE_INT4_INT8_ACTIVATIONS, layers/int4.py), the
 * dynamic-int8-activation int4 scheme of torchao's da8w4 and llama.cpp's Q4 x Q8 products, with one activation
 * scale per row and weight group: q_x = round(x * 127 / max |x over the group|). Then
 *   x . W ~= sum over groups g of s_g * xs_g * (q_x . q)_g + b_g * (sum of x over g),
 * the integer sums exact in int32 (|sum| <= 15 * 127 * group), the offsets' term from the float activations as in
 * linear_q4. The codes are unsigned and q_x signed: the byte products take them as they are, no sign trick.
 * AVX512-VNNI: vpdpbusd on 64 inputs (two packed blocks: the low and high nibbles of 32 bytes, put in input
 * order by one lane shuffle) for groups that are a multiple of 64; for one row and multiples of 128 (AWQ's and GPTQ's
 * usual group), q_x is reordered once per call into the order the nibbles of 64 bytes hold (w4a8_nibble_order), and
 * each 64-byte load of codes feeds two vpdpbusd without a shuffle; AVX2: vpmaddubsw (pairs at most 2 * 15 *
 * 127, never saturated) and vpmaddwd on one block of 32 in input order; else a portable loop. Each group's
 * integer sum is scaled into float32 lanes, summed across lanes at the end: paths differ only in that order.
 * One row prefetches the next group of 4 channels' codes as it sums these (linear_w8a8's one-row pattern): on
 * the 2-core Xeon, one thread, 24 weights of 2816 x 1024 streamed from memory, 0.41 -> 0.23 ms a weight
 * (linear_w8a8: 0.28). */
typedef struct {
    const int8_t *xq; /* [m][k] q_x */
    const float *xs, *xsum; /* [m][groups] each group's activation scale, and its sum of x */
    int64_t m, k;
    const uint8_t *w;
    const float *scale, *bias;
    int64_t group, n;
    float *out;
    /* AMX: q_x packed as B tiles (amx_pack_rows), the activation scales and sums transposed ([groups][rows padded to
     * 16]), and per thread 64 channels' codes unpacked to bytes; NULL: the vector paths */
    const uint32_t *xt;
    const float *xs_t, *xsum_t;
    uint8_t *codes;
    int nibble_order; /* xq reordered by w4a8_nibble_order (VNNI, one row, groups of 128 and more) */
} w4a8_job_t;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define W4A8_VNNI 1
#endif

#if defined(W4A8_VNNI)
/* isum[r][c] += the byte products of group g's inputs, q_x in nibble order (w4a8_nibble_order): 128 inputs a
 * 64-byte load of codes, its low and high nibbles against two 64-input runs of q_x. */
static inline __attribute__((always_inline)) void w4a8_sums_128(const w4a8_job_t *J, int64_t m0, const int R,
                                                                int64_t c0, const int C, int64_t g, __m512i isum[2][4]) {
    const int64_t k = J->k;
    const __m512i low4 = _mm512_set1_epi8(0xf);
    for (int64_t d = g * J->group; d < (g + 1) * J->group; d += 128) {
        if (R == 1 && C == 4) { /* one row streams the codes: the next 4 channels', 4 lines a step */
            const uint8_t *next = J->w + (c0 + 4) * (k / 2) + 2 * d;
            if (next + 256 <= J->w + J->n * (k / 2))
                for (int line = 0; line < 4; line++) _mm_prefetch((const char *)next + 64 * line, _MM_HINT_T0);
        }
        __m512i lo[4], hi[4];
        for (int c = 0; c < C; c++) {
            const __m512i bytes = _mm512_loadu_si512((const void *)(J->w + (c0 + c) * (k / 2) + d / 2));
            lo[c] = _mm512_and_si512(bytes, low4);
            hi[c] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
        }
        for (int r = 0; r < R; r++) {
            const __m512i a_lo = _mm512_loadu_si512((const void *)(J->xq + (m0 + r) * k + d));
            const __m512i a_hi = _mm512_loadu_si512((const void *)(J->xq + (m0 + r) * k + d + 64));
            for (int c = 0; c < C; c++)
                isum[r][c] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(isum[r][c], lo[c], a_lo), hi[c], a_hi);
        }
    }
}

/* The same with q_x in input order: 64 inputs a step, the codes of 32 bytes put in input order by a lane shuffle. */
static inline __attribute__((always_inline)) void w4a8_sums_64(const w4a8_job_t *J, int64_t m0, const int R,
                                                               int64_t c0, const int C, int64_t g, __m512i isum[2][4]) {
    const int64_t k = J->k;
    const __m256i low4 = _mm256_set1_epi8(0xf);
    for (int64_t d = g * J->group; d < (g + 1) * J->group; d += 64) {
        if (R == 1 && C == 4) { /* one row streams the codes: the next group's, 2 lines a step (w8a8's) */
            const uint8_t *next = J->w + (c0 + 4) * (k / 2) + 2 * d;
            if (next + 128 <= J->w + J->n * (k / 2)) {
                _mm_prefetch((const char *)next, _MM_HINT_T0);
                _mm_prefetch((const char *)next + 64, _MM_HINT_T0);
            }
        }
        __m512i codes[4];
        for (int c = 0; c < C; c++) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(J->w + (c0 + c) * (k / 2) + d / 2));
            const __m256i lo = _mm256_and_si256(bytes, low4), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
            /* [inputs 0-15, 32-47, 16-31, 48-63] -> input order */
            codes[c] = _mm512_shuffle_i64x2(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1),
                                            _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), 0xd8);
        }
        for (int r = 0; r < R; r++) {
            const __m512i a = _mm512_loadu_si512((const void *)(J->xq + (m0 + r) * k + d));
            for (int c = 0; c < C; c++) isum[r][c] = _mm512_dpbusd_epi32(isum[r][c], codes[c], a);
        }
    }
}
#endif

/* sums[r][c] = x[m0 + r] . W[c0 + c] (the approximation above) for R rows and C channels (R * C <= 8). */
static inline __attribute__((always_inline)) void w4a8_tile(const w4a8_job_t *J, int64_t m0, const int R, int64_t c0,
                                                            const int C, float sums[2][4]) {
    const int64_t k = J->k, group = J->group, groups = k / group;
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) sums[r][c] = 0.0f;
#if defined(W4A8_VNNI)
    if (group % 64 == 0) {
        __m512 acc[2][4];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            __m512i isum[2][4];
            for (int r = 0; r < R; r++)
                for (int c = 0; c < C; c++) isum[r][c] = _mm512_setzero_si512();
            if (J->nibble_order) w4a8_sums_128(J, m0, R, c0, C, g, isum);
            else w4a8_sums_64(J, m0, R, c0, C, g, isum);
            for (int r = 0; r < R; r++)
                for (int c = 0; c < C; c++)
                    acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][c]),
                                                _mm512_set1_ps(J->scale[(c0 + c) * groups + g] * J->xs[(m0 + r) * groups + g]),
                                                acc[r][c]);
        }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) sums[r][c] = _mm512_reduce_add_ps(acc[r][c]);
    } else
#endif
    {
#if defined(__AVX2__)
        const __m128i low4 = _mm_set1_epi8(0xf);
        const __m256i ones = _mm256_set1_epi16(1);
        __m256 acc[2][4];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            __m256i isum[2][4];
            for (int r = 0; r < R; r++)
                for (int c = 0; c < C; c++) isum[r][c] = _mm256_setzero_si256();
            for (int64_t d = g * group; d < (g + 1) * group; d += Q4_BLOCK) {
                if (R == 1 && C == 4) { /* the next group's codes, one line a step */
                    const uint8_t *next = J->w + (c0 + 4) * (k / 2) + 2 * d;
                    if (next + 64 <= J->w + J->n * (k / 2)) _mm_prefetch((const char *)next, _MM_HINT_T0);
                }
                __m256i codes[4];
                for (int c = 0; c < C; c++) {
                    const __m128i bytes = _mm_loadu_si128((const __m128i *)(J->w + (c0 + c) * (k / 2) + d / 2));
                    codes[c] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4), _mm_and_si128(bytes, low4));
                }
                for (int r = 0; r < R; r++) {
                    const __m256i a = _mm256_loadu_si256((const __m256i *)(J->xq + (m0 + r) * k + d));
                    for (int c = 0; c < C; c++)
                        isum[r][c] = _mm256_add_epi32(isum[r][c], _mm256_madd_epi16(_mm256_maddubs_epi16(codes[c], a), ones));
                }
            }
            for (int r = 0; r < R; r++)
                for (int c = 0; c < C; c++)
                    acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][c]),
                                                _mm256_set1_ps(J->scale[(c0 + c) * groups + g] * J->xs[(m0 + r) * groups + g]),
                                                acc[r][c]);
        }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) sums[r][c] = hsum8(acc[r][c]);
#else
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) {
                const uint8_t *row = J->w + (c0 + c) * (k / 2);
                for (int64_t g = 0; g < groups; g++) {
                    int32_t isum = 0;
                    for (int64_t d = g * group; d < (g + 1) * group; d++)
                        isum += (int32_t)q4_code(row, d) * J->xq[(m0 + r) * k + d];
                    sums[r][c] += (float)isum * (J->scale[(c0 + c) * groups + g] * J->xs[(m0 + r) * groups + g]);
                }
            }
#endif
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float offsets = 0.0f;
            for (int64_t g = 0; g < groups; g++) offsets += J->bias[(c0 + c) * groups + g] * J->xsum[(m0 + r) * groups + g];
            sums[r][c] += offsets;
        }
}

#if defined(W4A8_VNNI)
/* q_x of each row reordered, every 128 inputs, as a 64-byte load of codes holds them: the low nibbles' inputs
 * (byte j: input 32 (j / 16) + j % 16), then the high nibbles' (32 (j / 16) + 16 + j % 16). */
static void w4a8_nibble_order(int8_t *xq, int64_t m, int64_t k) {
    int8_t chunk[128];
    for (int64_t at = 0; at < m * k; at += 128) {
        for (int j = 0; j < 64; j++) {
            chunk[j] = xq[at + (j / 16) * 32 + j % 16];
            chunk[64 + j] = xq[at + (j / 16) * 32 + 16 + j % 16];
        }
        memcpy(xq + at, chunk, sizeof(chunk));
    }
}
#endif

/* Groups [first, last) of 4 channels for every row, rows 2 at a time (the codes widened once per two rows). */
static void w4a8_groups(const w4a8_job_t *J, int64_t first, int64_t last) {
    for (int64_t p = first; p < last; p++) {
        const int64_t c0 = 4 * p;
        const int C = J->n - c0 >= 4 ? 4 : (int)(J->n - c0);
        for (int64_t m0 = 0; m0 < J->m; m0 += 2) {
            const int R = J->m - m0 >= 2 ? 2 : 1;
            float sums[2][4];
#define W4A8_TILE(rows, cols) w4a8_tile(J, m0, rows, c0, cols, sums)
            if (R == 2) { switch (C) { case 4: W4A8_TILE(2, 4); break; case 3: W4A8_TILE(2, 3); break; case 2: W4A8_TILE(2, 2); break; default: W4A8_TILE(2, 1); } }
            else { switch (C) { case 4: W4A8_TILE(1, 4); break; case 3: W4A8_TILE(1, 3); break; case 2: W4A8_TILE(1, 2); break; default: W4A8_TILE(1, 1); } }
#undef W4A8_TILE
            for (int r = 0; r < R; r++)
                for (int c = 0; c < C; c++) J->out[(m0 + r) * J->n + c0 + c] = sums[r][c];
        }
    }
}

/* Each thread a range of groups of 4 channels. */
static void w4a8_part(void *arg, int tid, int nt) {
    const w4a8_job_t *J = (const w4a8_job_t *)arg;
    int64_t first, last;
    pool_range((J->n + 3) / 4, tid, nt, &first, &last);
    w4a8_groups(J, first, last);
}

#if defined(HAVE_AMX) && defined(__AMX_INT8__)
/* AMX for 4 rows and more (groups and k multiples of 64): each thread unpacks a group of 64 channels' codes to bytes
 * in input order once, then tdpbusd multiplies them (unsigned, A tiles as they lie) by q_x (signed, B tiles) into
 * int32 C tiles, one weight group at a time: after each group the 4 C tiles (4 blocks of 16 channels by one block of
 * 16 rows) are scaled by the channels' scale and the rows' activation scale into float32 sums, as the vector paths
 * do lane by lane; the offsets' term is added at the end. out^T = W . q_x^T as in linear_w8a8.c. */
#define W4A8_AMX 1
#define W4A8_AMX_MIN_ROWS 4

/* Channel c's k codes (linear_q4's packed layout) as bytes in input order. */
static void w4a8_unpack_row(const uint8_t *packed, int64_t k, uint8_t *to) {
    const __m128i low4 = _mm_set1_epi8(0xf);
    for (int64_t d = 0; d < k; d += Q4_BLOCK) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(packed + d / 2));
        _mm_storeu_si128((__m128i *)(to + d), _mm_and_si128(bytes, low4));
        _mm_storeu_si128((__m128i *)(to + d + 16), _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
    }
}

static void w4a8_amx_part(void *arg, int tid, int nt) {
    const w4a8_job_t *J = (const w4a8_job_t *)arg;
    const int64_t k = J->k, group = J->group, groups = k / group, blocks = J->n / 16;
    const int64_t row_blocks = (J->m + AMX_ROWS - 1) / AMX_ROWS, padded = row_blocks * AMX_ROWS;
    int32_t sums[4][256] __attribute__((aligned(64)));
    float acc[4][256] __attribute__((aligned(64))); /* [block][channel * 16 + row] */
    int64_t first, last;
    pool_range((blocks + 3) / 4, tid, nt, &first, &last);
    uint8_t *codes = J->codes + tid * 64 * k;
    if (first < last) {
        amx_configure(AMX_ROWS);
        for (int64_t g4 = first; g4 < last; g4++) {
            const int64_t cb = 4 * g4, count = blocks - cb < 4 ? blocks - cb : 4;
            for (int64_t c = 0; c < 16 * count; c++) w4a8_unpack_row(J->w + (cb * 16 + c) * (k / 2), k, codes + c * k);
            for (int64_t rb = 0; rb < row_blocks; rb++) {
                memset(acc, 0, sizeof acc);
                const uint32_t *b = J->xt + rb * AMX_ROWS * (k / 4);
                for (int64_t g = 0; g < groups; g++) {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int64_t d = g * group; d < (g + 1) * group; d += 64) {
                        _tile_loadd(6, b + d / 4 * AMX_ROWS, 64);
                        _tile_loadd(4, codes + d, k);
                        _tile_dpbusd(0, 4, 6);
                        if (count < 2) continue;
                        _tile_loadd(5, codes + 16 * k + d, k);
                        _tile_dpbusd(1, 5, 6);
                        if (count < 3) continue;
                        _tile_loadd(4, codes + 32 * k + d, k);
                        _tile_dpbusd(2, 4, 6);
                        if (count < 4) continue;
                        _tile_loadd(5, codes + 48 * k + d, k);
                        _tile_dpbusd(3, 5, 6);
                    }
                    _tile_stored(0, sums[0], 64);
                    _tile_stored(1, sums[1], 64);
                    _tile_stored(2, sums[2], 64);
                    _tile_stored(3, sums[3], 64);
                    const __m512 xs = _mm512_loadu_ps(J->xs_t + g * padded + rb * AMX_ROWS);
                    for (int64_t i = 0; i < count; i++)
                        for (int ch = 0; ch < 16; ch++) {
                            const float s = J->scale[(cb * 16 + i * 16 + ch) * groups + g];
                            const __m512 v = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(sums[i] + ch * 16)));
                            _mm512_store_ps(acc[i] + ch * 16, _mm512_fmadd_ps(v, _mm512_mul_ps(xs, _mm512_set1_ps(s)),
                                                                               _mm512_load_ps(acc[i] + ch * 16)));
                        }
                }
                const int64_t rows = J->m - rb * AMX_ROWS < AMX_ROWS ? J->m - rb * AMX_ROWS : AMX_ROWS;
                for (int64_t i = 0; i < count; i++) {
                    for (int ch = 0; ch < 16; ch++) { /* + the offsets' term, row by row in the lanes */
                        const int64_t c = cb * 16 + i * 16 + ch;
                        __m512 offsets = _mm512_setzero_ps();
                        for (int64_t g = 0; g < groups; g++)
                            offsets = _mm512_fmadd_ps(_mm512_set1_ps(J->bias[c * groups + g]),
                                                      _mm512_loadu_ps(J->xsum_t + g * padded + rb * AMX_ROWS), offsets);
                        _mm512_store_ps(acc[i] + ch * 16, _mm512_add_ps(_mm512_load_ps(acc[i] + ch * 16), offsets));
                    }
                    for (int64_t t = 0; t < rows; t++)
                        _mm512_storeu_ps(J->out + (rb * AMX_ROWS + t) * J->n + (cb + i) * 16, amx_row_ps(acc[i], t));
                }
            }
        }
        _tile_release();
    }
    if (tid == nt - 1 && blocks * 16 < J->n) w4a8_groups(J, blocks * 4, (J->n + 3) / 4);
}
#endif

int linear_w4a8(const float *x, int64_t m, int64_t k, const uint8_t *w, const float *scale, const float *bias,
                int64_t group, int64_t n, float *out, int num_threads) {
    const int64_t groups = k / group;
    float *xs = (float *)malloc((size_t)(2 * m * groups) * sizeof(float));
    int8_t *xq = (int8_t *)malloc((size_t)(m * k));
    if (xs == NULL || xq == NULL) {
        free(xs);
        free(xq);
        return -1;
    }
    float *xsum = xs + m * groups;
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < groups; g++) {
            const float *from = x + r * k + g * group;
            xs[r * groups + g] = quantize_int8_row(from, group, group, xq + r * k + g * group, NULL);
            float sum = 0.0f;
            for (int64_t d = 0; d < group; d++) sum += from[d];
            xsum[r * groups + g] = sum;
        }
    w4a8_job_t job = {xq, xs, xsum, m, k, w, scale, bias, group, n, out, NULL, NULL, NULL, NULL, 0};
#if defined(W4A8_AMX)
    if (amx_active() && m >= W4A8_AMX_MIN_ROWS && group % 64 == 0 && n >= 16) {
        const int64_t padded = (m + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
        uint32_t *xt = (uint32_t *)aligned_alloc(64, (size_t)(padded * k));
        float *t = (float *)calloc((size_t)(2 * groups * padded), sizeof(float));
        uint8_t *codes = (uint8_t *)aligned_alloc(64, (size_t)(num_threads * 64 * k));
        if (xt != NULL && t != NULL && codes != NULL) {
            amx_pack_rows(xq, k, m, k / 4, xt);
            for (int64_t r = 0; r < m; r++)
                for (int64_t g = 0; g < groups; g++) {
                    t[g * padded + r] = xs[r * groups + g];
                    t[(groups + g) * padded + r] = xsum[r * groups + g];
                }
            job.xt = xt;
            job.xs_t = t;
            job.xsum_t = t + groups * padded;
            job.codes = codes;
            pool_run(w4a8_amx_part, &job, num_threads);
        }
        free(xt);
        free(t);
        free(codes);
    }
    if (job.xt == NULL)
#endif
    {
#if defined(W4A8_VNNI)
        if (group % 128 == 0 && m == 1) { /* two rows keep the shuffle: 8 nibble registers spill there (0.91x) */
            w4a8_nibble_order(xq, m, k);
            job.nibble_order = 1;
        }
#endif
        pool_run(w4a8_part, &job, num_threads);
    }
    free(xs);
    free(xq);
    return 0;
}
