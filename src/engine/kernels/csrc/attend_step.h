/* One online-softmax step of attention for up to 32 query rows over up to ATTN_KEYS keys (bfloat16):
 * prefill attention (extend_attention.c) walks a request's keys in such steps, and so does a cascade
 * group's shared prefix in decode_attention.c. The keys come as K^T and V panels (cpu_common.h's
 * pack_k_panels / pack_v_panels), so both products are row blocks times panels of 64 columns:
 * S = Q K^T, then O = P V with P rounded to bfloat16, as flash attention does. They run on the AMX
 * tiles where the CPU has them (amx.h) and as register-tiled vdpbf16ps otherwise (cpu_common.h's
 * panel_tile_sums, the tile of linear_bf16.c's linears too). The softmax between them is the same for
 * both.
 */
#ifndef ENGINE_CPU_ATTEND_STEP_H
#define ENGINE_CPU_ATTEND_STEP_H
#include "amx.h"

#if defined(__AVX512BF16__)
#define ATTN_KEYS 256 /* keys per step, a multiple of 64 */
#define ATTN_ROWS 32  /* query rows per step at most */
#define ATTN_RT TILE_ROWS /* rows per register tile (cpu_common.h) */

/* A step's scores and P (48 KiB) stay in this scratch; only the rows' state lives across steps. */
typedef struct {
    float *s;     /* [ATTN_ROWS][ATTN_KEYS]: S of the step, unscaled */
    uint16_t *pb; /* [ATTN_ROWS][ATTN_KEYS]: P as bfloat16, zero past each row's visible keys */
    float *o;     /* [ATTN_ROWS][ceil(dim / 64) * 64]: P V of the step */
} attn_scratch_t;

static inline void attn_scratch_alloc(attn_scratch_t *w, int64_t dim) {
    w->s = (float *)aligned_alloc(64, sizeof(float) * ATTN_ROWS * ATTN_KEYS);
    w->pb = (uint16_t *)calloc(ATTN_ROWS * ATTN_KEYS, sizeof(uint16_t));
    w->o = (float *)aligned_alloc(64, sizeof(float) * (size_t)(ATTN_ROWS * ((dim + 63) / 64 * 64)));
}

static inline void attn_scratch_free(attn_scratch_t *w) {
    free(w->s);
    free(w->pb);
    free(w->o);
}

/* c[r][0..64) (float32, row stride c_stride) = panel_tile_sums of R rows of a (bf16, row stride a_stride). */
static inline __attribute__((always_inline)) void attn_tile(const uint16_t *a, int64_t a_stride, int64_t pairs,
                                                            const uint16_t *panel, const int R, float *c,
                                                            int64_t c_stride, const char *ahead, int64_t lines) {
    __m512 acc[ATTN_RT * 4];
    panel_tile_sums(acc, a, a_stride, pairs, panel, R, ahead, lines);
    for (int q = 0; q < 4; q++)
        for (int r = 0; r < R; r++) _mm512_storeu_ps(c + r * c_stride + q * 16, acc[r * 4 + q]);
}

/* attn_tile over `rows` rows in tiles of even sizes (FOR_ROW_TILES); the lines from `ahead` on are
 * prefetched a share per tile. */
static inline void attn_rows(const uint16_t *a, int64_t a_stride, int64_t rows, int64_t pairs, const uint16_t *panel,
                             float *c, int64_t c_stride, const char *ahead, int64_t lines) {
    if (rows <= 0) return;
    const int64_t tiles = (rows + ATTN_RT - 1) / ATTN_RT;
    FOR_ROW_TILES(rows, ATTN_RT, t, r, n) {
        const uint16_t *ar = a + r * a_stride;
        float *cr = c + r * c_stride;
        const char *at = ahead + t * lines / tiles * 64;
        const int64_t lt = (t + 1) * lines / tiles - t * lines / tiles;
        switch (n) {
        case 1: attn_tile(ar, a_stride, pairs, panel, 1, cr, c_stride, at, lt); break;
        case 2: attn_tile(ar, a_stride, pairs, panel, 2, cr, c_stride, at, lt); break;
        case 3: attn_tile(ar, a_stride, pairs, panel, 3, cr, c_stride, at, lt); break;
        case 4: attn_tile(ar, a_stride, pairs, panel, 4, cr, c_stride, at, lt); break;
        case 5: attn_tile(ar, a_stride, pairs, panel, 5, cr, c_stride, at, lt); break;
        default: attn_tile(ar, a_stride, pairs, panel, ATTN_RT, cr, c_stride, at, lt); break;
        }
    }
}

/* c (row stride c_stride) = the nr rows of a (row stride a_stride) x the panel's 64 columns over k
 * inputs (k a multiple of 32): on the tiles (configured for 16 rows by the caller; a's rows past nr,
 * up to a multiple of 16, finite) or in registers; `lines` cache lines from `ahead` on are prefetched
 * into L2 meanwhile. */
static inline void attn_product(const uint16_t *a, int64_t a_stride, int64_t nr, int64_t k, const uint16_t *panel,
                                float *c, int64_t c_stride, const char *ahead, int64_t lines, int amx) {
#if defined(HAVE_AMX)
    if (amx) {
        const int64_t blocks = (nr + AMX_ROWS - 1) / AMX_ROWS;
        for (int64_t b = 0; b < blocks; b++)
            amx_block(a + b * AMX_ROWS * a_stride, 32, a_stride, panel, k, c + b * AMX_ROWS * c_stride, c_stride,
                      ahead + b * lines / blocks * 64, (b + 1) * lines / blocks - b * lines / blocks);
        return;
    }
#endif
    (void)amx;
    attn_rows(a, a_stride, nr, k / 2, panel, c, c_stride, ahead, lines);
}

/* 2^x for x <= 0 (16 lanes), for P: k + f with k an integer and |f| <= 1/2, 2^f by its Taylor
 * polynomial of degree 4 (relative error below 5e-5, where P's bfloat16 rounding is 4e-3), times 2^k.
 * 8 instructions where exp512 takes 14: the softmax of a step is a fifth of its time on AVX512-BF16. */
static inline __m512 exp2_for_p(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
    const __m512 k = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, k);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(9.6181291e-3f), f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, k);
}

/* One step over up to ATTN_KEYS keys: their K^T panels from kp on (64 keys a panel), their V pairs
 * from vp on in panels v_panel elements apart (pairs past the step's keys, up to 32 keys' worth, zero
 * or finite). qa: [nr][dim] bf16 (for AMX, rows up to a multiple of 16, the extra ones finite). Row r
 * sees the first vis[r] (<= ATTN_KEYS) keys of the step. The rows' state: m (running max of the
 * scaled scores), l (sum of exp), acc [nr][dim] (unnormalised output). Meanwhile `ahead_bytes` from
 * `ahead` on (the next step's panels, where they lie in memory already) are requested into L2. */
static inline void attend_step(const uint16_t *qa, int64_t nr, int64_t dim, const uint16_t *kp, const uint16_t *vp,
                               int64_t v_panel, const int64_t *vis, float scale, float *m, float *l, float *acc,
                               attn_scratch_t *w, const char *ahead, int64_t ahead_bytes, int amx) {
    const int64_t pairs = dim / 2, dpanels = (dim + 63) / 64, ostride = dpanels * 64;
    int64_t most = 0;
    for (int64_t r = 0; r < nr; r++) most = vis[r] > most ? vis[r] : most;
    const int64_t kdim = (most + 31) / 32 * 32, kpanels = (most + 63) / 64;
    /* the lines ahead, a share per product (the K^T panels' and the V panels') */
    const int64_t lines = ahead != NULL ? ahead_bytes / 64 : 0, products = kpanels + dpanels;
    if (ahead == NULL) ahead = (const char *)kp; /* a base for no lines */
#define AHEAD(i) ahead + (i) * lines / products * 64, ((i) + 1) * lines / products - (i) * lines / products
    for (int64_t p = 0; p < kpanels; p++)
        attn_product(qa, dim, nr, dim, kp + p * pairs * 128, w->s + p * 64, ATTN_KEYS, AHEAD(p), amx);
    float corr[ATTN_ROWS];
    const float log2e = 1.44269504088896341f;
    const __m512 sv = _mm512_set1_ps(scale * log2e);
    for (int64_t r = 0; r < nr; r++) { /* scores scaled here: the scaled max is the max scaled */
        const float *sr = w->s + r * ATTN_KEYS;
        uint16_t *pr = w->pb + r * ATTN_KEYS;
        const int64_t n = vis[r];
        int64_t c = 0;
        if (n > 0) {
            const float mt = fmaxf(m[r], max_of(sr, n) * scale);
            corr[r] = expf(m[r] - mt); /* 0 at the first keys (m = -inf) */
            m[r] = mt;
            const __m512 mv = _mm512_set1_ps(mt * log2e); /* exp(s scale - mt) = 2^(s scale log2e - mt log2e) */
            __m512 sum = _mm512_setzero_ps();
            for (; c + 16 <= n; c += 16) {
                const __m512 e = exp2_for_p(_mm512_fmsub_ps(_mm512_loadu_ps(sr + c), sv, mv));
                sum = _mm512_add_ps(sum, e);
                _mm256_storeu_si256((__m256i *)(pr + c), (__m256i)_mm512_cvtneps_pbh(e));
            }
            if (c < n) {
                const __mmask16 live = (__mmask16)((1u << (n - c)) - 1u);
                const __m512 e = _mm512_maskz_mov_ps(live, exp2_for_p(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(live, sr + c), sv, mv)));
                sum = _mm512_add_ps(sum, e);
                _mm256_storeu_si256((__m256i *)(pr + c), (__m256i)_mm512_cvtneps_pbh(e));
                c += 16;
            }
            l[r] = l[r] * corr[r] + _mm512_reduce_add_ps(sum);
        } else {
            corr[r] = 1.f; /* nothing visible in this step: the state stays */
        }
        for (; c < kdim; c += 16) _mm256_storeu_si256((__m256i *)(pr + c), _mm256_setzero_si256());
    }
    if (kdim == 0) return;
    for (int64_t dp = 0; dp < dpanels; dp++)
        attn_product(w->pb, ATTN_KEYS, nr, kdim, vp + dp * v_panel, w->o + dp * 64, ostride, AHEAD(kpanels + dp), amx);
#undef AHEAD
    for (int64_t r = 0; r < nr; r++) {
        if (vis[r] == 0) continue;
        const __m512 cv = _mm512_set1_ps(corr[r]);
        float *a = acc + r * dim;
        const float *o = w->o + r * ostride;
        for (int64_t d = 0; d < dim; d += 16) {
            const __mmask16 live = dim - d >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (dim - d)) - 1u);
            _mm512_mask_storeu_ps(a + d, live, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, a + d), cv,
                                                               _mm512_maskz_loadu_ps(live, o + d)));
        }
    }
}
#endif
#endif
