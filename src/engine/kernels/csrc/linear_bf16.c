/* bfloat16 linear layers for small batches (decode) on CPUs with AVX512-BF16.
 *
 * y = x W^T (+ b) with x [M, K], W [N, K]. A decode step reads every weight once and does only
 * 2 M FLOPs per weight element, so it is bound by streaming the weights from memory (M = 1) or by
 * the multiply rate (M = 16 to 64 on this kind of CPU). The general GEMM kernels behind F.linear reach
 * neither there: measured on a 2-core AMD EPYC, oneDNN's pre-packed bf16 linear ran a model's worth
 * of decode matmuls (weights far larger than the caches) at ~145 GFLOP/s per core at M = 16, where
 * one core does ~480 with vdpbf16ps.
 *
 * Layout: W is packed once into panels of 64 output columns; a panel holds, for each pair of input
 * features k, 2k+1, the 64 columns' two weights side by side (the operand layout of vdpbf16ps), so a
 * panel is one sequential stream of K x 128 bytes. The micro-kernel (cpu_common.h's panel_tile_sums,
 * which attention's products share) keeps 6 rows x 64 columns of float32 sums in 24 registers and,
 * per pair of input features, broadcasts each row's two x values against the panel's four 16-column
 * vectors. A panel is read from memory once and from cache for the batch's further row tiles, while
 * the next panel is prefetched (when there are several row tiles). Threads (thread_pool.c) take
 * contiguous ranges of panels. Sums are float32, rounded once to bfloat16 at the end (the bias is
 * added before rounding). On CPUs with AMX the same panels feed the tile unit instead (below, from
 * two rows up; ENGINE_CPU_AMX=0 keeps vdpbf16ps).
 */
#define _GNU_SOURCE /* syscall() */
#include "amx.h"

#include <sys/syscall.h>
#include <unistd.h>

#define PANEL 64 /* output columns per panel */
#define ROWS TILE_ROWS /* rows per register tile (cpu_common.h) */

typedef struct {
    const uint16_t *w;
    int64_t n, k;
    uint16_t *packed;
} pack_job_t;

static void pack_part(void *arg, int tid, int nt) {
    const pack_job_t *J = (const pack_job_t *)arg;
    const int64_t n = J->n, k = J->k, panels = (n + PANEL - 1) / PANEL, pairs = k / 2;
    int64_t first, last;
    pool_range(panels, tid, nt, &first, &last);
    for (int64_t p = first; p < last; p++) {
        uint16_t *dst = J->packed + p * pairs * PANEL * 2;
        for (int64_t kk = 0; kk < pairs; kk++)
            for (int64_t c = 0; c < PANEL; c++) {
                const int64_t col = p * PANEL + c;
                dst[(kk * PANEL + c) * 2] = col < n ? J->w[col * k + 2 * kk] : 0;
                dst[(kk * PANEL + c) * 2 + 1] = col < n ? J->w[col * k + 2 * kk + 1] : 0;
            }
    }
}

/* packed: [ceil(N / 64)][K / 2][64][2]; columns past N are zero. K must be even. */
void pack_linear_bf16(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed, int num_threads) {
    pack_job_t job = {w, n, k, packed};
    pool_run(pack_part, &job, num_threads);
}

#if defined(__AVX512BF16__)
/* Where a tile's sums go: rounded to bf16 into out (STORE); rounded, into the float32 scratch `gate`
 * [ROWS][PANEL] (GATE); or, as silu(gate) * sums with the rounding of cpu_ops.c's silu_and_mul, into
 * out (SILU_MUL). */
enum { STORE = 0, GATE = 1, SILU_MUL = 2 };

/* One 16-column vector of a tile's sums y (bias added) where `mode` sends it: dst is its place in
 * out, g its place in the gate scratch. */
static inline __attribute__((always_inline)) void emit(__m512 y, const int mode, uint16_t *dst, __mmask16 mask,
                                                       float *gate, int64_t g) {
    if (mode == STORE) {
        _mm256_mask_storeu_epi16(dst, mask, (__m256i)_mm512_cvtneps_pbh(y));
    } else if (mode == GATE) {
        _mm512_storeu_ps(gate + g, round_bf16_512(y));
    } else { /* out's width is the gate half's here, whole panels: no mask */
        const __m512 v = silu_mul_512(_mm512_loadu_ps(gate + g), round_bf16_512(y), DTYPE_BF16);
        _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh(v));
    }
}

static inline __attribute__((always_inline)) void tile(const uint16_t *x, int64_t k, const uint16_t *panel,
                                                       const char *ahead, int64_t ahead_lines, int64_t m0, const int R,
                                                       const float *bias, int64_t col0, int64_t n, uint16_t *out,
                                                       const int mode, float *gate) {
    __m512 acc[ROWS * 4];
    panel_tile_sums(acc, x + m0 * k, k, k / 2, panel, R, ahead, ahead_lines);
    for (int q = 0; q < 4; q++) {
        const int64_t c = col0 + q * 16;
        if (c >= n) break;
        const __mmask16 mask = n - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - c)) - 1u);
        const __m512 b = bias != NULL ? _mm512_maskz_loadu_ps(mask, bias + c) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++)
            emit(_mm512_add_ps(acc[r * 4 + q], b), mode, out + (m0 + r) * n + c, mask, gate,
                 r * PANEL + q * 16);
    }
}

typedef struct {
    const uint16_t *x, *packed;
    int64_t m, k, n;
    const float *bias;
    uint16_t *out;
    uint16_t *xp; /* AMX: x packed tile by tile (amx_part), or NULL */
} linear_job_t;

static void linear_part(void *arg, int id, int nt) {
    const linear_job_t *j = (const linear_job_t *)arg;
    const int64_t m = j->m, k = j->k, n = j->n;
    const int64_t panels = (n + PANEL - 1) / PANEL, panel_elems = k * PANEL;
    /* Contiguous ranges: each thread streams its own part of the weights. */
    int64_t first, last;
    pool_range(panels, id, nt, &first, &last);
    for (int64_t p = first; p < last; p++) {
        const uint16_t *panel = j->packed + p * panel_elems;
        /* With several row tiles the next panel is prefetched while this one is multiplied, a share
         * per tile, so that its reads spread over the whole panel's time instead of the first tile's.
         * A single tile (up to ROWS rows) streams the panels in order with no arithmetic to hide the
         * reads behind, where the hardware prefetchers alone do better: on 2 MiB pages (the packed
         * weights are, engine/utils/huge_pages.py), 2-core AMD EPYC Zen 4, a model's worth of linears
         * at 1-6 rows ran at 29-37 GB/s without software prefetches against 25-29 with them. */
        const int64_t tiles = (m + ROWS - 1) / ROWS, lines = panel_elems * 2 / 64;
        const char *ahead = p + 1 < last && tiles > 1 ? (const char *)(panel + panel_elems) : NULL;
#define TILE_ARGS(rows) j->x, k, panel, ahead ? ahead + t * lines / tiles * 64 : NULL, \
            ahead ? (t + 1) * lines / tiles - t * lines / tiles : 0, m0, rows, j->bias, p * PANEL, n, j->out, STORE, NULL
        FOR_ROW_TILES(m, ROWS, t, m0, rows) {
            switch (rows) {
            case 1: tile(TILE_ARGS(1)); break;
            case 2: tile(TILE_ARGS(2)); break;
            case 3: tile(TILE_ARGS(3)); break;
            case 4: tile(TILE_ARGS(4)); break;
            case 5: tile(TILE_ARGS(5)); break;
            default: tile(TILE_ARGS(ROWS)); break;
            }
        }
#undef TILE_ARGS
    }
}

/* out [M, N/2] = silu(x W_gate^T) * (x W_up^T) with W = [W_gate; W_up] packed as one [N, K] weight (gate_up),
 * N/2 a multiple of PANEL: the gate_up linear and SiLU-and-mul in one pass, bit for bit as the two
 * (each product rounded to bf16 first). Gate panel p and up panel p + N/2/PANEL are computed
 * one row tile after the other; the gate tile's sums wait in L1, so the [M, N] product is never
 * written out and read back. */
static void gate_up_part(void *arg, int id, int nt) {
    const linear_job_t *j = (const linear_job_t *)arg;
    const int64_t m = j->m, k = j->k, half = j->n / 2;
    const int64_t pairs = half / PANEL, panel_elems = k * PANEL;
    const int64_t tiles = (m + ROWS - 1) / ROWS, lines = panel_elems * 2 / 64;
    const float *bias_up = j->bias != NULL ? j->bias + half : NULL;
    float gate[ROWS * PANEL];
    int64_t first, last;
    pool_range(pairs, id, nt, &first, &last);
    for (int64_t p = first; p < last; p++) {
        const uint16_t *gp = j->packed + p * panel_elems, *up = j->packed + (p + pairs) * panel_elems;
        /* the next pair's two panels, a share per row tile (none for a single tile, as in linear_part) */
        const char *ga = p + 1 < last && tiles > 1 ? (const char *)(gp + panel_elems) : NULL;
        const char *ua = p + 1 < last && tiles > 1 ? (const char *)(up + panel_elems) : NULL;
#define SHARE(a) a ? a + t * lines / tiles * 64 : NULL, a ? (t + 1) * lines / tiles - t * lines / tiles : 0
#define PAIR(rows)                                                                                          \
    tile(j->x, k, gp, SHARE(ga), m0, rows, j->bias, p * PANEL, half, j->out, GATE, gate);                \
    tile(j->x, k, up, SHARE(ua), m0, rows, bias_up, p * PANEL, half, j->out, SILU_MUL, gate)
        FOR_ROW_TILES(m, ROWS, t, m0, rows) {
            switch (rows) {
            case 1: PAIR(1); break;
            case 2: PAIR(2); break;
            case 3: PAIR(3); break;
            case 4: PAIR(4); break;
            case 5: PAIR(5); break;
            default: PAIR(ROWS); break;
            }
        }
#undef PAIR
#undef SHARE
    }
}

#if defined(HAVE_AMX)
/* The same products on AMX (amx.h), where vdpbf16ps is the slow way: on the 2-core Xeon with AMX a
 * model's worth of linears ran at ~210 GFLOP/s with the tiles above at any batch, where oneDNN's
 * AMX matmul reached 1.0-1.9 TFLOP/s from 128 rows up. A block of up to 16 rows x a panel goes to a
 * scratch block of sums and out through emit(), as the tiles above do. x is first packed tile by
 * tile (amx_pack_x); with 16 rows or fewer the tiles are configured to the batch's row count. */
/* Linux gives a process AMX's 8 KiB of tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM,
 * feature 18, XTILEDATA); the permission covers all of its threads. */
static int amx_granted;
__attribute__((constructor)) static void amx_request(void) { amx_granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0; }
static int amx_wanted = 1; /* amx_set (ENGINE_CPU_AMX) */
int amx_active(void) { return amx_granted && amx_wanted; }

/* emit() for the first R rows of a sums block: rows m0.. of out, columns col0.. */
static inline void amx_emit(const float *sums, int64_t R, int64_t m0, const float *bias, int64_t col0, int64_t n,
                            uint16_t *out, const int mode, float *gate) {
    for (int q = 0; q < 4; q++) {
        const int64_t c = col0 + q * 16;
        if (c >= n) break;
        const __mmask16 mask = n - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - c)) - 1u);
        const __m512 b = bias != NULL ? _mm512_maskz_loadu_ps(mask, bias + c) : _mm512_setzero_ps();
        for (int64_t r = 0; r < R; r++)
            emit(_mm512_add_ps(_mm512_loadu_ps(sums + r * PANEL + q * 16), b), mode, out + (m0 + r) * n + c, mask,
                 gate, r * PANEL + q * 16);
    }
}

/* x packed for the A tiles: xp[block i][k / 32][16 rows][32], rows past m zero, so that a tile is 1 KiB
 * in one piece (x's own rows are 2k bytes apart: the 16 lines of a tile fall into two of L1's 64
 * sets and evict each other). Each thread packs a share of the tiles. */
static void amx_pack_x(const linear_job_t *j, int id, int nt) {
    const int64_t steps = j->k / 32, tiles = (j->m + AMX_ROWS - 1) / AMX_ROWS * steps;
    int64_t first, last;
    pool_range(tiles, id, nt, &first, &last);
    for (int64_t t = first; t < last; t++) {
        const int64_t i = t / steps, s = t % steps;
        uint16_t *dst = j->xp + t * AMX_ROWS * 32;
        for (int64_t r = 0; r < AMX_ROWS; r++) {
            const int64_t row = i * AMX_ROWS + r;
            if (row < j->m) memcpy(dst + r * 32, j->x + row * j->k + s * 32, 64);
            else memset(dst + r * 32, 0, 64);
        }
    }
}

/* Row block i of the packed x. */
static inline const uint16_t *amx_rows(const linear_job_t *j, int64_t i) { return j->xp + i * AMX_ROWS * j->k; }

static inline int64_t amx_block_rows(int64_t m, int64_t i) { return m - i * AMX_ROWS < AMX_ROWS ? m - i * AMX_ROWS : AMX_ROWS; }

/* Rows per pass over a thread's panels: x's rows of a pass stay in L2 while the panels go by (a
 * model's worth of linears at 2,048 rows: 307 ms in one pass, 271 in passes of 256). */
#define AMX_CHUNK_ROWS 256

/* The blocks of rows [r0, r1) x panel p (two panels for gate_up: gate then up), the next panel
 * (pair) prefetched into L2 a share per block, a single block included (2-core Xeon, a model's worth
 * of linears, in one process: 4 rows 9.1-9.3 -> 8.6-9.1 ms, 16 rows 9.4-9.5 -> 9.3-9.4; two panels
 * ahead no better). */
static inline void amx_panel(const linear_job_t *j, int64_t p, int64_t r0, int64_t r1, int prefetch_next,
                             const int gate_up, float *sums, float *gate) {
    const int64_t m = j->m, k = j->k, panel_elems = k * PANEL;
    const int64_t half = j->n / 2, up_panel = half / PANEL;
    const uint16_t *panel = j->packed + p * panel_elems, *up = panel + up_panel * panel_elems;
    const int64_t b0 = r0 / AMX_ROWS, blocks = (r1 - r0 + AMX_ROWS - 1) / AMX_ROWS;
    const int64_t lines = prefetch_next ? panel_elems * 2 / 64 : 0;
    const float *bias_up = j->bias != NULL ? j->bias + half : NULL;
    for (int64_t t = 0; t < blocks;) {
        const int64_t i = b0 + t, two = t + 1 < blocks; /* two whole blocks at once where there are */
        const int64_t share = (t + 1 + two) * lines / blocks - t * lines / blocks;
        const int64_t skip = t * lines / blocks * 64; /* bytes into the next panel */
        const int64_t rows = amx_block_rows(m, i) + (two ? amx_block_rows(m, i + 1) : 0);
        const uint16_t *a = amx_rows(j, i);
        for (int u = 0; u <= gate_up; u++) { /* gate_up: the gate panel, then the up panel */
            const uint16_t *w = u ? up : panel;
            const char *ahead = lines ? (const char *)(w + panel_elems) + skip : NULL;
            if (two) amx_block2(a, amx_rows(j, i + 1), 512, 32, w, k, sums, PANEL, ahead, share);
            else amx_block(a, 512, 32, w, k, sums, PANEL, ahead, share);
            if (!gate_up) amx_emit(sums, rows, i * AMX_ROWS, j->bias, p * PANEL, j->n, j->out, STORE, NULL);
            else if (!u) amx_emit(sums, rows, i * AMX_ROWS, j->bias, p * PANEL, half, j->out, GATE, gate);
            else amx_emit(sums, rows, i * AMX_ROWS, bias_up, p * PANEL, half, j->out, SILU_MUL, gate);
        }
        t += 1 + two;
    }
}

static inline void amx_part(const linear_job_t *j, int id, int nt, const int gate_up) {
    const int64_t panels = gate_up ? j->n / 2 / PANEL : (j->n + PANEL - 1) / PANEL;
    float sums[2 * AMX_ROWS * PANEL] __attribute__((aligned(64))), gate[2 * AMX_ROWS * PANEL];
    amx_pack_x(j, id, nt);
    pool_barrier(nt);
    int64_t first, last;
    pool_range(panels, id, nt, &first, &last);
    if (first >= last) return;
    amx_configure(j->m < AMX_ROWS ? (int)j->m : AMX_ROWS);
    for (int64_t r0 = 0; r0 < j->m; r0 += AMX_CHUNK_ROWS) {
        const int64_t r1 = r0 + AMX_CHUNK_ROWS < j->m ? r0 + AMX_CHUNK_ROWS : j->m;
        for (int64_t p = first; p < last; p++) amx_panel(j, p, r0, r1, p + 1 < last, gate_up, sums, gate);
    }
    _tile_release();
}

static void amx_linear_part(void *arg, int id, int nt) { amx_part((const linear_job_t *)arg, id, nt, 0); }
static void amx_gate_up_part(void *arg, int id, int nt) { amx_part((const linear_job_t *)arg, id, nt, 1); }

/* Runs the job on AMX where it can (returns 1; 0: the caller runs the tiles above). */
static int amx_run(linear_job_t *job, pool_fn part, int num_threads) {
    /* One row is a pure stream of the weights, which the tiles above read a little faster (2-core
     * Xeon, a model's worth of linears: 8.4-8.6 against 8.9-9.3 ms). */
    if (!amx_active() || job->k % 32 != 0 || job->m < 2) return 0;
    const size_t bytes = sizeof(uint16_t) * (size_t)((job->m + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS * job->k);
    job->xp = (uint16_t *)aligned_alloc(64, bytes); /* a multiple of 64: k % 32 == 0 */
    if (job->xp == NULL) return 0;
    pool_run(part, job, num_threads);
    free(job->xp);
    return 1;
}

void amx_set(int on) { amx_wanted = on; }
#else
static int amx_run(linear_job_t *job, pool_fn part, int num_threads) {
    (void)job; (void)part; (void)num_threads;
    return 0;
}
#define amx_linear_part NULL
#define amx_gate_up_part NULL
void amx_set(int on) { (void)on; }
int amx_active(void) { return 0; }
#endif

/* out [M, N] bf16 = x [M, K] bf16 @ W^T (+ bias, float32 [N] or NULL); W packed by pack_linear_bf16. */
void linear_bf16(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed, int64_t n, const float *bias,
                 uint16_t *out, int num_threads) {
    linear_job_t job = {x, packed, m, k, n, bias, out, NULL};
    if (m <= 0) return;
    if (!amx_run(&job, amx_linear_part, num_threads)) pool_run(linear_part, &job, num_threads);
}

void linear_bf16_silu_mul(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                          const float *bias, uint16_t *out, int num_threads) {
    linear_job_t job = {x, packed, m, k, n, bias, out, NULL};
    if (m <= 0) return;
    if (!amx_run(&job, amx_gate_up_part, num_threads)) pool_run(gate_up_part, &job, num_threads);
}

int linear_bf16_available(void) { return 1; }
#else
void linear_bf16_silu_mul(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                          const float *bias, uint16_t *out, int num_threads) {
    (void)x; (void)m; (void)k; (void)packed; (void)n; (void)bias; (void)out; (void)num_threads;
}

void linear_bf16(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed, int64_t n, const float *bias,
                 uint16_t *out, int num_threads) {
    (void)x; (void)m; (void)k; (void)packed; (void)n; (void)bias; (void)out; (void)num_threads;
}

int linear_bf16_available(void) { return 0; }
void amx_set(int on) { (void)on; }
int amx_active(void) { return 0; }
#endif
