/* Prefill (extend) attention for the CPU with bfloat16 data and AVX512-BF16, read from the paged pool.
 *
 * Every new token of a request attends causally to the request's cached prefix and to the new tokens
 * up to itself. For one (request, KV head) the query rows are the new tokens x the query heads of that
 * KV head, so both products are small matrix multiplications: S = Q K^T over the request's keys and
 * O = P V. Torch's CPU SDPA ran these at ~70 GFLOP/s per core with a mask or GQA on this kind of CPU;
 * here K and V are packed once per task into the vdpbf16ps operand layout (panels of 64 keys for
 * Q K^T, panels of 64 head dimensions for P V) and multiplied with the register-tiled micro-kernel of
 * linear_bf16.c, query rows in blocks. S is float32; the softmax is float32 per row over the keys the
 * row may see (the causal limit); P is rounded to bfloat16 for P V, as flash attention does. Key
 * panels past a row block's last visible key are skipped, so a prompt without prefix costs about
 * half of the square. Where the CPU has AMX (amx.h) the same panels go through the tiles, 16 query
 * rows at a time.
 */
#include "amx.h"

#if defined(__AVX512BF16__)
#define PANEL 64
#define RT 6     /* rows per register tile */
#define RBLOCK 96 /* query rows per block (a multiple of RT and of AMX_ROWS) */

/* c[r][0..ncols) (float32, row stride c_stride) = sum over pairs kk of a[r][2kk..2kk+1] . panel[kk][col][0..1]
 * for R rows of a (bf16, row stride a_stride); a panel holds 64 columns x pairs, vdpbf16ps layout. */
static inline __attribute__((always_inline)) void micro(const uint16_t *a, int64_t a_stride, int64_t pairs,
                                                        const uint16_t *panel, const int R, float *c,
                                                        int64_t c_stride, int64_t ncols, float scale) {
    __m512 acc[RT * 4];
    for (int i = 0; i < R * 4; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < pairs; kk++) {
        const __m512i *wv = (const __m512i *)(panel + kk * PANEL * 2);
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
    const __m512 s = _mm512_set1_ps(scale);
    for (int q = 0; q < 4 && q * 16 < ncols; q++) {
        const __mmask16 mask = ncols - q * 16 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (ncols - q * 16)) - 1u);
        for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(c + r * c_stride + q * 16, mask, _mm512_mul_ps(acc[r * 4 + q], s));
    }
}

static void matmul_rows(const uint16_t *a, int64_t a_stride, int64_t rows, int64_t pairs, const uint16_t *panel,
                        float *c, int64_t c_stride, int64_t ncols, float scale) {
    int64_t r = 0;
    for (; r + RT <= rows; r += RT) micro(a + r * a_stride, a_stride, pairs, panel, RT, c + r * c_stride, c_stride, ncols, scale);
    switch (rows - r) {
    case 1: micro(a + r * a_stride, a_stride, pairs, panel, 1, c + r * c_stride, c_stride, ncols, scale); break;
    case 2: micro(a + r * a_stride, a_stride, pairs, panel, 2, c + r * c_stride, c_stride, ncols, scale); break;
    case 3: micro(a + r * a_stride, a_stride, pairs, panel, 3, c + r * c_stride, c_stride, ncols, scale); break;
    case 4: micro(a + r * a_stride, a_stride, pairs, panel, 4, c + r * c_stride, c_stride, ncols, scale); break;
    case 5: micro(a + r * a_stride, a_stride, pairs, panel, 5, c + r * c_stride, c_stride, ncols, scale); break;
    default: break;
    }
}

/* q: token rows of q_stride elements, head hq at hq * dim; out likewise (out_stride); k, v: the pool;
 * kv_indices [bs, max_seq]: request b's slots, prefix then new tokens; its new tokens are q rows
 * q_starts[b] .. + ext_lens[b] at positions prefix_lens[b] ... dim must be even and <= 256. */
typedef struct {
    const uint16_t *q, *k, *v;
    int64_t q_stride, k_stride, v_stride;
    const int64_t *kv_indices;
    int64_t max_seq;
    const int64_t *q_starts, *ext_lens, *prefix_lens;
    int64_t bs, heads, kv_heads, dim;
    float scale;
    uint16_t *out;
    int64_t out_stride;
    _Atomic int64_t next; /* the next (request, KV head) task */
} extend_job_t;

#if defined(HAVE_AMX)
/* One (request, KV head) task's query rows on AMX tiles, 32 at a time, over K^T / V panels packed
 * for the request's keys (vpairs pairs a V panel): amx_attend_step over AMX_KEYS keys at a time, each
 * row seeing the keys up to its own position. qa: [32][dim] scratch; acc: [32][dim] float32. */
static void extend_rows_amx(const extend_job_t *J, int64_t b, int64_t h, const uint16_t *kp, const uint16_t *vp,
                            int64_t vpairs, amx_attn_t *attn, uint16_t *qa, float *acc) {
    const int64_t dim = J->dim, group = J->heads / J->kv_heads, prefix = J->prefix_lens[b];
    const int64_t rows = J->ext_lens[b] * group;
    for (int64_t r0 = 0; r0 < rows; r0 += 32) {
        const int64_t nr = rows - r0 < 32 ? rows - r0 : 32, padded = (nr + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
        float m[32], l[32];
        int64_t limit[32], vis[32];
        for (int64_t r = 0; r < nr; r++) {
            const int64_t i = (r0 + r) / group, j = (r0 + r) % group;
            memcpy(qa + r * dim, J->q + (J->q_starts[b] + i) * J->q_stride + (h * group + j) * dim,
                   sizeof(uint16_t) * (size_t)dim);
            limit[r] = prefix + i + 1; /* keys this row sees */
            m[r] = -INFINITY;
            l[r] = 0.f;
        }
        memset(qa + nr * dim, 0, sizeof(uint16_t) * (size_t)((padded - nr) * dim));
        memset(acc, 0, sizeof(float) * (size_t)(nr * dim));
        const int64_t visible = limit[nr - 1];
        for (int64_t i0 = 0; i0 < visible; i0 += AMX_KEYS) {
            const int64_t nt = visible - i0 < AMX_KEYS ? visible - i0 : AMX_KEYS;
            for (int64_t r = 0; r < nr; r++) vis[r] = limit[r] - i0 < 0 ? 0 : limit[r] - i0 > nt ? nt : limit[r] - i0;
            amx_attend_step(qa, nr, dim, kp + i0 / 64 * (dim / 2) * 128, vp + i0 / 2 * 128, vpairs * 128, vis, J->scale,
                            m, l, acc, attn);
        }
        for (int64_t r = 0; r < nr; r++) {
            const int64_t i = (r0 + r) / group, j = (r0 + r) % group;
            uint16_t *dst = J->out + (J->q_starts[b] + i) * J->out_stride + (h * group + j) * dim;
            const __m512 inv = _mm512_set1_ps(1.f / l[r]);
            for (int64_t d = 0; d < dim; d += 16)
                _mm256_storeu_si256((__m256i *)(dst + d),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc + r * dim + d), inv)));
        }
    }
}
#endif

static void extend_part(void *arg, int tid, int nthreads) {
    extend_job_t *J = (extend_job_t *)arg;
    (void)tid;
    (void)nthreads;
    const uint16_t *q = J->q, *k = J->k, *v = J->v;
    const int64_t q_stride = J->q_stride, k_stride = J->k_stride, v_stride = J->v_stride, max_seq = J->max_seq;
    const int64_t *kv_indices = J->kv_indices, *q_starts = J->q_starts, *ext_lens = J->ext_lens;
    const int64_t *prefix_lens = J->prefix_lens;
    const int64_t bs = J->bs, heads = J->heads, kv_heads = J->kv_heads, dim = J->dim, out_stride = J->out_stride;
    const float scale = J->scale;
    uint16_t *out = J->out;
    const int64_t group = heads / kv_heads, pairs = dim / 2;
    const int64_t dpanels = (dim + PANEL - 1) / PANEL;
#if defined(HAVE_AMX)
    const int amx = amx_active() && dim % 32 == 0;
    amx_attn_t attn = {0};
    if (amx) {
        amx_configure(AMX_ROWS);
        amx_attn_alloc(&attn, dim);
    }
#else
    const int amx = 0;
#endif
    int64_t cap_seq = 0; /* scratch grown on demand */
    uint16_t *kp = NULL, *vp = NULL, *pb = NULL, *qa = NULL;
    float *s = NULL, *o = NULL;
    DYNAMIC_FOR(t, bs * kv_heads, &J->next) {
        const int64_t b = t / kv_heads, h = t % kv_heads;
        const int64_t ext = ext_lens[b], prefix = prefix_lens[b], seq = prefix + ext;
        if (ext == 0) continue;
        const int64_t kpanels = (seq + PANEL - 1) / PANEL, seq_pad = kpanels * PANEL;
        if (seq_pad > cap_seq) {
            cap_seq = seq_pad;
            free(kp); free(vp); free(pb); free(s);
            kp = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(seq_pad * dim));
            vp = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(dpanels * PANEL * (seq_pad + 2)));
            if (!amx) { /* the AVX512 path's whole-row scores and P (AMX keeps one step's in attn) */
                pb = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(RBLOCK * (seq_pad + 2)));
                s = (float *)malloc(sizeof(float) * (size_t)(RBLOCK * seq_pad));
            }
        }
        if (qa == NULL) {
            qa = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(RBLOCK * dim));
            o = (float *)malloc(sizeof(float) * (size_t)(RBLOCK * dpanels * PANEL));
        }
        const int64_t *slots = kv_indices + b * max_seq;
        const int64_t vpairs = seq_pad / 2;
        pack_k_panels(k, k_stride, slots, seq, h * dim, pairs, kp);
        pack_v_panels(v, v_stride, slots, seq, h * dim, dim, vpairs, vp);
#if defined(HAVE_AMX)
        if (amx) {
            extend_rows_amx(J, b, h, kp, vp, vpairs, &attn, qa, o);
            continue;
        }
#endif
        /* Query rows r = i * group + j (token i, query head h * group + j), in blocks. */
        const int64_t rows = ext * group;
        for (int64_t r0 = 0; r0 < rows; r0 += RBLOCK) {
            const int64_t nr = rows - r0 < RBLOCK ? rows - r0 : RBLOCK;
            for (int64_t r = 0; r < nr; r++) {
                const int64_t i = (r0 + r) / group, j = (r0 + r) % group;
                memcpy(qa + r * dim, q + (q_starts[b] + i) * q_stride + (h * group + j) * dim, sizeof(uint16_t) * (size_t)dim);
            }
            /* Keys visible to the block's last row: prefix + its token index + 1. */
            const int64_t last_i = (r0 + nr - 1) / group;
            const int64_t visible = prefix + last_i + 1;
            const int64_t np = (visible + PANEL - 1) / PANEL;
            for (int64_t p = 0; p < np; p++)
                matmul_rows(qa, dim, nr, pairs, kp + p * pairs * PANEL * 2, s + p * PANEL, seq_pad, PANEL, scale);
            const int64_t vis_pad = (visible + 1) / 2 * 2;
            float inv[RBLOCK];
            for (int64_t r = 0; r < nr; r++) {
                const int64_t n = prefix + (r0 + r) / group + 1; /* this row's causal limit */
                float *sr = s + r * seq_pad;
                const float m = max_of(sr, n);
                float sum = 0.f;
                int64_t c = 0;
                const __m512 mv = _mm512_set1_ps(m);
                __m512 acc = _mm512_setzero_ps();
                for (; c + 16 <= n; c += 16) {
                    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sr + c), mv));
                    acc = _mm512_add_ps(acc, e);
                    _mm256_storeu_si256((__m256i *)(pb + r * (seq_pad + 2) + c), (__m256i)_mm512_cvtneps_pbh(e));
                }
                sum = _mm512_reduce_add_ps(acc);
                for (; c < n; c++) {
                    const float e = expf(sr[c] - m);
                    sum += e;
                    pb[r * (seq_pad + 2) + c] = f32_to_bf16(e);
                }
                for (; c < vis_pad; c++) pb[r * (seq_pad + 2) + c] = 0; /* masked keys weigh 0 */
                inv[r] = 1.f / sum;
            }
            /* O = P V over the visible key pairs, 64 head dimensions per panel. */
            for (int64_t dp = 0; dp < dpanels; dp++)
                matmul_rows(pb, seq_pad + 2, nr, vis_pad / 2, vp + dp * vpairs * PANEL * 2, o + dp * PANEL,
                            dpanels * PANEL, PANEL, 1.f);
            for (int64_t r = 0; r < nr; r++) {
                const int64_t i = (r0 + r) / group, j = (r0 + r) % group;
                uint16_t *dst = out + (q_starts[b] + i) * out_stride + (h * group + j) * dim;
                for (int64_t d = 0; d < dim; d++) dst[d] = f32_to_bf16(o[r * dpanels * PANEL + d] * inv[r]);
            }
        }
    }
    free(kp); free(vp); free(pb); free(s); free(qa); free(o);
#if defined(HAVE_AMX)
    if (amx) {
        amx_attn_free(&attn);
        _tile_release();
    }
#endif
}

void extend_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v, int64_t k_stride,
                      int64_t v_stride, const int64_t *kv_indices, int64_t max_seq, const int64_t *q_starts,
                      const int64_t *ext_lens, const int64_t *prefix_lens, int64_t bs, int64_t heads,
                      int64_t kv_heads, int64_t dim, float scale, uint16_t *out, int64_t out_stride, int num_threads) {
    extend_job_t job = {q, k, v, q_stride, k_stride, v_stride, kv_indices, max_seq, q_starts, ext_lens, prefix_lens,
                        bs, heads, kv_heads, dim, scale, out, out_stride, 0};
    pool_run(extend_part, &job, num_threads);
}

int extend_attention_available(void) { return 1; }
#else
void extend_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v, int64_t k_stride,
                      int64_t v_stride, const int64_t *kv_indices, int64_t max_seq, const int64_t *q_starts,
                      const int64_t *ext_lens, const int64_t *prefix_lens, int64_t bs, int64_t heads,
                      int64_t kv_heads, int64_t dim, float scale, uint16_t *out, int64_t out_stride, int num_threads) {
    (void)q; (void)q_stride; (void)k; (void)v; (void)k_stride; (void)v_stride; (void)kv_indices; (void)max_seq;
    (void)q_starts; (void)ext_lens; (void)prefix_lens; (void)bs; (void)heads; (void)kv_heads; (void)dim;
    (void)scale; (void)out; (void)out_stride; (void)num_threads;
}

int extend_attention_available(void) { return 0; }
#endif
