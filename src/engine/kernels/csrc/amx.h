/* AMX tiles (Intel Xeon since Sapphire Rapids) for the bf16 products of linear_bf16.c and
 * attend_step.h (prefill attention and decode_attention.c's cascade phase 1). All multiply rows of bf16 by panels of
 * 64 columns laid out for vdpbf16ps:
 * panel[pair kk][column c][2] = (B[2kk][c], B[2kk + 1][c]), one pair of the inner dimension per
 * 256-byte row. That is AMX's B layout as it lies: a B tile is 16 pairs (rows 256 bytes apart) x 16
 * columns of two bf16 (64 bytes), and an A tile is 16 rows x 32 consecutive bf16 of the left
 * operand. Up to 16 rows x one panel is four C tiles (tmm0-3) fed by one A tile (tmm4) and four B
 * tiles (tmm6, tmm7 in turn) per 32 of the inner dimension; the sums are float32, as vdpbf16ps's.
 */
#ifndef ENGINE_CPU_AMX_H
#define ENGINE_CPU_AMX_H
#include "cpu_common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#define AMX_ROWS 16
#define AMX_PANEL 64

/* Whether the kernels may use the tiles now: Linux granted the process their state and
 * ENGINE_CPU_AMX did not turn them off (linear_bf16.c). */
int amx_active(void);

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config_t;

/* Tiles for `rows` <= 16 rows of A and C; each thread configures its own before using them and
 * releases them after (_tile_release). */
static inline void amx_configure(int rows) {
    amx_config_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 6; t++) { /* C0-3, A (two for amx_block2) */
        c.rows[t] = (uint8_t)rows;
        c.colsb[t] = 64;
    }
    for (int t = 6; t < 8; t++) { /* B */
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    /* GCC does not see that ldtilecfg reads the 64 bytes: without this it drops the stores above as
     * dead (seen with gcc 12 at -O3: only the palette byte was written, and the tiles faulted). */
    __asm__ volatile("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}

/* c[r][0..64) (float32, row stride c_stride) = a[r][0..k) x panel for the configured rows; k a
 * multiple of 32. The A tile of columns k0 .. k0 + 32 lies at a + k0 / 32 * a_step with rows a_stride
 * elements apart: a_step 32 for rows as they lie (a_stride their row length), 512 for A packed tile
 * by tile (a_stride 32). Meanwhile `lines` cache lines from `ahead` on are prefetched into L2, spread
 * over the iterations (the next panel, for callers that stream panels). */
static inline void amx_block(const uint16_t *a, int64_t a_step, int64_t a_stride, const uint16_t *panel, int64_t k,
                             float *c, int64_t c_stride, const char *ahead, int64_t lines) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    int64_t line = 0;
    for (int64_t k0 = 0; k0 < k; k0 += 32) {
        const uint16_t *b = panel + k0 * AMX_PANEL; /* pair k0 / 2, column 0 */
        for (const int64_t upto = (k0 + 32) * lines / k; line < upto; line++) _mm_prefetch(ahead + line * 64, _MM_HINT_T1);
        _tile_loadd(4, a + k0 / 32 * a_step, a_stride * 2);
        _tile_loadd(6, b, AMX_PANEL * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, b + 32, AMX_PANEL * 4);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(6, b + 64, AMX_PANEL * 4);
        _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(7, b + 96, AMX_PANEL * 4);
        _tile_dpbf16ps(3, 4, 7);
    }
    _tile_stored(0, c, c_stride * 4);
    _tile_stored(1, c + 16, c_stride * 4);
    _tile_stored(2, c + 32, c_stride * 4);
    _tile_stored(3, c + 48, c_stride * 4);
}

/* amx_block for two blocks of 16 rows at once (a0, a1: c's rows 0-15 and 16-31), each half of the
 * panel's columns in turn as 2 x 2 C tiles fed by two A (tmm4, tmm5) and two B tiles (tmm6, tmm7),
 * so that every tile loaded feeds two products (amx_block's B tiles feed one): 1 KiB of loads per
 * product against 1.25. Both blocks must hold 16 configured rows. */
static inline void amx_block2(const uint16_t *a0, const uint16_t *a1, int64_t a_step, int64_t a_stride,
                              const uint16_t *panel, int64_t k, float *c, int64_t c_stride, const char *ahead,
                              int64_t lines) {
    int64_t line = 0;
    for (int h = 0; h < 2; h++) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k0 = 0; k0 < k; k0 += 32) {
            const uint16_t *b = panel + k0 * AMX_PANEL + h * 64;
            for (const int64_t upto = (h * k + k0 + 32) * lines / (2 * k); line < upto; line++)
                _mm_prefetch(ahead + line * 64, _MM_HINT_T1);
            _tile_loadd(4, a0 + k0 / 32 * a_step, a_stride * 2);
            _tile_loadd(6, b, AMX_PANEL * 4);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, b + 32, AMX_PANEL * 4);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, a1 + k0 / 32 * a_step, a_stride * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, c + h * 32, c_stride * 4);
        _tile_stored(1, c + h * 32 + 16, c_stride * 4);
        _tile_stored(2, c + AMX_ROWS * c_stride + h * 32, c_stride * 4);
        _tile_stored(3, c + AMX_ROWS * c_stride + h * 32 + 16, c_stride * 4);
    }
}


/* Row t of a 16 x 16 C tile stored channel-major (tile[channel * 16 + row]): the 16 channels' sums of that row,
 * gathered from the tile's column; the products taken transposed (below) emit their outputs row by row this way. */
static inline __m512 amx_row_ps(const float *tile, int64_t t) {
    return _mm512_i32gather_ps(_mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240),
                               tile + t, 4);
}

/* amx_row_ps of an int32 tile, converted to float32. */
static inline __m512 amx_row_epi32(const int32_t *tile, int64_t t) {
    return _mm512_cvtepi32_ps(_mm512_i32gather_epi32(
        _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240), tile + t, 4));
}

/* 16 float32 outputs written at out[at ..] as dtype (bf16: rounded to nearest even). */
static inline void amx_store16(void *out, int64_t at, __m512 y, int dtype) {
    if (dtype == DTYPE_F32) {
        _mm512_storeu_ps((float *)out + at, y);
        return;
    }
#if defined(__AVX512BF16__)
    _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), (__m256i)_mm512_cvtneps_pbh(y));
#else
    float lanes[16];
    _mm512_storeu_ps(lanes, y);
    for (int c = 0; c < 16; c++) ((uint16_t *)out)[at + c] = f32_to_bf16(lanes[c]);
#endif
}

/* Rows as B tiles for the products taken transposed (out^T = W . x^T: linear_w8a8.c, linear_q8.c, linear_q4.c):
 * row 16b + i's 4-byte words (4 int8 inputs or 2 bf16 ones each), word j at word (b * words + j) * 16 + i of xt,
 * rows past m zero; `stride`: bytes from one row to the next. A B tile of block b is then 16 consecutive words of
 * each of its 16 rows: the 1 KiB at xt + (b * words + j0) * 16 words. */
static inline void amx_pack_rows(const void *x, int64_t stride, int64_t m, int64_t words, uint32_t *xt) {
    for (int64_t b = 0; b < (m + AMX_ROWS - 1) / AMX_ROWS; b++)
        for (int i = 0; i < AMX_ROWS; i++) {
            const int64_t row = b * AMX_ROWS + i;
            uint32_t *to = xt + b * words * AMX_ROWS + i;
            for (int64_t j = 0; j < words; j++) {
                uint32_t word = 0;
                if (row < m) memcpy(&word, (const uint8_t *)x + row * stride + 4 * j, 4);
                to[j * AMX_ROWS] = word;
            }
        }
}
#endif
#endif
