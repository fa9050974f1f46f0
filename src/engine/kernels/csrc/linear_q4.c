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
 *
 * Its own layout (layers/int4.py packs it): the channels in blocks of 16 (n padded to a multiple of 16 with zero
 * codes, scales and offsets), a block's codes k / 8 steps of 64 bytes, the 4 bytes of lane c of step j holding
 * channel c's inputs 8j + i in the low nibble of byte i and 8j + 4 + i in the high one; scales and offsets
 * [blocks][groups][16]. A 64-byte load is 16 channels x 8 inputs: with AVX512-VNNI, vpdpbusd multiplies its low
 * nibbles by 4 broadcast activations into the 16 channels' int32 lanes and its high nibbles (masked in place, 16
 * times the code, the sum shifted back once per group) by the next 4; each group then takes one scale vector per
 * block. No horizontal sums and no per-channel scalar work: from L2, one row, 2x linear_q4's per-channel layout.
 * AVX2: the same steps as two halves of 8 channels, vpmaddubsw (pairs at most 2 * 15 * 127, never saturated) and
 * vpmaddwd; else a portable loop. AMX-INT8 from 8 rows: each thread unpacks 64 channels' codes to bytes in input
 * order once (16 steps at a time by a 16 x 16 transpose of dwords), then tdpbusd. Each group's integer sum is
 * scaled into float32 lanes: the paths differ only in the order of the float sums. */
typedef struct {
    const int8_t *xq; /* [m][k] q_x */
    const float *xs, *xsum; /* [m][groups] each group's activation scale, and its sum of x */
    int64_t m, k;
    const uint8_t *w;
    const float *scale, *bias; /* [blocks][groups][16] */
    int64_t group, n;
    float *out;
    /* AMX: q_x packed as B tiles (amx_pack_rows), the activation scales and sums transposed ([groups][rows padded to
     * 16]), and per thread 64 channels' codes unpacked to bytes; NULL: the vector paths */
    const uint32_t *xt;
    const float *xs_t, *xsum_t;
    uint8_t *codes;
} w4a8_job_t;

#define W4A8_LANES 16 /* channels of a block */
#define W4A8_STEP 8   /* inputs of a 64-byte step */

/* The first byte of block b's step j (a block is 16 channels x k / 2 bytes). */
static inline const uint8_t *w4a8_step(const w4a8_job_t *J, int64_t b, int64_t j) {
    return J->w + b * (W4A8_LANES / 2) * J->k + j * 64;
}

static inline int32_t w4a8_load4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define W4A8_VNNI 1
/* out rows m0 .. m0 + R, blocks b0 .. b0 + NB (R * NB <= 4): the weights' 64 bytes loaded once for R rows. */
static inline __attribute__((always_inline)) void w4a8_tile(const w4a8_job_t *J, int64_t m0, const int R, int64_t b0,
                                                            const int NB) {
    const int64_t k = J->k, group = J->group, groups = k / group;
    const __m512i low = _mm512_set1_epi8(0x0f), high = _mm512_set1_epi8((char)0xf0);
    __m512 acc[4];
    for (int i = 0; i < R * NB; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i lo[4], hi[4];
        for (int i = 0; i < R * NB; i++) lo[i] = hi[i] = _mm512_setzero_si512();
        for (int64_t d = g * group; d < (g + 1) * group; d += W4A8_STEP) {
            __m512i cl[4], ch[4];
            for (int b = 0; b < NB; b++) {
                const __m512i bytes = _mm512_loadu_si512((const void *)w4a8_step(J, b0 + b, d / W4A8_STEP));
                cl[b] = _mm512_and_si512(bytes, low);
                ch[b] = _mm512_and_si512(bytes, high);
            }
            for (int r = 0; r < R; r++) {
                const __m512i a_lo = _mm512_set1_epi32(w4a8_load4(J->xq + (m0 + r) * k + d));
                const __m512i a_hi = _mm512_set1_epi32(w4a8_load4(J->xq + (m0 + r) * k + d + 4));
                for (int b = 0; b < NB; b++) {
                    lo[r * NB + b] = _mm512_dpbusd_epi32(lo[r * NB + b], cl[b], a_lo);
                    hi[r * NB + b] = _mm512_dpbusd_epi32(hi[r * NB + b], ch[b], a_hi);
                }
            }
        }
        for (int r = 0; r < R; r++) {
            const __m512 xs = _mm512_set1_ps(J->xs[(m0 + r) * groups + g]);
            const __m512 xsum = _mm512_set1_ps(J->xsum[(m0 + r) * groups + g]);
            for (int b = 0; b < NB; b++) {
                const int i = r * NB + b;
                const __m512i sums = _mm512_add_epi32(lo[i], _mm512_srai_epi32(hi[i], 4)); /* hi: 16 x the codes */
                const float *at = J->scale + ((b0 + b) * groups + g) * W4A8_LANES;
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(_mm512_loadu_ps(at), xs), acc[i]);
                acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(J->bias + ((b0 + b) * groups + g) * W4A8_LANES), xsum, acc[i]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) {
            const int64_t c = (b0 + b) * W4A8_LANES, left = J->n - c;
            const __mmask16 keep = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
            _mm512_mask_storeu_ps(J->out + (m0 + r) * J->n + c, keep, acc[r * NB + b]);
        }
}

/* Tiles of blocks [first, last) of width NB: one row 4 blocks a tile, two rows 2, more 1 block by up to 4 rows. */
static void w4a8_blocks(const w4a8_job_t *J, int64_t first, int64_t last, int width) {
    const int64_t blocks = (J->n + W4A8_LANES - 1) / W4A8_LANES;
    for (int64_t b0 = first * width; b0 < last * width; b0 += width) {
        const int nb = blocks - b0 < width ? (int)(blocks - b0) : width;
        if (width == 4)
            switch (nb) {
            case 4: w4a8_tile(J, 0, 1, b0, 4); break;
            case 3: w4a8_tile(J, 0, 1, b0, 3); break;
            case 2: w4a8_tile(J, 0, 1, b0, 2); break;
            default: w4a8_tile(J, 0, 1, b0, 1);
            }
        else if (width == 2) { if (nb == 2) w4a8_tile(J, 0, 2, b0, 2); else w4a8_tile(J, 0, 2, b0, 1); }
        else
            for (int64_t m0 = 0; m0 < J->m; m0 += 4)
                switch (J->m - m0 >= 4 ? 4 : (int)(J->m - m0)) {
                case 4: w4a8_tile(J, m0, 4, b0, 1); break;
                case 3: w4a8_tile(J, m0, 3, b0, 1); break;
                case 2: w4a8_tile(J, m0, 2, b0, 1); break;
                default: w4a8_tile(J, m0, 1, b0, 1);
                }
    }
}

static void w4a8_part(void *arg, int tid, int nt) {
    const w4a8_job_t *J = (const w4a8_job_t *)arg;
    const int width = J->m == 1 ? 4 : J->m == 2 ? 2 : 1;
    const int64_t blocks = (J->n + W4A8_LANES - 1) / W4A8_LANES;
    int64_t first, last;
    pool_range((blocks + width - 1) / width, tid, nt, &first, &last);
    w4a8_blocks(J, first, last, width);
}
#elif defined(__AVX2__)
/* out rows m0 .. m0 + R (R <= 2), block b: each 64-byte step as two halves of 8 channels. */
static inline __attribute__((always_inline)) void w4a8_tile2(const w4a8_job_t *J, int64_t m0, const int R, int64_t b) {
    const int64_t k = J->k, group = J->group, groups = k / group;
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256 acc[2][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256i sums[2][2];
        for (int r = 0; r < R; r++) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
        for (int64_t d = g * group; d < (g + 1) * group; d += W4A8_STEP) {
            const uint8_t *step = w4a8_step(J, b, d / W4A8_STEP);
            __m256i cl[2], ch[2];
            for (int h = 0; h < 2; h++) {
                const __m256i bytes = _mm256_loadu_si256((const __m256i *)(step + 32 * h));
                cl[h] = _mm256_and_si256(bytes, low);
                ch[h] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
            }
            for (int r = 0; r < R; r++) {
                const __m256i a_lo = _mm256_set1_epi32(w4a8_load4(J->xq + (m0 + r) * k + d));
                const __m256i a_hi = _mm256_set1_epi32(w4a8_load4(J->xq + (m0 + r) * k + d + 4));
                for (int h = 0; h < 2; h++) {
                    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(cl[h], a_lo),
                                                           _mm256_maddubs_epi16(ch[h], a_hi));
                    sums[r][h] = _mm256_add_epi32(sums[r][h], _mm256_madd_epi16(pairs, ones));
                }
            }
        }
        for (int r = 0; r < R; r++) {
            const __m256 xs = _mm256_set1_ps(J->xs[(m0 + r) * groups + g]);
            const __m256 xsum = _mm256_set1_ps(J->xsum[(m0 + r) * groups + g]);
            for (int h = 0; h < 2; h++) {
                const int64_t at = (b * groups + g) * W4A8_LANES + 8 * h;
                const __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(J->scale + at), xs);
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][h]), scaled, acc[r][h]);
                acc[r][h] = _mm256_fmadd_ps(_mm256_loadu_ps(J->bias + at), xsum, acc[r][h]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        float lanes[16];
        _mm256_storeu_ps(lanes, acc[r][0]);
        _mm256_storeu_ps(lanes + 8, acc[r][1]);
        const int64_t c = b * W4A8_LANES, count = J->n - c < 16 ? J->n - c : 16;
        memcpy(J->out + (m0 + r) * J->n + c, lanes, (size_t)count * sizeof(float));
    }
}

static void w4a8_part(void *arg, int tid, int nt) {
    const w4a8_job_t *J = (const w4a8_job_t *)arg;
    int64_t first, last;
    pool_range((J->n + W4A8_LANES - 1) / W4A8_LANES, tid, nt, &first, &last);
    for (int64_t b = first; b < last; b++)
        for (int64_t m0 = 0; m0 < J->m; m0 += 2) {
            if (J->m - m0 >= 2) w4a8_tile2(J, m0, 2, b);
            else w4a8_tile2(J, m0, 1, b);
        }
}
#else
/* Channel c's code of input d in the layout above. */
static inline int32_t w4a8_code(const w4a8_job_t *J, int64_t c, int64_t d) {
    const uint8_t byte = w4a8_step(J, c / W4A8_LANES, d / W4A8_STEP)[(c % W4A8_LANES) * 4 + d % 4];
    return (d % W4A8_STEP) < 4 ? (byte & 0xf) : (byte >> 4);
}

static void w4a8_part(void *arg, int tid, int nt) {
    const w4a8_job_t *J = (const w4a8_job_t *)arg;
    const int64_t k = J->k, group = J->group, groups = k / group;
    int64_t first, last;
    pool_range(J->n, tid, nt, &first, &last);
    for (int64_t r = 0; r < J->m; r++)
        for (int64_t c = first; c < last; c++) {
            const int64_t at = (c / W4A8_LANES) * groups * W4A8_LANES + c % W4A8_LANES;
            float sum = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                int32_t isum = 0;
                for (int64_t d = g * group; d < (g + 1) * group; d++) isum += w4a8_code(J, c, d) * J->xq[r * k + d];
                sum += (float)isum * (J->scale[at + g * W4A8_LANES] * J->xs[r * groups + g]);
                sum += J->bias[at + g * W4A8_LANES] * J->xsum[r * groups + g];
            }
            J->out[r * J->n + c] = sum;
        }
}
#endif

#if defined(HAVE_AMX) && defined(__AMX_INT8__)
#define W4A8_AMX 1
#define W4A8_AMX_MIN_ROWS 8 /* the vector path is as fast up to 8 rows (the codes unpacked per call cost AMX that) */

/* Block b's codes as 16 rows of k bytes in input order: 16 steps (128 inputs) at a time, the steps' dwords
 * transposed so each register holds one channel's, its nibbles masked and interleaved back into input order. */
static void w4a8_unpack_block(const w4a8_job_t *J, int64_t b, uint8_t *to) {
    const int64_t k = J->k, steps = k / W4A8_STEP, whole = steps / 16 * 16;
    const __m512i low = _mm512_set1_epi8(0x0f);
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int64_t j = 0; j < whole; j += 16) {
        __m512i r[16];
        for (int s = 0; s < 16; s++) r[s] = _mm512_loadu_si512((const void *)w4a8_step(J, b, j + s));
        transpose_16x16_epi32(r); /* r[c]: channel c's dwords of the 16 steps */
        for (int c = 0; c < 16; c++) {
            const __m512i lo = _mm512_and_si512(r[c], low), hi = _mm512_and_si512(_mm512_srli_epi16(r[c], 4), low);
            _mm512_storeu_si512((void *)(to + c * k + j * W4A8_STEP), _mm512_permutex2var_epi32(lo, first, hi));
            _mm512_storeu_si512((void *)(to + c * k + j * W4A8_STEP + 64), _mm512_permutex2var_epi32(lo, second, hi));
        }
    }
    for (int64_t j = whole; j < steps; j++) {
        const uint8_t *step = w4a8_step(J, b, j);
        for (int c = 0; c < 16; c++)
            for (int i = 0; i < 4; i++) {
                to[c * k + j * W4A8_STEP + i] = step[c * 4 + i] & 0xf;
                to[c * k + j * W4A8_STEP + 4 + i] = step[c * 4 + i] >> 4;
            }
    }
}

/* Groups of 4 blocks (64 channels): the codes unpacked once, then for each block of 16 rows and each weight group the
 * 4 C tiles (4 blocks of channels by one block of rows) scaled by the channels' scales and the rows' activation scales
 * into float32 sums, as the vector paths do lane by lane; the offsets' term added at the end. out^T = W . q_x^T as in
 * linear_w8a8.c. */
static void w4a8_amx_part(void *arg, int tid, int nt) {
    const w4a8_job_t *J = (const w4a8_job_t *)arg;
    const int64_t k = J->k, group = J->group, groups = k / group, blocks = (J->n + W4A8_LANES - 1) / W4A8_LANES;
    const int64_t row_blocks = (J->m + AMX_ROWS - 1) / AMX_ROWS, padded = row_blocks * AMX_ROWS;
    int32_t sums[4][256] __attribute__((aligned(64)));
    float acc[4][256] __attribute__((aligned(64))); /* [block][channel * 16 + row] */
    int64_t first, last;
    pool_range((blocks + 3) / 4, tid, nt, &first, &last);
    uint8_t *codes = J->codes + tid * 64 * k;
    if (first >= last) return;
    amx_configure(AMX_ROWS);
    for (int64_t g4 = first; g4 < last; g4++) {
        const int64_t cb = 4 * g4, count = blocks - cb < 4 ? blocks - cb : 4;
        for (int64_t i = 0; i < count; i++) w4a8_unpack_block(J, cb + i, codes + i * 16 * k);
        for (int64_t rb = 0; rb < row_blocks; rb++) {
            memset(acc, 0, sizeof acc);
            const uint32_t *bt = J->xt + rb * AMX_ROWS * (k / 4);
            for (int64_t g = 0; g < groups; g++) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t d = g * group; d < (g + 1) * group; d += 64) {
                    _tile_loadd(6, bt + d / 4 * AMX_ROWS, 64);
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
                for (int64_t i = 0; i < count; i++) {
                    const float *scales = J->scale + ((cb + i) * groups + g) * W4A8_LANES;
                    for (int ch = 0; ch < 16; ch++) {
                        const __m512 v = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(sums[i] + ch * 16)));
                        const __m512 scaled = _mm512_mul_ps(xs, _mm512_set1_ps(scales[ch]));
                        _mm512_store_ps(acc[i] + ch * 16, _mm512_fmadd_ps(v, scaled, _mm512_load_ps(acc[i] + ch * 16)));
                    }
                }
            }
            const int64_t rows = J->m - rb * AMX_ROWS < AMX_ROWS ? J->m - rb * AMX_ROWS : AMX_ROWS;
            for (int64_t i = 0; i < count; i++) {
                for (int ch = 0; ch < 16; ch++) { /* + the offsets' term, row by row in the lanes */
                    __m512 offsets = _mm512_setzero_ps();
                    for (int64_t g = 0; g < groups; g++)
                        offsets = _mm512_fmadd_ps(_mm512_set1_ps(J->bias[((cb + i) * groups + g) * W4A8_LANES + ch]),
                                                  _mm512_loadu_ps(J->xsum_t + g * padded + rb * AMX_ROWS), offsets);
                    _mm512_store_ps(acc[i] + ch * 16, _mm512_add_ps(_mm512_load_ps(acc[i] + ch * 16), offsets));
                }
                const int64_t c = (cb + i) * W4A8_LANES, left = J->n - c;
                const __mmask16 keep = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
                for (int64_t t = 0; t < rows; t++)
                    _mm512_mask_storeu_ps(J->out + (rb * AMX_ROWS + t) * J->n + c, keep, amx_row_ps(acc[i], t));
            }
        }
    }
    _tile_release();
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
    w4a8_job_t job = {xq, xs, xsum, m, k, w, scale, bias, group, n, out, NULL, NULL, NULL, NULL};
#if defined(W4A8_AMX)
    if (amx_active() && m >= W4A8_AMX_MIN_ROWS && group % 64 == 0) {
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
        pool_run(w4a8_part, &job, num_threads);
    free(xs);
    free(xq);
    return 0;
}
