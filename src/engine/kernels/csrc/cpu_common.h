/* Helpers shared by the native CPU kernels: bfloat16 <-> float32 and a vectorised exp. */
#ifndef ENGINE_CPU_COMMON_H
#define ENGINE_CPU_COMMON_H
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine_kernels.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

/* A linear's weight format in the decode chain and the MoE experts (layer_t's *_format, moe_experts' format):
 * bf16 panels (linear_bf16.c), int8 with int8 activations (linear_w8a8), 4-bit codes against float or int8
 * activations (linear_q4, linear_w4a8), e4m3 against bf16 rows (linear_q8). */
enum { CHAIN_BF16 = 0, CHAIN_W8A8 = 1, CHAIN_Q4 = 2, CHAIN_W4A8 = 3, CHAIN_FP8 = 4 };
/* decoder_layers.c: out [bs, n] (bf16) = x [bs, k] (bf16) W^T (+ bias: bf16 panels only) in `format`; scale and
 * offset per channel (8-bit) or per group (4-bit, `group` inputs), NULL for bf16. Aborts where it cannot allocate
 * scratch (inside a decode step there is no way back). */
void format_linear(const void *x, int64_t bs, int64_t k, int format, const void *w, const float *scale,
                   const float *offset, int64_t group, int64_t n, const float *bias, void *out, int nt);

/* thread_pool.c: run fn(ctx, tid, nthreads) on nthreads threads (the caller is tid 0). */
typedef void (*pool_fn)(void *ctx, int tid, int nthreads);
void pool_run(pool_fn fn, void *ctx, int nthreads);
void pool_barrier(int nthreads);
void pool_range(int64_t n, int tid, int nt, int64_t *lo, int64_t *hi);
/* m rows in ceil(m / most) register tiles of sizes as even as can be, the bigger ones first (128 rows
 * by 6 at most: 18 of 6 and 4 of 5, where 6 at a time left a tile of 2 that runs at half the rate):
 * tile t holds `rows` rows from m0 on (m > 0). Used by the register-tiled products of linear_bf16.c
 * and attend_step.h, whose row sums are the same whatever the tile's size. */
#define FOR_ROW_TILES(m, most, t, m0, rows)                                                              \
    for (int64_t t = 0, tiles_ = ((m) + (most) - 1) / (most), m0 = 0, rows = (m) / tiles_ + ((m) % tiles_ > 0); \
         t < tiles_; m0 += rows, t++, rows = (m) / tiles_ + (t < (m) % tiles_))

/* A loop whose iterations the job's threads take one at a time (OpenMP's schedule(dynamic, 1)). */
#define DYNAMIC_FOR(t, n, counter) \
    for (int64_t t = atomic_fetch_add((counter), 1); t < (n); t = atomic_fetch_add((counter), 1))

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)x << 16;
    return c.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } c;
    c.f = f;
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40u); /* NaN stays NaN */
    c.u += 0x7fffu + ((c.u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(c.u >> 16);
}

/* dim consecutive elements as float32: in place for float32, converted into tmp for bfloat16. */
static inline const float *load_row(const void *base, int64_t offset, int64_t dim, int dtype, float *tmp) {
    if (dtype == DTYPE_F32) return (const float *)base + offset;
    const uint16_t *src = (const uint16_t *)base + offset;
    int64_t d = 0;
#if defined(__AVX512F__)
    for (; d + 16 <= dim; d += 16) {
        __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + d)));
        _mm512_storeu_ps(tmp + d, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
    }
#endif
    for (; d < dim; d++) tmp[d] = bf16_to_f32(src[d]);
    return tmp;
}

/* n float32 values written as the tensor dtype (bfloat16: rounded to nearest even). */
static inline void store_row(void *base, int64_t offset, const float *src, int64_t n, int dtype) {
    if (dtype == DTYPE_F32) {
        memcpy((float *)base + offset, src, sizeof(float) * (size_t)n);
        return;
    }
    uint16_t *dst = (uint16_t *)base + offset;
    int64_t i = 0;
#if defined(__AVX512BF16__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
#endif
    for (; i < n; i++) dst[i] = f32_to_bf16(src[i]);
}

/* The largest of x[0..n) (-inf for n = 0). */
static inline float max_of(const float *x, int64_t n) {
    float m = -INFINITY;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 v = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= n; i += 16) v = _mm512_max_ps(v, _mm512_loadu_ps(x + i));
    m = _mm512_reduce_max_ps(v);
#endif
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

#if defined(__AVX512F__)
/* x rounded to bfloat16 (nearest even, as f32_to_bf16) and widened back to float32, 16 lanes. */
static inline __m512 round_bf16_512(__m512 x) {
#if defined(__AVX512BF16__)
    const __m256i b = (__m256i)_mm512_cvtneps_pbh(x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
#else
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    const __m512 rounded = _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
    return _mm512_mask_mov_ps(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x); /* NaN stays NaN */
#endif
}

/* round_bf16_512 for bfloat16 tensors, the identity for float32 ones. */
static inline __m512 round_to_512(__m512 x, int dtype) { return dtype == DTYPE_BF16 ? round_bf16_512(x) : x; }

/* exp(x), Cephes' single-precision polynomial with the range reduction by ln 2 (about 1 ulp). */
static inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
    __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, k);
}

/* silu(g) * u as SiluAndMul rounds it: silu(g) rounded to the tensor dtype, times u (16 lanes). */
static inline __m512 silu_mul_512(__m512 g, __m512 u, int dtype) {
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    return _mm512_mul_ps(round_to_512(silu, dtype), u);
}
#endif

#if defined(__AVX512BF16__)
/* The K and V of one KV head at pool slots `slots[0..n)` (head offset koff in a slot) packed for the
 * register-tiled and AMX products of extend_attention.c and decode_attention.c, panels of 64. */

/* r[j][i] = r[i][j], 16 x 16 dwords. */
static inline void transpose_16x16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

#if defined(__AVX512BF16__)
#define TILE_ROWS 6 /* rows of a register tile of panel_tile_sums */

/* The register tile of the bf16 products (linear_bf16.c's linears, attend_step.h's Q K^T and P V):
 * acc[r * 4 + q] = sum over pairs kk < pairs of a_r[2kk .. 2kk + 1] . panel[kk][16q .. 16q + 16][0 .. 1]
 * for R <= TILE_ROWS rows a_r = a + r * a_stride (bf16) against a panel of 64 columns, each pair of
 * inputs its columns' two weights side by side (the operand layout of vdpbf16ps): the R x 64 float32
 * sums in 4R registers, each row's pair broadcast against the panel's four vectors. Meanwhile
 * `lines` cache lines from `ahead` on are requested into L2, spread evenly over the iterations. */
static inline __attribute__((always_inline)) void panel_tile_sums(__m512 *acc, const uint16_t *a, int64_t a_stride,
                                                                  int64_t pairs, const uint16_t *panel, const int R,
                                                                  const char *ahead, int64_t lines) {
#pragma GCC unroll 24 /* in registers: left as a loop, GCC zeroed them with a memset call per tile */
    for (int i = 0; i < R * 4; i++) acc[i] = _mm512_setzero_ps();
    int64_t owed = 0; /* lines / pairs lines an iteration, without a division in the loop */
    for (int64_t kk = 0; kk < pairs; kk++) {
        for (owed += lines; owed >= pairs; owed -= pairs, ahead += 64) _mm_prefetch(ahead, _MM_HINT_T1);
        const __m512i *wv = (const __m512i *)(panel + kk * 128);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wv), w1 = (__m512bh)_mm512_loadu_si512(wv + 1);
        const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wv + 2), w3 = (__m512bh)_mm512_loadu_si512(wv + 3);
        for (int r = 0; r < R; r++) {
            uint32_t pair;
            memcpy(&pair, a + r * a_stride + 2 * kk, 4);
            const __m512bh x = (__m512bh)_mm512_set1_epi32((int)pair);
            acc[r * 4] = _mm512_dpbf16_ps(acc[r * 4], x, w0);
            acc[r * 4 + 1] = _mm512_dpbf16_ps(acc[r * 4 + 1], x, w1);
            acc[r * 4 + 2] = _mm512_dpbf16_ps(acc[r * 4 + 2], x, w2);
            acc[r * 4 + 3] = _mm512_dpbf16_ps(acc[r * 4 + 3], x, w3);
        }
    }
}
#endif

/* K^T panels: kp[p][kk][c][2] = K[key 64p + c][2kk .. 2kk + 1] for whole panels, zero past n.
 * pairs = head_dim / 2. With pairs a multiple of 16, 16 keys' rows are loaded and transposed in
 * registers 16 pairs at a time; otherwise each pair of 16 keys is one gather (dword offsets of
 * their rows; the pool fits 32-bit offsets), which is 2-3x slower. */
static inline void pack_k_panels(const uint16_t *k, int64_t k_stride, const int64_t *slots, int64_t n, int64_t koff,
                                 int64_t pairs, uint16_t *kp) {
    for (int64_t p = 0; p < (n + 63) / 64; p++)
        for (int64_t c0 = 0; c0 < 64; c0 += 16) {
            uint32_t *dst = (uint32_t *)(kp + p * pairs * 128) + c0;
            if (pairs % 16 == 0) {
                for (int64_t q0 = 0; q0 < pairs; q0 += 16) {
                    __m512i r[16];
                    for (int c = 0; c < 16; c++) {
                        const int64_t key = p * 64 + c0 + c;
                        r[c] = key < n ? _mm512_loadu_si512(k + slots[key] * k_stride + koff + 2 * q0)
                                       : _mm512_setzero_si512();
                    }
                    transpose_16x16_epi32(r);
                    for (int j = 0; j < 16; j++) _mm512_storeu_si512(dst + (q0 + j) * 64, r[j]);
                }
                continue;
            }
            int32_t offs[16];
            __mmask16 live = 0;
            for (int c = 0; c < 16; c++) {
                const int64_t key = p * 64 + c0 + c;
                offs[c] = key < n ? (int32_t)((slots[key] * k_stride + koff) / 2) : 0;
                live |= key < n ? (__mmask16)(1u << c) : 0;
            }
            const __m512i vo = _mm512_loadu_si512(offs);
            for (int64_t kk = 0; kk < pairs; kk++) {
                const __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live,
                                                              _mm512_add_epi32(vo, _mm512_set1_epi32((int)kk)),
                                                              (const int *)k, 4);
                _mm512_storeu_si512(dst + kk * 64, g);
            }
        }
}

/* V panels: vp[dp][j][c][2] = V[key 2j .. 2j + 1][64 dp + c], zero past n and past dim, vpairs >=
 * ceil(n / 2) pairs a panel (the rest zero): two rows interleaved element-wise by one permute per
 * 16 dimensions. */
static inline void pack_v_panels(const uint16_t *v, int64_t v_stride, const int64_t *slots, int64_t n, int64_t koff,
                                 int64_t dim, int64_t vpairs, uint16_t *vp) {
    const int64_t kpairs = (n + 1) / 2;
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t dp = 0; dp < (dim + 63) / 64; dp++) {
        uint16_t *panel = vp + dp * vpairs * 128;
        memset(panel + kpairs * 128, 0, sizeof(uint16_t) * (size_t)((vpairs - kpairs) * 128));
        const int64_t d0 = dp * 64, nd = dim - d0 < 64 ? dim - d0 : 64;
        for (int64_t j = 0; j < kpairs; j++) {
            const uint16_t *v0 = v + slots[2 * j] * v_stride + koff + d0;
            const uint16_t *v1 = 2 * j + 1 < n ? v + slots[2 * j + 1] * v_stride + koff + d0 : NULL;
            uint16_t *dst = panel + j * 128;
            for (int64_t c = 0; c < 64; c += 32) { /* 32 dimensions -> two interleaved vectors */
                const __mmask32 m = c >= nd ? 0 : nd - c >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << (nd - c)) - 1u);
                const __m512i a = _mm512_maskz_loadu_epi16(m, v0 + c);
                const __m512i b = v1 != NULL ? _mm512_maskz_loadu_epi16(m, v1 + c) : _mm512_setzero_si512();
                _mm512_storeu_si512(dst + 2 * c, _mm512_permutex2var_epi16(a, lo, b));
                _mm512_storeu_si512(dst + 2 * c + 32, _mm512_permutex2var_epi16(a, hi, b));
            }
        }
    }
}
#endif
#if defined(__AVX2__)
/* The sum of a vector's 8 float32 lanes, in one fixed order (every kernel's horizontal sum). */
static inline __attribute__((always_inline)) float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* Quantize row x (float32) into q (int8) and a (|q|, or NULL: not wanted), zero from k to kp; returns x_scale
 * (linear_w8a8.c's per-row scale, linear_q4.c's per group). The vector and
 * scalar loops compute the same float32 product and round it the same way (to nearest even). */
static inline float quantize_int8_row(const float *x, int64_t k, int64_t kp, int8_t *q, uint8_t *a) {
    float amax = 0.0f;
    int64_t d = 0;
#if defined(__AVX2__)
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 vmax = _mm256_setzero_ps();
    for (; d + 8 <= k; d += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(x + d), magnitude));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    amax = _mm_cvtss_f32(m4);
#endif
    for (; d < k; d++) amax = fmaxf(amax, fabsf(x[d]));
    amax = fmaxf(amax, 1e-10f);
    const float inv = 127.0f / amax;
    d = 0;
#if defined(__AVX2__)
    const __m256 vinv = _mm256_set1_ps(inv), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    for (; d + 32 <= k; d += 32) {
        __m256i v[4];
        for (int j = 0; j < 4; j++) {
            __m256 f = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + d + 8 * j), vinv),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(f, lo), hi));
        }
        /* packs interleave the 128-bit lanes: the permute puts the 32 bytes back in order */
        const __m256i b = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3])),
            _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + d), b);
        if (a != NULL) _mm256_storeu_si256((__m256i *)(a + d), _mm256_abs_epi8(b));
    }
#endif
    for (; d < k; d++) {
        const float v = fminf(fmaxf(nearbyintf(x[d] * inv), -127.0f), 127.0f);
        q[d] = (int8_t)v;
        if (a != NULL) a[d] = (uint8_t)(v < 0 ? -v : v);
    }
    for (d = k; d < kp; d++) {
        q[d] = 0;
        if (a != NULL) a[d] = 0;
    }
    return amax / 127.0f;
}

#endif
