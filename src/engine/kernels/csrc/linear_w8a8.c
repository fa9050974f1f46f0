/* linear_w8a8: out = (q_x . W^T) * x_scale * scale (+ bias), SGLang's w8a8_int8: each row of x quantized
 * to int8 here, symmetric per row (per token): x_scale = max(max |x|, 1e-10) / 127, q_x = round(x * (127 /
 * max)) to nearest even, the products summed exactly in int32 (|sum| <= 127 * 127 * k), then converted to
 * float32 once: every path below gives the same bits.
 *
 * AVX2 has no signed x signed byte product: vpmaddubsw multiplies unsigned bytes by signed ones, adding
 * pairs into int16 with saturation. So the row is stored as |q_x| (unsigned) and each weight vector gets
 * q_x's signs (vpsignb: w * sign(q_x)), which keeps every product's sign, and a pair of products is at most
 * 2 * 127 * 127 = 32258 in magnitude: never saturated (weights are quantized to [-127, 127], never -128).
 * vpmaddwd with ones adds pairs of those into int32 lanes. Per 32 weights that is a load, vpsignb,
 * vpmaddubsw, vpmaddwd and an add, where the float kernels of linear_q8.c widen 8 weights with two
 * conversions: measured on the 2-core Zen 1 with the weights in L2, one row ran at ~0.16 ns per weight
 * through the float kernel against ~0.04 here, so a decode step's int8 linears stay below the memory
 * bandwidth.
 *
 * AVX512-VNNI (Xeons since Cascade Lake, Zen 4 on): vpdpbusd multiplies 64 unsigned bytes by 64 signed ones
 * and adds each 4 products into an int32 lane, exactly (no int16 step). The same split of q_x into |q_x| and
 * its signs; AVX-512 has no vpsignb, so a weight vector is negated where q_x is negative by a subtraction
 * from zero under the mask of q_x's sign bits (computed once per row and 64 inputs). 64 weights cost a load,
 * the masked subtraction and vpdpbusd.
 *
 * AMX-INT8 (Xeons since Sapphire Rapids), from W8A8_AMX_MIN_ROWS rows where k is a multiple of 64: tdpbssd
 * multiplies a 16 x 64 tile of signed bytes by a 64 x 16 one into 16 x 16 int32 sums. The product is taken
 * transposed, out^T = W . q_x^T, so that the A tiles are the weight as it lies (16 channels' 64 consecutive
 * inputs, rows k bytes apart: no repacking of W at load) and the B tiles are q_x, packed here as tdpbssd
 * reads them (line j of a tile: inputs 4j .. 4j + 3 of row 0, then of row 1, ... of row 15; rows past m are
 * zeros; amx.h's amx_pack_rows). With one block of 16 rows (decode), four C tiles hold 4 blocks of 16 channels
 * against it, the B tile loaded once per four products; with more rows, 2 channel blocks by 2 row blocks (each
 * tile loaded feeds two products). Channels past the last whole block of 16 take the vector paths.
 */
#include "amx.h"

#if defined(__AVX2__)
#include <immintrin.h>
#define W8A8_AVX2 1
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define W8A8_VNNI 1
#endif
#if defined(HAVE_AMX) && defined(__AMX_INT8__)
#define W8A8_AMX 1
#define W8A8_AMX_MIN_ROWS 2
#endif

typedef struct {
    const uint8_t *xa; /* [m][kp] |q_x|, zero past k */
    const int8_t *xq; /* [m][kp] q_x, zero past k */
    const float *xs; /* [m] x_scale */
    int64_t m, k, kp;
    const int8_t *w;
    const float *scale, *bias;
    int64_t n;
    void *out;
    int dtype;
    const int8_t *xt; /* AMX: q_x packed into B tiles (amx_pack_rows), or NULL: the vector paths */
} w8a8_job_t;

static inline void w8a8_emit(const w8a8_job_t *J, int64_t row, int64_t c, int32_t sum) {
    float y = (float)sum * J->xs[row] * J->scale[c];
    if (J->bias != NULL) y += J->bias[c];
    const int64_t at = row * J->n + c;
    if (J->dtype == DTYPE_BF16) ((uint16_t *)J->out)[at] = f32_to_bf16(y);
    else ((float *)J->out)[at] = y;
}

#if defined(W8A8_AVX2)
static inline __attribute__((always_inline)) int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}
#endif

/* sums[r][c] = q_x[m0 + r] . W[c0 + c] for R rows and C channels (R * C <= 8), exact: 64 inputs at a time
 * with VNNI, then 32 with AVX2, then one. */
static inline __attribute__((always_inline)) void w8a8_tile(const w8a8_job_t *J, int64_t m0, const int R, int64_t c0,
                                                            const int C, int32_t sums[4][4]) {
    const int64_t k = J->k, kp = J->kp;
    int64_t d = 0;
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) sums[r][c] = 0;
#if defined(W8A8_VNNI)
    {
        const __m512i zero = _mm512_setzero_si512();
        __m512i acc[4][4];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) acc[r][c] = zero;
        for (; d + 64 <= k; d += 64) {
            __m512i wv[4];
            for (int c = 0; c < C; c++) wv[c] = _mm512_loadu_si512((const void *)(J->w + (c0 + c) * k + d));
            for (int r = 0; r < R; r++) {
                const __m512i a = _mm512_loadu_si512((const void *)(J->xa + (m0 + r) * kp + d));
                const __mmask64 neg = _mm512_movepi8_mask(_mm512_loadu_si512((const void *)(J->xq + (m0 + r) * kp + d)));
                for (int c = 0; c < C; c++)
                    acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], a, _mm512_mask_sub_epi8(wv[c], neg, zero, wv[c]));
            }
        }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) sums[r][c] += _mm512_reduce_add_epi32(acc[r][c]);
    }
#endif
#if defined(W8A8_AVX2)
    {
        const __m256i ones = _mm256_set1_epi16(1);
        __m256i acc[4][4];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_si256();
        for (; d + 32 <= k; d += 32) {
            __m256i wv[4];
            for (int c = 0; c < C; c++) wv[c] = _mm256_loadu_si256((const __m256i *)(J->w + (c0 + c) * k + d));
            for (int r = 0; r < R; r++) {
                const __m256i a = _mm256_loadu_si256((const __m256i *)(J->xa + (m0 + r) * kp + d));
                const __m256i q = _mm256_loadu_si256((const __m256i *)(J->xq + (m0 + r) * kp + d));
                for (int c = 0; c < C; c++) {
                    const __m256i pairs = _mm256_maddubs_epi16(a, _mm256_sign_epi8(wv[c], q));
                    acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(pairs, ones));
                }
            }
        }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) sums[r][c] += hsum_epi32(acc[r][c]);
    }
#endif
    for (; d < k; d++)
        for (int c = 0; c < C; c++) {
            const int32_t wq = J->w[(c0 + c) * k + d];
            for (int r = 0; r < R; r++) sums[r][c] += wq * (int32_t)J->xq[(m0 + r) * kp + d];
        }
}

#if defined(W8A8_AVX2)
/* One row (a batch-1 decode step), channel groups [first, last) of 4 whole channels, k a multiple of 32: the
 * same sums as w8a8_tile(R = 1, C = 4), with a software prefetch. A group's 4 channels are 4 KiB-ish of
 * contiguous bytes read as 4 short interleaved streams (k bytes each), too short for the hardware prefetcher
 * to ramp up on: measured on the 2-core Zen 1, one thread, a model's worth of weights (90 MB) from memory,
 * 0.17 ns per weight without, 0.10 with (the bytes of the next group fetched while this one is summed, two
 * cache lines per 32 inputs: exactly the next group by the end of this one); 2 or 4 groups ahead were no
 * better. The prefetch stops at the weight's end. */
static void w8a8_one_row(const w8a8_job_t *J, int64_t first, int64_t last) {
    const int64_t k = J->k;
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t *end = J->w + J->n * k;
    for (int64_t g = first; g < last; g++) {
        const int8_t *w = J->w + 4 * g * k, *next = w + 4 * k;
        __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                          _mm256_setzero_si256()};
        for (int64_t d = 0; d < k; d += 32) {
            if (next + 4 * d + 128 <= end) {
                _mm_prefetch((const char *)(next + 4 * d), _MM_HINT_T0);
                _mm_prefetch((const char *)(next + 4 * d + 64), _MM_HINT_T0);
            }
            const __m256i a = _mm256_loadu_si256((const __m256i *)(J->xa + d));
            const __m256i q = _mm256_loadu_si256((const __m256i *)(J->xq + d));
            for (int c = 0; c < 4; c++) {
                const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + c * k + d));
                acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(wv, q)), ones));
            }
        }
        for (int c = 0; c < 4; c++) w8a8_emit(J, 0, 4 * g + c, hsum_epi32(acc[c]));
    }
}
#endif

#if defined(W8A8_VNNI)
/* w8a8_one_row with VNNI, k a multiple of 64: 64 inputs a step, the next group prefetched 4 lines a step. */
static void w8a8_one_row_vnni(const w8a8_job_t *J, int64_t first, int64_t last) {
    const int64_t k = J->k;
    const __m512i zero = _mm512_setzero_si512();
    const int8_t *end = J->w + J->n * k;
    for (int64_t g = first; g < last; g++) {
        const int8_t *w = J->w + 4 * g * k, *next = w + 4 * k;
        __m512i acc[4] = {zero, zero, zero, zero};
        for (int64_t d = 0; d < k; d += 64) {
            if (next + 4 * d + 256 <= end)
                for (int l = 0; l < 4; l++) _mm_prefetch((const char *)(next + 4 * d + 64 * l), _MM_HINT_T0);
            const __m512i a = _mm512_loadu_si512((const void *)(J->xa + d));
            const __mmask64 neg = _mm512_movepi8_mask(_mm512_loadu_si512((const void *)(J->xq + d)));
            for (int c = 0; c < 4; c++) {
                const __m512i wv = _mm512_loadu_si512((const void *)(w + c * k + d));
                acc[c] = _mm512_dpbusd_epi32(acc[c], a, _mm512_mask_sub_epi8(wv, neg, zero, wv));
            }
        }
        for (int c = 0; c < 4; c++) w8a8_emit(J, 0, 4 * g + c, _mm512_reduce_add_epi32(acc[c]));
    }
}
#endif

/* Channel groups [first, last) of 4 (the last one may be short) for every row: 2 rows x 4 channels per tile
 * (the weights' vectors loaded once per two rows), an odd last row alone. */
static void w8a8_groups(const w8a8_job_t *J, int64_t first, int64_t last) {
    for (int64_t g = first; g < last; g++) {
        const int64_t c0 = 4 * g;
        const int C = J->n - c0 >= 4 ? 4 : (int)(J->n - c0);
        for (int64_t m0 = 0; m0 < J->m; m0 += 2) {
            const int R = J->m - m0 >= 2 ? 2 : 1;
            int32_t sums[4][4];
#define W8A8_TILE(rows, cols) w8a8_tile(J, m0, rows, c0, cols, sums)
            if (R == 2) { switch (C) { case 4: W8A8_TILE(2, 4); break; case 3: W8A8_TILE(2, 3); break; case 2: W8A8_TILE(2, 2); break; default: W8A8_TILE(2, 1); } }
            else { switch (C) { case 4: W8A8_TILE(1, 4); break; case 3: W8A8_TILE(1, 3); break; case 2: W8A8_TILE(1, 2); break; default: W8A8_TILE(1, 1); } }
#undef W8A8_TILE
            for (int r = 0; r < R; r++)
                for (int c = 0; c < C; c++) w8a8_emit(J, m0 + r, c0 + c, sums[r][c]);
        }
    }
}

/* The vector paths: each thread a range of channel groups; one row takes the one-row loops where k allows
 * (whole groups of 4 channels; a partial last group goes to w8a8_groups). */
static void w8a8_part(void *arg, int tid, int nt) {
    const w8a8_job_t *J = (const w8a8_job_t *)arg;
    int64_t first, last;
    pool_range((J->n + 3) / 4, tid, nt, &first, &last);
    if (J->m == 1) {
        const int64_t whole = J->n / 4, upto = last < whole ? last : whole;
        int done = 0;
#if defined(W8A8_VNNI)
        if (J->k % 64 == 0) {
            w8a8_one_row_vnni(J, first, upto);
            done = 1;
        }
#endif
#if defined(W8A8_AVX2)
        if (!done && J->k % 32 == 0) {
            w8a8_one_row(J, first, upto);
            done = 1;
        }
#endif
        if (done) {
            if (last <= whole) return;
            first = first > whole ? first : whole;
        }
    }
    w8a8_groups(J, first, last);
}

#if defined(W8A8_AMX)
/* sums[i] (16 channels x 16 rows, int32, channel-major) = channel block i of the 4 from w (rows k bytes apart) .
 * the rows of B tile block b, over k inputs. (Prefetching the next group's 64 rows into L2 as these are summed,
 * 64 lines a step, did not pay: 24 streamed 2816 x 1024 weights, one thread on the 2-core Xeon, four alternated
 * runs, best of each: 2 / 16 rows 0.219 / 0.242 ms a weight with it, 0.147 / 0.173 without.) */
static inline void amx_i8_four(const int8_t *w, int64_t k, const int8_t *b, int32_t sums[4][256]) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t d = 0; d < k; d += 64) {
        _tile_loadd(6, b + d * AMX_ROWS, 64);
        _tile_loadd(4, w + d, k);
        _tile_dpbssd(0, 4, 6);
        _tile_loadd(5, w + 16 * k + d, k);
        _tile_dpbssd(1, 5, 6);
        _tile_loadd(4, w + 32 * k + d, k);
        _tile_dpbssd(2, 4, 6);
        _tile_loadd(5, w + 48 * k + d, k);
        _tile_dpbssd(3, 5, 6);
    }
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    _tile_stored(2, sums[2], 64);
    _tile_stored(3, sums[3], 64);
}

/* Two channel blocks (w, w + 16 rows) by two row blocks (b0, b1): sums[2 * i + j] = channel block i . row block
 * j; every tile loaded feeds two products (amx_i8_four's A tiles feed one). */
static inline void amx_i8_square(const int8_t *w, int64_t k, const int8_t *b0, const int8_t *b1, int32_t sums[4][256]) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t d = 0; d < k; d += 64) {
        _tile_loadd(4, w + d, k);
        _tile_loadd(6, b0 + d * AMX_ROWS, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_loadd(7, b1 + d * AMX_ROWS, 64);
        _tile_dpbssd(1, 4, 7);
        _tile_loadd(5, w + 16 * k + d, k);
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
    }
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    _tile_stored(2, sums[2], 64);
    _tile_stored(3, sums[3], 64);
}

/* amx_i8_four for one block of 16 channels. */
static inline void amx_i8_one(const int8_t *w, int64_t k, const int8_t *b, int32_t sums[256]) {
    _tile_zero(0);
    for (int64_t d = 0; d < k; d += 64) {
        _tile_loadd(6, b + d * AMX_ROWS, 64);
        _tile_loadd(4, w + d, k);
        _tile_dpbssd(0, 4, 6);
    }
    _tile_stored(0, sums, 64);
}

/* The outputs of one C tile: channels c0 .. c0 + 15 of rows r0 .. r0 + 15 (those below m), w8a8_emit's
 * operations in its order. */
static void amx_i8_emit(const w8a8_job_t *J, const int32_t *sums, int64_t c0, int64_t r0) {
    const int64_t rows = J->m - r0 < AMX_ROWS ? J->m - r0 : AMX_ROWS;
    const __m512 scale = _mm512_loadu_ps(J->scale + c0);
    const __m512 bias = J->bias != NULL ? _mm512_loadu_ps(J->bias + c0) : _mm512_setzero_ps();
    for (int64_t t = 0; t < rows; t++) {
        __m512 y = _mm512_mul_ps(_mm512_mul_ps(amx_row_epi32(sums, t), _mm512_set1_ps(J->xs[r0 + t])), scale);
        if (J->bias != NULL) y = _mm512_add_ps(y, bias);
        amx_store16(J->out, (r0 + t) * J->n + c0, y, J->dtype);
    }
}

/* One block of rows (up to 16: decode): each thread a range of groups of 4 channel blocks (the last group may
 * hold fewer), streaming the weights once. More rows: groups of 2 channel blocks (32 channels' weights, which
 * stay in L1 at k up to 1536 and in L2 beyond) against every pair of row blocks. The last thread also takes the
 * channels past the last whole block on the vector paths. */
static void amx_i8_part(void *arg, int tid, int nt) {
    const w8a8_job_t *J = (const w8a8_job_t *)arg;
    const int64_t k = J->k, blocks = J->n / 16, row_blocks = (J->m + AMX_ROWS - 1) / AMX_ROWS;
    const int64_t per = row_blocks == 1 ? 4 : 2; /* channel blocks a group */
    int32_t sums[4][256] __attribute__((aligned(64)));
    int64_t first, last;
    pool_range((blocks + per - 1) / per, tid, nt, &first, &last);
    if (first < last) {
        amx_configure(AMX_ROWS);
        for (int64_t g = first; g < last; g++) {
            const int64_t cb = per * g, count = blocks - cb < per ? blocks - cb : per;
            const int8_t *w = J->w + cb * 16 * k;
            if (row_blocks == 1 && count == 4) {
                amx_i8_four(w, k, J->xt, sums);
                for (int64_t i = 0; i < 4; i++) amx_i8_emit(J, sums[i], (cb + i) * 16, 0);
                continue;
            }
            int64_t rb = 0;
            for (; count == 2 && rb + 2 <= row_blocks; rb += 2) {
                const int8_t *b0 = J->xt + rb * AMX_ROWS * k;
                amx_i8_square(w, k, b0, b0 + AMX_ROWS * k, sums);
                for (int64_t i = 0; i < 4; i++) amx_i8_emit(J, sums[i], (cb + i / 2) * 16, (rb + i % 2) * AMX_ROWS);
            }
            for (; rb < row_blocks; rb++)
                for (int64_t i = 0; i < count; i++) {
                    amx_i8_one(w + i * 16 * k, k, J->xt + rb * AMX_ROWS * k, sums[0]);
                    amx_i8_emit(J, sums[0], (cb + i) * 16, rb * AMX_ROWS);
                }
        }
        _tile_release();
    }
    if (tid == nt - 1 && blocks * 16 < J->n) w8a8_groups(J, blocks * 4, (J->n + 3) / 4);
}
#endif

int linear_w8a8(const void *x, int64_t m, int64_t k, const int8_t *w, const float *scale, const float *bias,
                int64_t n, void *out, int dtype, float *x_scale, int num_threads) {
    const int64_t kp = (k + 31) / 32 * 32;
    /* the float32 row, then x's scales where the caller wants none back (x_scale NULL) */
    float *row = (float *)malloc(sizeof(float) * (size_t)(k + m));
    uint8_t *xa = (uint8_t *)malloc((size_t)(2 * m * kp));
    if (row == NULL || xa == NULL) {
        free(row);
        free(xa);
        return -1;
    }
    if (x_scale == NULL) x_scale = row + k;
    int8_t *xq = (int8_t *)(xa + m * kp);
    for (int64_t r = 0; r < m; r++)
        x_scale[r] = quantize_int8_row(load_row(x, r * k, k, dtype, row), k, kp, xq + r * kp, xa + r * kp);
    w8a8_job_t job = {xa, xq, x_scale, m, k, kp, w, scale, bias, n, out, dtype, NULL};
    pool_fn part = w8a8_part;
#if defined(W8A8_AMX)
    int8_t *xt = NULL;
    if (amx_active() && m >= W8A8_AMX_MIN_ROWS && k % 64 == 0 && n >= 16) {
        xt = (int8_t *)aligned_alloc(64, (size_t)((m + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS * k));
        if (xt != NULL) {
            amx_pack_rows(xq, kp, m, k / 4, (uint32_t *)xt);
            job.xt = xt;
            part = amx_i8_part;
        }
    }
#endif
    pool_run(part, &job, num_threads);
#if defined(W8A8_AMX)
    free(xt);
#endif
    free(row);
    free(xa);
    return 0;
}
