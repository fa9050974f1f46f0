/* AMX tiles (Intel Xeon since Sapphire Rapids) for the bf16 products of linear_bf16.c and
 * extend_attention.c. Both multiply rows of bf16 by panels of 64 columns laid out for vdpbf16ps:
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
    for (int t = 0; t < 5; t++) { /* C0-3, A */
        c.rows[t] = (uint8_t)rows;
        c.colsb[t] = 64;
    }
    for (int t = 6; t < 8; t++) { /* B */
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* c[r][0..64) (float32, row stride c_stride) = a[r][0..k) (bf16, row stride a_stride) x panel for the
 * configured rows; k a multiple of 32. Meanwhile `lines` cache lines from `ahead` on are prefetched
 * into L2, spread over the iterations (the next panel, for callers that stream panels). */
static inline void amx_block(const uint16_t *a, int64_t a_stride, const uint16_t *panel, int64_t k, float *c,
                             int64_t c_stride, const char *ahead, int64_t lines) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    int64_t line = 0;
    for (int64_t k0 = 0; k0 < k; k0 += 32) {
        const uint16_t *b = panel + k0 * AMX_PANEL; /* pair k0 / 2, column 0 */
        for (const int64_t upto = (k0 + 32) * lines / k; line < upto; line++) _mm_prefetch(ahead + line * 64, _MM_HINT_T1);
        _tile_loadd(4, a + k0, a_stride * 2);
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
#endif
#endif
