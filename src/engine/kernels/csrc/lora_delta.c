/* A batch's LoRA deltas in one call per projection (engine/lora/backend.py's kernel path):
 *
 *   out[r, section i] += (x[r] . A[s]^T)[i R, (i + 1) R) . Bt[s][:, section i]      s = row_slots[r] != 0
 *
 * x [m, k] and out [m, n] float32 or bfloat16 (dtype, both alike; rows x_stride / out_stride elements apart),
 * A [slots, stacked, k] (stacked = sections x R) and Bt [slots, R, n] (each B transposed, times its slot's
 * scaling: mem_pool.py) float32 or bfloat16 (w_dtype), sections [num_sections][2] (column offset, width).
 * Rows of slot 0 are left as they are.
 *
 * Why one call: at decode sizes each torch op of the torch path (gather, batched shrink, one batched expand
 * per section, scatter, add) costs more in dispatch than in arithmetic, and a bf16 model's rows were
 * widened to float32 and the deltas added back with one more conversion each. Here the rows are sorted by
 * slot (a counting sort, per call) and cut into tiles of up to 4 rows of one slot; a tile's rows are
 * widened to float32 once (bf16), shrunk against its slot's A (each A row loaded once per tile, 4 rows x 2
 * A rows of float32 sums in registers), and each section's columns expanded 16 at a time (each Bt row
 * loaded once per tile) and added to out in registers: bf16 out is widened, summed in float32 and rounded
 * once (to nearest even, as torch's add_ of a float32 delta), so nothing but out is written. Threads
 * (thread_pool.c) take tiles one at a time. AVX2 + FMA where the compiler has them; the scalar loops do
 * the tails (k and widths not multiples of 8) and everything elsewhere, with the same float32 sums in
 * another order.
 */
#include "cpu_common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LORA_AVX2 1
#endif

#define LORA_TILE 4

typedef struct {
    const void *x;
    int64_t x_stride;
    void *out;
    int64_t out_stride, k;
    const void *a, *b;
    int w_dtype;
    int64_t stacked, rank, n;
    const int64_t *sections;
    int64_t num_sections;
    int dtype;
    const int64_t *order; /* the rows with an adapter, by slot */
    const int64_t *tiles; /* per tile: its first position in order, its row count, its slot */
    int64_t num_tiles;
    float *scratch; /* per thread: LORA_TILE rows of k, then LORA_TILE rows of stacked */
    int64_t scratch_per_thread;
    _Atomic int64_t next;
} lora_job_t;

static inline float w_at(const void *w, int64_t i, int w_dtype) {
    return w_dtype == DTYPE_BF16 ? bf16_to_f32(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

#if defined(LORA_AVX2)
static inline __attribute__((always_inline)) __m256 load8(const void *p, int64_t i, int dtype) {
    if (dtype == DTYPE_BF16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)p + i);
}


/* 8 float32 as bfloat16, rounded to nearest even (f32_to_bf16's rule, NaN kept quiet). */
static inline __attribute__((always_inline)) __m128i to_bf16x8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    /* packus pairs 128-bit lanes: 64-bit words 0 and 2 hold the 8 results in order */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

/* out[0..8) += delta, in out's dtype. */
static inline __attribute__((always_inline)) void add_out8(void *out, int64_t at, __m256 delta, int dtype) {
    if (dtype == DTYPE_BF16) {
        uint16_t *o = (uint16_t *)out + at;
        const __m256 sum = _mm256_add_ps(load8(o, 0, DTYPE_BF16), delta);
        _mm_storeu_si128((__m128i *)o, to_bf16x8(sum));
        return;
    }
    float *o = (float *)out + at;
    _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), delta));
}
#endif

/* sh[r][j] = xr[r] . A[j] for R rows and the stacked rows j of one slot's A (a: that slot's first row). */
static inline __attribute__((always_inline)) void shrink_tile(const lora_job_t *J, const float *const xr[LORA_TILE],
                                                              const int R, const void *a, int64_t a0,
                                                              float *sh, const int wd) {
    const int64_t k = J->k, stacked = J->stacked;
    int64_t j = 0;
#if defined(LORA_AVX2)
    const int64_t k8 = k / 8 * 8;
    for (; j + 2 <= stacked; j += 2) {
        __m256 acc[LORA_TILE][2];
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int64_t d = 0; d < k8; d += 8) {
            const __m256 w0 = load8(a, a0 + j * k + d, wd), w1 = load8(a, a0 + (j + 1) * k + d, wd);
            for (int r = 0; r < R; r++) {
                const __m256 xv = _mm256_loadu_ps(xr[r] + d);
                acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
            }
        }
        for (int r = 0; r < R; r++) {
            float s0 = hsum8(acc[r][0]), s1 = hsum8(acc[r][1]);
            for (int64_t d = k8; d < k; d++) {
                s0 += xr[r][d] * w_at(a, a0 + j * k + d, wd);
                s1 += xr[r][d] * w_at(a, a0 + (j + 1) * k + d, wd);
            }
            sh[r * stacked + j] = s0;
            sh[r * stacked + j + 1] = s1;
        }
    }
#endif
    for (; j < stacked; j++)
        for (int r = 0; r < R; r++) {
            float s = 0.0f;
            for (int64_t d = 0; d < k; d++) s += xr[r][d] * w_at(a, a0 + j * k + d, wd);
            sh[r * stacked + j] = s;
        }
}

/* out[rows[r], off + c] += sum_t sh[r][first + t] Bt[t][off + c] for one section of width `width` (b0: the
 * slot's Bt). */
static inline __attribute__((always_inline)) void expand_tile(const lora_job_t *J, const int64_t *rows, const int R,
                                                              const float *sh, int64_t first, int64_t b0,
                                                              int64_t off, int64_t width, const int wd,
                                                              const int dt) {
    const int64_t n = J->n, rank = J->rank, stacked = J->stacked;
    const void *b = J->b;
    int64_t c = 0;
#if defined(LORA_AVX2)
    for (; c + 16 <= width; c += 16) {
        __m256 acc[LORA_TILE][2];
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int64_t t = 0; t < rank; t++) {
            const int64_t at = b0 + t * n + off + c;
            const __m256 b0v = load8(b, at, wd), b1v = load8(b, at + 8, wd);
            for (int r = 0; r < R; r++) {
                const __m256 s = _mm256_broadcast_ss(sh + r * stacked + first + t);
                acc[r][0] = _mm256_fmadd_ps(s, b0v, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(s, b1v, acc[r][1]);
            }
        }
        for (int r = 0; r < R; r++) {
            const int64_t o = rows[r] * J->out_stride + off + c;
            add_out8(J->out, o, acc[r][0], dt);
            add_out8(J->out, o + 8, acc[r][1], dt);
        }
    }
    for (; c + 8 <= width; c += 8) {
        __m256 acc[LORA_TILE];
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t t = 0; t < rank; t++) {
            const __m256 bv = load8(b, b0 + t * n + off + c, wd);
            for (int r = 0; r < R; r++)
                acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(sh + r * stacked + first + t), bv, acc[r]);
        }
        for (int r = 0; r < R; r++) add_out8(J->out, rows[r] * J->out_stride + off + c, acc[r], dt);
    }
#endif
    for (; c < width; c++)
        for (int r = 0; r < R; r++) {
            float s = 0.0f;
            for (int64_t t = 0; t < rank; t++) s += sh[r * stacked + first + t] * w_at(b, b0 + t * n + off + c, wd);
            const int64_t o = rows[r] * J->out_stride + off + c;
            if (dt == DTYPE_BF16) {
                uint16_t *out = (uint16_t *)J->out;
                out[o] = f32_to_bf16(bf16_to_f32(out[o]) + s);
            } else {
                ((float *)J->out)[o] += s;
            }
        }
}

/* One tile: R rows (rows[0..R)) of slot `slot`. */
static inline __attribute__((always_inline)) void lora_tile(const lora_job_t *J, const int64_t *rows, const int R,
                                                            int64_t slot, float *xs, float *sh, const int wd,
                                                            const int dt) {
    const int64_t k = J->k;
    const float *xr[LORA_TILE];
    for (int r = 0; r < R; r++) {
        if (dt == DTYPE_BF16) { /* widened once per tile; every A row of the slot meets it */
            const uint16_t *src = (const uint16_t *)J->x + rows[r] * J->x_stride;
            float *dst = xs + r * k;
            int64_t d = 0;
#if defined(LORA_AVX2)
            for (; d + 8 <= k; d += 8) _mm256_storeu_ps(dst + d, load8(src, d, DTYPE_BF16));
#endif
            for (; d < k; d++) dst[d] = bf16_to_f32(src[d]);
            xr[r] = dst;
        } else {
            xr[r] = (const float *)J->x + rows[r] * J->x_stride;
        }
    }
    shrink_tile(J, xr, R, J->a, slot * J->stacked * k, sh, wd);
    const int64_t b0 = slot * J->rank * J->n;
    for (int64_t i = 0; i < J->num_sections; i++)
        expand_tile(J, rows, R, sh, i * J->rank, b0, J->sections[2 * i], J->sections[2 * i + 1], wd, dt);
}

/* Constant R, weight and activation dtypes: each combination unrolls into its own register tiles. */
static inline __attribute__((always_inline)) void lora_tile_r(const lora_job_t *J, const int64_t *rows, int R,
                                                              int64_t slot, float *xs, float *sh, const int wd,
                                                              const int dt) {
    switch (R) {
    case 4: lora_tile(J, rows, 4, slot, xs, sh, wd, dt); break;
    case 3: lora_tile(J, rows, 3, slot, xs, sh, wd, dt); break;
    case 2: lora_tile(J, rows, 2, slot, xs, sh, wd, dt); break;
    default: lora_tile(J, rows, 1, slot, xs, sh, wd, dt); break;
    }
}

static void lora_part(void *arg, int tid, int nt) {
    (void)nt;
    lora_job_t *J = (lora_job_t *)arg;
    float *xs = J->scratch + tid * J->scratch_per_thread;
    float *sh = xs + LORA_TILE * J->k;
    DYNAMIC_FOR(t, J->num_tiles, &J->next) {
        const int64_t *tile = J->tiles + 3 * t;
        const int64_t *rows = J->order + tile[0];
        const int R = (int)tile[1];
        if (J->w_dtype == DTYPE_BF16) {
            if (J->dtype == DTYPE_BF16) lora_tile_r(J, rows, R, tile[2], xs, sh, DTYPE_BF16, DTYPE_BF16);
            else lora_tile_r(J, rows, R, tile[2], xs, sh, DTYPE_BF16, DTYPE_F32);
        } else {
            if (J->dtype == DTYPE_BF16) lora_tile_r(J, rows, R, tile[2], xs, sh, DTYPE_F32, DTYPE_BF16);
            else lora_tile_r(J, rows, R, tile[2], xs, sh, DTYPE_F32, DTYPE_F32);
        }
    }
}

int lora_delta(const void *x, int64_t x_stride, void *out, int64_t out_stride, int64_t m, int64_t k,
               const int64_t *row_slots, int64_t num_slots, const void *a, const void *b, int w_dtype, int64_t rank,
               const int64_t *sections, int64_t num_sections, int64_t n, int dtype, int num_threads) {
    for (int64_t r = 0; r < m; r++)
        if (row_slots[r] < 0 || row_slots[r] >= num_slots) return -2;
    for (int64_t i = 0; i < num_sections; i++)
        if (sections[2 * i] < 0 || sections[2 * i + 1] < 0 || sections[2 * i] + sections[2 * i + 1] > n) return -2;
    /* The counting sort: count[s + 1] rows of slot s, then each slot's first position. */
    int64_t *count = (int64_t *)calloc((size_t)num_slots + 1, sizeof(int64_t));
    int64_t *order = (int64_t *)malloc(sizeof(int64_t) * (size_t)(m > 0 ? m : 1));
    /* tiles: at most m / LORA_TILE + one partial tile per slot */
    const int64_t max_tiles = m / LORA_TILE + num_slots + 1;
    int64_t *tiles = (int64_t *)malloc(sizeof(int64_t) * 3 * (size_t)max_tiles);
    int nthreads = num_threads > 1 ? num_threads : 1;
    const int64_t per_thread = LORA_TILE * (k + num_sections * rank);
    float *scratch = (float *)malloc(sizeof(float) * (size_t)(per_thread * nthreads));
    int status = -1;
    if (count == NULL || order == NULL || tiles == NULL || scratch == NULL) goto done;
    for (int64_t r = 0; r < m; r++) count[row_slots[r] + 1]++;
    for (int64_t s = 0; s < num_slots; s++) count[s + 1] += count[s];
    for (int64_t r = 0; r < m; r++) order[count[row_slots[r]]++] = r; /* count[s]: past slot s's rows now */
    int64_t num_tiles = 0;
    for (int64_t s = 1, begin = count[0]; s < num_slots; begin = count[s], s++)
        for (int64_t p = begin; p < count[s]; p += LORA_TILE) {
            tiles[3 * num_tiles] = p;
            tiles[3 * num_tiles + 1] = count[s] - p < LORA_TILE ? count[s] - p : LORA_TILE;
            tiles[3 * num_tiles + 2] = s;
            num_tiles++;
        }
    if (num_tiles < nthreads) nthreads = num_tiles > 0 ? (int)num_tiles : 1;
    lora_job_t job = {x, x_stride, out, out_stride, k, a, b, w_dtype, num_sections * rank, rank, n, sections,
                      num_sections, dtype, order, tiles, num_tiles, scratch, per_thread, 0};
    if (num_tiles > 0) pool_run(lora_part, &job, nthreads);
    status = 0;
done:
    free(count);
    free(order);
    free(tiles);
    free(scratch);
    return status;
}
