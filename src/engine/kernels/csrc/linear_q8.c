/* Linear layers for small batches (decode) whose weights are widened in registers:
 * y = (x W^T) * scale (+ bias), per output channel.
 *
 * x [M, K] and y [M, N] float32 or bfloat16 (dtype, both alike), W [N, K] int8 (--quantization w8a8_int8),
 * float8 e4m3 (fp8) or bfloat16 (an unquantized LM head on a CPU without AVX512-BF16, scale NULL), scale
 * and bias [N] float32 or NULL. A decode step reads every weight once, so its time is the weight bytes
 * over the memory bandwidth: these kernels stream the weights as stored (one byte each for the 8-bit
 * formats, half of bf16's) and widen each to float32 in registers, never in memory. Sums are float32; the
 * scale and bias are applied once per output, then the one rounding to bfloat16 where y is.
 *
 * e4m3 to float32 without a table: moving the byte's exponent and mantissa bits (without the sign) 7
 * places up gives the float16 with the same mantissa and exponent field, worth the e4m3 value / 2^8
 * (the exponent biases are 15 and 7), subnormals included; the sign goes to bit 15. F16C widens that
 * half to float32, and the 2^8 is folded into the scale. e4m3fn's NaN (0x7f) never occurs in weights
 * quantized into its range. bfloat16 is the top half of a float32: a 16-bit shift.
 *
 * Tiles: one row x 4 output channels, 16 inputs per step in two sums per channel (8 float32 sums: a
 * single row is latency-bound on the FMAs with fewer), or 2-4 rows x 2 channels (8 sums), each channel's
 * 8 weights widened once per row tile. Rows in blocks of 256 KiB of activations, each block a pass over
 * the weights. Threads (thread_pool.c) take contiguous ranges of channel groups. bf16 activations are
 * widened once per call into float32 scratch. AVX2 + FMA + F16C where the compiler has them (Zen 1 and
 * up), else a portable loop with the same sums in another order.
 *
 * linear_w8a8.c: int8 weights times int8 activations.
 */
#include "amx.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define Q8_AVX2 1
#endif

enum { W_INT8 = 0, W_FP8 = 1, W_BF16 = 2 };

#define Q8_ROWS 4
#define Q8_L2_BYTES (256 * 1024) /* half of Zen 1's L2 per core: room for the weights and the output */
#define FP8_SCALE 256.0f /* the e4m3 -> float16 reinterpretation's 2^-8, undone */

static inline float fp8_e4m3_to_f32(uint8_t b) {
    const int exp = (b >> 3) & 0xf, man = b & 7;
    const float mag = exp == 0 ? ldexpf((float)man / 8.0f, -6) : ldexpf(1.0f + (float)man / 8.0f, exp - 7);
    return (b & 0x80) ? -mag : mag;
}

typedef struct {
    const float *x; /* float32 rows (bf16 ones widened first) */
    const float *xp; /* bf16 weights: x with each block of 16 inputs as its 8 even ones, then its 8 odd ones */
    int64_t m, k;
    const uint8_t *w;
    int fmt;
    const float *scale, *bias;
    int64_t n;
    void *out;
    int dtype;
    const uint16_t *xb; /* AMX: the bf16 rows packed as B tiles (amx_pack_rows), or NULL */
    uint16_t *wb; /* AMX: 64 channels' widened weights per thread */
} q8_job_t;

/* Weight d of channel c as float32 (e4m3: / 2^8). */
static inline float weight_at(const uint8_t *w, int64_t k, int64_t c, int64_t d, const int fmt) {
    if (fmt == W_BF16) return bf16_to_f32(((const uint16_t *)w)[c * k + d]);
    const uint8_t b = w[c * k + d];
    return fmt == W_FP8 ? fp8_e4m3_to_f32(b) / FP8_SCALE : (float)(int8_t)b;
}

#if defined(Q8_AVX2)
/* Weights d .. d + 8 of channel c as float32 (e4m3: still / 2^8). */
static inline __attribute__((always_inline)) __m256 widen8(const uint8_t *w, int64_t k, int64_t c, int64_t d,
                                                           const int fmt) {
    if (fmt == W_BF16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + c * k + d));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)(w + c * k + d));
    if (fmt == W_INT8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    /* e4m3 s.eeee.mmm as the float16 s.0eeee.mmm0000000 (2^-8 of its value): each byte into the high half of
     * a 16-bit lane, an arithmetic shift right by one (the sign lands on bits 15 and 14), bit 14 cleared.
     * Three integer operations where masking and shifting sign and magnitude apart took six: the fp8
     * kernels widen every weight and are compute-bound on this, not memory-bound. */
    const __m128i h = _mm_unpacklo_epi8(_mm_setzero_si128(), bytes);
    const __m128i half = _mm_and_si128(_mm_srai_epi16(h, 1), _mm_set1_epi16((short)0xbfff));
    return _mm256_cvtph_ps(half);
}

/* bf16 weights 16 at a time without widening: a 32-byte load holds 8 pairs, each dword (even weight low, odd
 * weight high) is the odd weight as a float32 once its low half is masked off and the even one once shifted
 * up 16 bits; they meet x's even and odd inputs (xp's order). Half the instructions of widen8 per weight. */
static inline __attribute__((always_inline)) void bf16_pairs(const uint8_t *w, int64_t k, int64_t c, int64_t d,
                                                             __m256 *even, __m256 *odd) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + c * k + d));
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define Q8_AVX512 1
/* widen8 for 16 one-byte weights (int8 or e4m3, the latter / 2^8). */
static inline __attribute__((always_inline)) __m512 widen16(const uint8_t *w, int64_t k, int64_t c, int64_t d,
                                                            const int fmt) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)(w + c * k + d));
    if (fmt == W_INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
    const __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8);
    return _mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16(h, 1), _mm256_set1_epi16((short)0xbfff)));
}
#endif
#endif

/* sums[c] = x[m0] . W[c0 + c] for one row and C (1-4) channels, unscaled. `next`: the bytes of the next group
 * of 4 channels (q8_one_row), fetched while these are summed, NULL for none: a batch-1 step reads each group
 * as 4 short interleaved streams, too short for the hardware prefetcher (as w8a8_one_row; bf16 weights of a
 * model from memory on one Zen 1 thread: 0.245 -> 0.19-0.20 ns per weight). */
static inline __attribute__((always_inline)) void q8_row(const q8_job_t *J, int64_t m0, int64_t c0, const int C,
                                                         const int fmt, float sums[4], const uint8_t *next) {
    const int64_t k = J->k;
    const float *x = J->x + m0 * k;
    int64_t d = 0;
#if defined(Q8_AVX2)
    __m256 acc[4][2];
    for (int c = 0; c < C; c++) acc[c][0] = acc[c][1] = _mm256_setzero_ps();
    if (fmt == W_BF16)
        for (; d + 16 <= k; d += 16) {
            if (next != NULL) {  /* 16 inputs x 4 channels x 2 bytes: two lines of the next group */
                _mm_prefetch((const char *)(next + 8 * d), _MM_HINT_T0);
                _mm_prefetch((const char *)(next + 8 * d + 64), _MM_HINT_T0);
            }
            const __m256 xe = _mm256_loadu_ps(J->xp + m0 * k + d), xo = _mm256_loadu_ps(J->xp + m0 * k + d + 8);
            for (int c = 0; c < C; c++) {
                __m256 we, wo;
                bf16_pairs(J->w, k, c0 + c, d, &we, &wo);
                acc[c][0] = _mm256_fmadd_ps(xe, we, acc[c][0]);
                acc[c][1] = _mm256_fmadd_ps(xo, wo, acc[c][1]);
            }
        }
#if defined(Q8_AVX512)
    /* One-byte weights 32 inputs a step in 16-lane halves (the fp8 kernel is compute-bound on the widening: on
     * the 2-core Xeon, one thread, a 2816 x 1024 e4m3 weight from L2: 0.33 -> 0.25 ms), folded into the 8-lane
     * sums below. */
    if (fmt != W_BF16) {
        __m512 wide[4][2];
        for (int c = 0; c < C; c++) wide[c][0] = wide[c][1] = _mm512_setzero_ps();
        for (; d + 32 <= k; d += 32) {
            if (next != NULL) { /* 32 inputs x 4 channels: two lines of the next group */
                _mm_prefetch((const char *)(next + 4 * d), _MM_HINT_T0);
                _mm_prefetch((const char *)(next + 4 * d + 64), _MM_HINT_T0);
            }
            const __m512 x0 = _mm512_loadu_ps(x + d), x1 = _mm512_loadu_ps(x + d + 16);
            for (int c = 0; c < C; c++) {
                wide[c][0] = _mm512_fmadd_ps(x0, widen16(J->w, k, c0 + c, d, fmt), wide[c][0]);
                wide[c][1] = _mm512_fmadd_ps(x1, widen16(J->w, k, c0 + c, d + 16, fmt), wide[c][1]);
            }
        }
        for (int c = 0; c < C; c++) {
            const __m512 t = _mm512_add_ps(wide[c][0], wide[c][1]);
            acc[c][0] = _mm512_castps512_ps256(t);
            acc[c][1] = _mm512_extractf32x8_ps(t, 1);
        }
    }
#endif
    for (; d + 16 <= k; d += 16) {
        if (next != NULL) _mm_prefetch((const char *)(next + 4 * d), _MM_HINT_T0);  /* one-byte weights: one line */
        const __m256 x0 = _mm256_loadu_ps(x + d), x1 = _mm256_loadu_ps(x + d + 8);
        for (int c = 0; c < C; c++) {
            acc[c][0] = _mm256_fmadd_ps(x0, widen8(J->w, k, c0 + c, d, fmt), acc[c][0]);
            acc[c][1] = _mm256_fmadd_ps(x1, widen8(J->w, k, c0 + c, d + 8, fmt), acc[c][1]);
        }
    }
    for (; d + 8 <= k; d += 8) {
        const __m256 x0 = _mm256_loadu_ps(x + d);
        for (int c = 0; c < C; c++) acc[c][0] = _mm256_fmadd_ps(x0, widen8(J->w, k, c0 + c, d, fmt), acc[c][0]);
    }
    for (int c = 0; c < C; c++) sums[c] = hsum8(_mm256_add_ps(acc[c][0], acc[c][1]));
#else
    (void)next;
    for (int c = 0; c < C; c++) sums[c] = 0.0f;
#endif
    for (; d < k; d++)
        for (int c = 0; c < C; c++) sums[c] += x[d] * weight_at(J->w, k, c0 + c, d, fmt);
}

/* sums[r][c] = x[m0 + r] . W[c0 + c] for R rows and C (1 or 2) channels, unscaled. */
static inline __attribute__((always_inline)) void q8_tile(const q8_job_t *J, int64_t m0, const int R, int64_t c0,
                                                          const int C, const int fmt, float sums[Q8_ROWS][2]) {
    const int64_t k = J->k;
    int64_t d = 0;
#if defined(Q8_AVX2)
    __m256 acc[Q8_ROWS][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    if (fmt == W_BF16)
        for (; d + 16 <= k; d += 16) {
            __m256 we[2], wo[2];
            for (int c = 0; c < C; c++) bf16_pairs(J->w, k, c0 + c, d, &we[c], &wo[c]);
            for (int r = 0; r < R; r++) {
                const __m256 xe = _mm256_loadu_ps(J->xp + (m0 + r) * k + d);
                const __m256 xo = _mm256_loadu_ps(J->xp + (m0 + r) * k + d + 8);
                for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(xo, wo[c], _mm256_fmadd_ps(xe, we[c], acc[r][c]));
            }
        }
    for (; d + 8 <= k; d += 8) {
        __m256 wv[2];
        for (int c = 0; c < C; c++) wv[c] = widen8(J->w, k, c0 + c, d, fmt);
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_loadu_ps(J->x + (m0 + r) * k + d);
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) sums[r][c] = hsum8(acc[r][c]);
#else
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) sums[r][c] = 0.0f;
#endif
    for (; d < k; d++)
        for (int c = 0; c < C; c++) {
            const float wf = weight_at(J->w, k, c0 + c, d, fmt);
            for (int r = 0; r < R; r++) sums[r][c] += J->x[(m0 + r) * k + d] * wf;
        }
}

/* out[row][c0 + c] = sums[c] * unit * scale + bias, rounded to the output dtype. */
static inline void q8_emit(const q8_job_t *J, int64_t row, int64_t c0, int C, const float *sums, float unit) {
    for (int c = 0; c < C; c++) {
        float y = sums[c] * unit;
        if (J->scale != NULL) y *= J->scale[c0 + c];
        if (J->bias != NULL) y += J->bias[c0 + c];
        const int64_t at = row * J->n + c0 + c;
        if (J->dtype == DTYPE_BF16) ((uint16_t *)J->out)[at] = f32_to_bf16(y);
        else ((float *)J->out)[at] = y;
    }
}

/* A single row: channels in groups of 4. */
static inline __attribute__((always_inline)) void q8_one_row(const q8_job_t *J, int tid, int nt, const int fmt) {
    const float unit = fmt == W_FP8 ? FP8_SCALE : 1.0f;
    int64_t first, last;
    pool_range((J->n + 3) / 4, tid, nt, &first, &last);
    const int64_t bytes = fmt == W_BF16 ? 2 : 1;
    for (int64_t g = first; g < last; g++) {
        const int64_t c0 = 4 * g;
        float sums[4];
        /* The next group's bytes while this one is summed; none for the last whole group. */
        const uint8_t *next = c0 + 8 <= J->n ? J->w + (c0 + 4) * J->k * bytes : NULL;
        switch (J->n - c0 >= 4 ? 4 : (int)(J->n - c0)) {
        case 4: q8_row(J, 0, c0, 4, fmt, sums, next); q8_emit(J, 0, c0, 4, sums, unit); break;
        case 3: q8_row(J, 0, c0, 3, fmt, sums, NULL); q8_emit(J, 0, c0, 3, sums, unit); break;
        case 2: q8_row(J, 0, c0, 2, fmt, sums, NULL); q8_emit(J, 0, c0, 2, sums, unit); break;
        default: q8_row(J, 0, c0, 1, fmt, sums, NULL); q8_emit(J, 0, c0, 1, sums, unit); break;
        }
    }
}

/* Channel pairs [first, last) for every row. */
static inline __attribute__((always_inline)) void q8_pairs(const q8_job_t *J, int64_t first, int64_t last, const int fmt) {
    /* e4m3 sums are 2^-8 of the value, in the vector loop and (to match it) the scalar tail alike. */
    const float unit = fmt == W_FP8 ? FP8_SCALE : 1.0f;
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
            if (left >= 4) { if (C == 2) q8_tile(J, m0, 4, c0, 2, fmt, sums); else q8_tile(J, m0, 4, c0, 1, fmt, sums); }
            else if (left == 3) { if (C == 2) q8_tile(J, m0, 3, c0, 2, fmt, sums); else q8_tile(J, m0, 3, c0, 1, fmt, sums); }
            else if (left == 2) { if (C == 2) q8_tile(J, m0, 2, c0, 2, fmt, sums); else q8_tile(J, m0, 2, c0, 1, fmt, sums); }
            else { if (C == 2) q8_tile(J, m0, 1, c0, 2, fmt, sums); else q8_tile(J, m0, 1, c0, 1, fmt, sums); }
            const int R = left >= Q8_ROWS ? Q8_ROWS : (int)left;
            for (int r = 0; r < R; r++) q8_emit(J, m0 + r, c0, C, sums[r], unit);
        }
    }
}

static inline __attribute__((always_inline)) void q8_rows(const q8_job_t *J, int tid, int nt, const int fmt) {
    int64_t first, last;
    pool_range((J->n + 1) / 2, tid, nt, &first, &last);
    q8_pairs(J, first, last, fmt);
}

/* One specialisation per weight format and row count (constant fmt: the widening is inlined). */
static void q8_part(void *arg, int tid, int nt) {
    const q8_job_t *J = (const q8_job_t *)arg;
    if (J->m == 1) {
        switch (J->fmt) {
        case W_INT8: q8_one_row(J, tid, nt, W_INT8); break;
        case W_FP8: q8_one_row(J, tid, nt, W_FP8); break;
        default: q8_one_row(J, tid, nt, W_BF16); break;
        }
        return;
    }
    switch (J->fmt) {
    case W_INT8: q8_rows(J, tid, nt, W_INT8); break;
    case W_FP8: q8_rows(J, tid, nt, W_FP8); break;
    default: q8_rows(J, tid, nt, W_BF16); break;
    }
}


#if defined(HAVE_AMX) && defined(__AVX512BF16__)
/* AMX for int8 / e4m3 weights against bf16 rows (2 rows and up, k a multiple of 32): each thread widens a group of
 * 64 channels' weights to bf16 once (e4m3 through float16 as widen8 does, then float32, then bf16; int8 through
 * float32: exact either way, e4m3 as 2^-8 of its value), then tdpbf16ps takes them as A tiles against the rows
 * packed as B tiles (pairs of inputs as 32-bit words, linear_w8a8.c's layout), 4 blocks of 16 channels by a block
 * of 16 rows into float32 C tiles: out^T = W . x^T. bf16 x bf16 products are exact in float32, so only the order
 * of the sums differs from the vector paths. Channels past the last whole block of 16 take those. On the 2-core
 * Xeon, one thread, a 2816 x 1024 e4m3 weight: 16 rows 0.48 ms against 2.24 on the vector path, 256 rows 3.2
 * against 41.8; 2 rows 0.45 against 0.40 (the widening costs what one row's vector pass does): from 4 rows. */
#define Q8_AMX 1
#define Q8_AMX_MIN_ROWS 4

/* Channel c's k weights as bf16 into to[0..k). */
static void q8_widen_row(const uint8_t *w, int64_t k, const int fmt, uint16_t *to) {
    for (int64_t d = 0; d < k; d += 16) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(w + d));
        __m512 f;
        if (fmt == W_FP8) {
            const __m256i high = _mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8);
            f = _mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16(high, 1), _mm256_set1_epi16((short)0xbfff)));
        } else {
            f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
        }
        _mm256_storeu_si256((__m256i *)(to + d), (__m256i)_mm512_cvtneps_pbh(f));
    }
}

/* sums[i] (16 channels x 16 rows, channel-major) = channel block i of the `count` (1 or 4) from w (bf16 rows of k)
 * . the rows of B tile block b. */
static inline void q8_amx_block(const uint16_t *w, int64_t k, const uint16_t *b, int count, float sums[4][256]) {
    _tile_zero(0);
    if (count == 4) {
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t d = 0; d < k; d += 32) {
        _tile_loadd(6, b + d * AMX_ROWS, 64);
        _tile_loadd(4, w + d, k * 2);
        _tile_dpbf16ps(0, 4, 6);
        if (count == 1) continue;
        _tile_loadd(5, w + 16 * k + d, k * 2);
        _tile_dpbf16ps(1, 5, 6);
        _tile_loadd(4, w + 32 * k + d, k * 2);
        _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(5, w + 48 * k + d, k * 2);
        _tile_dpbf16ps(3, 5, 6);
    }
    _tile_stored(0, sums[0], 64);
    if (count == 1) return;
    _tile_stored(1, sums[1], 64);
    _tile_stored(2, sums[2], 64);
    _tile_stored(3, sums[3], 64);
}

/* One C tile's outputs: channels c0 .. c0 + 15 of rows r0 .. r0 + 15 below m, q8_emit's operations in its order. */
static void q8_amx_emit(const q8_job_t *J, const float *sums, int64_t c0, int64_t r0, float unit) {
    const int64_t rows = J->m - r0 < AMX_ROWS ? J->m - r0 : AMX_ROWS;
    const __m512 scale = _mm512_loadu_ps(J->scale + c0);
    const __m512 bias = J->bias != NULL ? _mm512_loadu_ps(J->bias + c0) : _mm512_setzero_ps();
    for (int64_t t = 0; t < rows; t++) {
        __m512 y = _mm512_mul_ps(_mm512_mul_ps(amx_row_ps(sums, t), _mm512_set1_ps(unit)), scale);
        if (J->bias != NULL) y = _mm512_add_ps(y, bias);
        amx_store16(J->out, (r0 + t) * J->n + c0, y, J->dtype);
    }
}

static void q8_amx_part(void *arg, int tid, int nt) {
    const q8_job_t *J = (const q8_job_t *)arg;
    const int64_t k = J->k, blocks = J->n / 16, row_blocks = (J->m + AMX_ROWS - 1) / AMX_ROWS;
    const float unit = J->fmt == W_FP8 ? FP8_SCALE : 1.0f;
    float sums[4][256] __attribute__((aligned(64)));
    int64_t first, last;
    pool_range((blocks + 3) / 4, tid, nt, &first, &last);
    uint16_t *wb = J->wb + tid * 64 * k; /* this thread's 64 channels as bf16 */
    if (first < last) {
        amx_configure(AMX_ROWS);
        for (int64_t g = first; g < last; g++) {
            const int64_t cb = 4 * g, count = blocks - cb < 4 ? blocks - cb : 4;
            for (int64_t c = 0; c < 16 * count; c++) q8_widen_row(J->w + (cb * 16 + c) * k, k, J->fmt, wb + c * k);
            for (int64_t rb = 0; rb < row_blocks; rb++) {
                const uint16_t *b = J->xb + rb * AMX_ROWS * k;
                if (count == 4) q8_amx_block(wb, k, b, 4, sums);
                for (int64_t i = 0; i < count; i++) {
                    if (count != 4) q8_amx_block(wb + i * 16 * k, k, b, 1, sums + i);
                    q8_amx_emit(J, sums[i], (cb + i) * 16, rb * AMX_ROWS, unit);
                }
            }
        }
        _tile_release();
    }
    if (tid == nt - 1 && blocks * 16 < J->n) {
        if (J->fmt == W_FP8) q8_pairs(J, blocks * 8, (J->n + 1) / 2, W_FP8);
        else q8_pairs(J, blocks * 8, (J->n + 1) / 2, W_INT8);
    }
}
#endif

/* x as float32 rows: x itself, or bf16 widened into *scratch (freed by the caller). */
static const float *float_rows(const void *x, int64_t m, int64_t k, int dtype, float **scratch) {
    *scratch = NULL;
    if (dtype != DTYPE_BF16) return (const float *)x;
    float *f = (float *)malloc(sizeof(float) * (size_t)(m * k));
    if (f == NULL) return NULL;
    const uint16_t *src = (const uint16_t *)x;
    for (int64_t i = 0; i < m * k; i++) f[i] = bf16_to_f32(src[i]);
    *scratch = f;
    return f;
}

/* xp for bf16 weights: per row, each whole block of 16 inputs as its even inputs, then its odd ones. */
static float *pair_order(const float *x, int64_t m, int64_t k) {
    float *xp = (float *)malloc(sizeof(float) * (size_t)(m * k));
    if (xp == NULL) return NULL;
    for (int64_t r = 0; r < m; r++)
        for (int64_t d = 0; d < k; d++) {
            const int64_t block = d - d % 16, j = d % 16;
            xp[r * k + d] = block + 16 <= k ? x[r * k + block + (j < 8 ? 2 * j : 2 * (j - 8) + 1)] : x[r * k + d];
        }
    return xp;
}

int linear_q8(const void *x, int64_t m, int64_t k, const void *w, int w_format, const float *scale,
              const float *bias, int64_t n, void *out, int dtype, int num_threads) {
#if defined(Q8_AMX)
    if (amx_active() && dtype == DTYPE_BF16 && w_format != W_BF16 && m >= Q8_AMX_MIN_ROWS && k % 32 == 0 && n >= 16) {
        /* the packed rows, each thread's widened channels, and float32 rows for the channels past the last whole
         * block of 16 (the vector path's) */
        uint32_t *xt = (uint32_t *)aligned_alloc(64, (size_t)((m + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS * k * 2));
        uint16_t *wb = (uint16_t *)aligned_alloc(64, (size_t)(num_threads * 64 * k * 2));
        float *rest = NULL;
        const float *xf = n % 16 ? float_rows(x, m, k, dtype, &rest) : NULL;
        if (xt != NULL && wb != NULL && (n % 16 == 0 || xf != NULL)) {
            amx_pack_rows(x, k * 2, m, k / 2, xt);
            q8_job_t job = {xf, NULL, m, k, (const uint8_t *)w, w_format, scale, bias, n, out, dtype,
                            (const uint16_t *)xt, wb};
            pool_run(q8_amx_part, &job, num_threads);
        }
        const int ran = xt != NULL && wb != NULL && (n % 16 == 0 || xf != NULL);
        free(xt);
        free(wb);
        free(rest);
        if (ran) return 0;
    }
#endif
    float *scratch;
    const float *xf = float_rows(x, m, k, dtype, &scratch);
    if (xf == NULL) return -1;
    float *xp = w_format == W_BF16 ? pair_order(xf, m, k) : NULL;
    if (w_format == W_BF16 && xp == NULL) {
        free(scratch);
        return -1;
    }
    q8_job_t job = {xf, xp, m, k, (const uint8_t *)w, w_format, scale, bias, n, out, dtype, NULL, NULL};
    pool_run(q8_part, &job, num_threads);
    free(xp);
    free(scratch);
    return 0;
}

/* ------------------------------------------------------------------------------------ block fp8
 * linear_fp8_block: block-wise fp8 weights (DeepSeek-V3's checkpoints): W [N, K] e4m3 where block (i, j) of
 * [block_n, block_k] weights is scaled by scale[i * kb + j], kb = ceil(K / block_k) (the last blocks may be
 * ragged). Each block's products are summed apart in float32 (two vector sums per channel, as q8_row) and
 * the block's sum scaled before it joins the channel's total; the 2^8 of the e4m3 widening is undone once
 * per output. One row (decode): 4 channels at a time, the next group's bytes prefetched while this one is
 * summed (as q8_one_row: 4 interleaved streams of k bytes are too short for the hardware prefetcher).
 * Several rows: tiles of up to 4 rows x 1 channel over rows in L2-sized blocks (as q8_rows), each block's 8
 * weights widened once for the 4 rows (widening e4m3 costs more than the FMA; every row re-widened them
 * before: 2.5-3x slower at 16 and 256 rows). 4 x 2 tiles that scaled the widened weights (no per-block
 * totals: 4 x 2 of those and of the sums would not fit the 16 registers) were ~15% slower at 16 rows. block_k
 * a multiple of 8 keeps the vector loop inside a block. */
typedef struct {
    const float *x;
    int64_t m, k;
    const uint8_t *w;
    const float *scale;
    int64_t block_n, block_k, kb;
    const float *bias;
    int64_t n;
    void *out;
    int dtype;
} fp8b_job_t;

/* sums[c] = sum over blocks j of (x[row] . W[c0 + c] over block j) * scale of (c0 + c, j). `next`: the bytes
 * of the next group of 4 channels, fetched while these are summed (NULL: none). A block's vector sums meet
 * its scale in one FMA into the channel's vector total (a horizontal sum per block cost ~10% here). */
static inline __attribute__((always_inline)) void fp8b_row(const fp8b_job_t *J, int64_t row, int64_t c0, const int C,
                                                           float sums[4], const uint8_t *next) {
    const int64_t k = J->k;
    const float *x = J->x + row * k;
    for (int c = 0; c < C; c++) sums[c] = 0.0f;
#if defined(Q8_AVX2)
    __m256 total[4];
    for (int c = 0; c < C; c++) total[c] = _mm256_setzero_ps();
#else
    (void)next;
#endif
    for (int64_t j = 0; j < J->kb; j++) {
        const int64_t d0 = j * J->block_k, d1 = d0 + J->block_k < k ? d0 + J->block_k : k;
        float sf[4];
        for (int c = 0; c < C; c++) sf[c] = J->scale[((c0 + c) / J->block_n) * J->kb + j];
        int64_t d = d0;
#if defined(Q8_AVX2)
        __m256 acc[4][2];
        for (int c = 0; c < C; c++) acc[c][0] = acc[c][1] = _mm256_setzero_ps();
        for (; d + 16 <= d1; d += 16) {
            if (next != NULL) _mm_prefetch((const char *)(next + 4 * d), _MM_HINT_T0);  /* 4 x 16 bytes: a line */
            const __m256 x0 = _mm256_loadu_ps(x + d), x1 = _mm256_loadu_ps(x + d + 8);
            for (int c = 0; c < C; c++) {
                acc[c][0] = _mm256_fmadd_ps(x0, widen8(J->w, k, c0 + c, d, W_FP8), acc[c][0]);
                acc[c][1] = _mm256_fmadd_ps(x1, widen8(J->w, k, c0 + c, d + 8, W_FP8), acc[c][1]);
            }
        }
        for (; d + 8 <= d1; d += 8) {
            const __m256 x0 = _mm256_loadu_ps(x + d);
            for (int c = 0; c < C; c++) acc[c][0] = _mm256_fmadd_ps(x0, widen8(J->w, k, c0 + c, d, W_FP8), acc[c][0]);
        }
        for (int c = 0; c < C; c++)
            total[c] = _mm256_fmadd_ps(_mm256_add_ps(acc[c][0], acc[c][1]), _mm256_set1_ps(sf[c]), total[c]);
#endif
        if (d < d1) {  /* a scalar tail (k not a multiple of 8) */
            float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (; d < d1; d++)
                for (int c = 0; c < C; c++) part[c] += x[d] * weight_at(J->w, k, c0 + c, d, W_FP8);
            for (int c = 0; c < C; c++) sums[c] += part[c] * sf[c];
        }
    }
#if defined(Q8_AVX2)
    for (int c = 0; c < C; c++) sums[c] += hsum8(total[c]);
#endif
}

/* sums[r][c] = x[m0 + r] . W[c0 + c] for R rows and C channels (fp8b_part: 1): each block's 8 weights widened
 * once for the R rows, the block's vector sums times its scale added into vector totals (one FMA a block). */
static inline __attribute__((always_inline)) void fp8b_tile(const fp8b_job_t *J, int64_t m0, const int R, int64_t c0,
                                                            const int C, float sums[Q8_ROWS][2]) {
    const int64_t k = J->k;
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) sums[r][c] = 0.0f;
#if defined(Q8_AVX2)
    __m256 total[Q8_ROWS][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) total[r][c] = _mm256_setzero_ps();
#endif
    for (int64_t j = 0; j < J->kb; j++) {
        const int64_t d0 = j * J->block_k, d1 = d0 + J->block_k < k ? d0 + J->block_k : k;
        float sf[2];
        for (int c = 0; c < C; c++) sf[c] = J->scale[((c0 + c) / J->block_n) * J->kb + j] * FP8_SCALE;
        int64_t d = d0;
#if defined(Q8_AVX2)
        __m256 acc[Q8_ROWS][2];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
        for (; d + 8 <= d1; d += 8) {
            __m256 wv[2];
            for (int c = 0; c < C; c++) wv[c] = widen8(J->w, k, c0 + c, d, W_FP8);
            for (int r = 0; r < R; r++) {
                const __m256 xv = _mm256_loadu_ps(J->x + (m0 + r) * k + d);
                for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
            }
        }
        for (int c = 0; c < C; c++) {
            const __m256 sv = _mm256_set1_ps(sf[c]);
            for (int r = 0; r < R; r++) total[r][c] = _mm256_fmadd_ps(acc[r][c], sv, total[r][c]);
        }
#endif
        for (; d < d1; d++)
            for (int c = 0; c < C; c++) {
                const float wf = weight_at(J->w, k, c0 + c, d, W_FP8) * sf[c];
                for (int r = 0; r < R; r++) sums[r][c] += J->x[(m0 + r) * k + d] * wf;
            }
    }
#if defined(Q8_AVX2)
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) sums[r][c] += hsum8(total[r][c]);
#endif
}

static inline void fp8b_emit(const fp8b_job_t *J, int64_t row, int64_t c0, int C, const float *sums) {
    for (int c = 0; c < C; c++) {
        float y = sums[c];
        if (J->bias != NULL) y += J->bias[c0 + c];
        const int64_t at = row * J->n + c0 + c;
        if (J->dtype == DTYPE_BF16) ((uint16_t *)J->out)[at] = f32_to_bf16(y);
        else ((float *)J->out)[at] = y;
    }
}

static void fp8b_one_row(const fp8b_job_t *J, int tid, int nt) {
    int64_t first, last;
    pool_range((J->n + 3) / 4, tid, nt, &first, &last);
    for (int64_t g = first; g < last; g++) {
        const int64_t c0 = 4 * g;
        const int C = J->n - c0 >= 4 ? 4 : (int)(J->n - c0);
        /* The next group's bytes while this one is summed; none for the last whole group. */
        const uint8_t *next = c0 + 8 <= J->n ? J->w + (c0 + 4) * J->k : NULL;
        float sums[4];
        switch (C) {
        case 4: fp8b_row(J, 0, c0, 4, sums, next); break;
        case 3: fp8b_row(J, 0, c0, 3, sums, NULL); break;
        case 2: fp8b_row(J, 0, c0, 2, sums, NULL); break;
        default: fp8b_row(J, 0, c0, 1, sums, NULL); break;
        }
        for (int c = 0; c < C; c++) sums[c] *= FP8_SCALE;
        fp8b_emit(J, 0, c0, C, sums);
    }
}

static void fp8b_part(void *arg, int tid, int nt) {
    const fp8b_job_t *J = (const fp8b_job_t *)arg;
    if (J->m == 1) {
        fp8b_one_row(J, tid, nt);
        return;
    }
    int64_t first, last;
    pool_range(J->n, tid, nt, &first, &last);
    /* As q8_rows: the rows in blocks whose float32 activations stay in L2 while this thread's channels pass
     * over them, so each weight is read (and widened) once per block of rows, not once per row. */
    int64_t block = (Q8_L2_BYTES / (J->k * (int64_t)sizeof(float))) / Q8_ROWS * Q8_ROWS;
    if (block < Q8_ROWS) block = Q8_ROWS;
    for (int64_t b0 = 0; b0 < J->m; b0 += block)
    for (int64_t c0 = first; c0 < last; c0++) {
        const int64_t b1 = b0 + block < J->m ? b0 + block : J->m;
        for (int64_t m0 = b0; m0 < b1; m0 += Q8_ROWS) {
            const int64_t left = b1 - m0;
            float sums[Q8_ROWS][2];
            /* Constant R: each call unrolls into its own register tile. */
            if (left >= 4) fp8b_tile(J, m0, 4, c0, 1, sums);
            else if (left == 3) fp8b_tile(J, m0, 3, c0, 1, sums);
            else if (left == 2) fp8b_tile(J, m0, 2, c0, 1, sums);
            else fp8b_tile(J, m0, 1, c0, 1, sums);
            const int R = left >= Q8_ROWS ? Q8_ROWS : (int)left;
            for (int r = 0; r < R; r++) fp8b_emit(J, m0 + r, c0, 1, sums[r]);
        }
    }
}

int linear_fp8_block(const void *x, int64_t m, int64_t k, const uint8_t *w, const float *scale, int64_t block_n,
                     int64_t block_k, const float *bias, int64_t n, void *out, int dtype, int num_threads) {
    if (block_n <= 0 || block_k <= 0 || block_k % 8 != 0) return -2;
    float *scratch;
    const float *xf = float_rows(x, m, k, dtype, &scratch);
    if (xf == NULL) return -1;
    fp8b_job_t job = {xf, m, k, w, scale, block_n, block_k, (k + block_k - 1) / block_k, bias, n, out, dtype};
    pool_run(fp8b_part, &job, num_threads);
    free(scratch);
    return 0;
}
