/* Prefill (extend) attention for the CPU with bfloat16 data and AVX512-BF16, read from the paged pool.
 *
 * Every new token of a request attends causally to the request's cached prefix and to the new tokens
 * up to itself. For one (request, KV head) the query rows are the new tokens x the query heads of that
 * KV head, so both products are small matrix multiplications: S = Q K^T over the request's keys and
 * O = P V. Torch's CPU SDPA ran these at ~70 GFLOP/s per core with a mask or GQA on this kind of CPU;
 * here K and V are packed once per task into the vdpbf16ps operand layout (panels of 64 keys for
 * Q K^T, panels of 64 head dimensions for P V), and the query rows walk them 32 at a time in steps of
 * ATTN_KEYS keys with the online softmax (attend_step.h: register tiles, or AMX tiles where the CPU
 * has them). S is float32; P is rounded to bfloat16 for P V, as flash attention does. Steps past a
 * row block's last visible key are skipped, so a prompt without prefix costs about half of the
 * square. 2-core AMD EPYC Zen 4, one process: 16 x 64 new tokens over 1024 cached 15.1 -> 14.1 ms a
 * layer, one 1024-token prompt 9.1 -> 7.6 ms, against whole rows of scores written out and read back.
 */
#include "attend_step.h"

#if defined(__AVX512BF16__)
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

/* One (request, KV head) task's query rows, 32 at a time, over K^T / V panels packed for the
 * request's keys (vpairs pairs a V panel): attend_step over ATTN_KEYS keys at a time, each row seeing
 * the keys up to its own position. qa: [32][dim] scratch; acc: [32][dim] float32. */
static void extend_rows(const extend_job_t *J, int64_t b, int64_t h, const uint16_t *kp, const uint16_t *vp,
                        int64_t vpairs, attn_scratch_t *attn, uint16_t *qa, float *acc, int amx) {
    const int64_t dim = J->dim, group = J->heads / J->kv_heads, prefix = J->prefix_lens[b];
    const int64_t rows = J->ext_lens[b] * group;
    for (int64_t r0 = 0; r0 < rows; r0 += ATTN_ROWS) {
        const int64_t nr = rows - r0 < ATTN_ROWS ? rows - r0 : ATTN_ROWS;
        float m[ATTN_ROWS], l[ATTN_ROWS];
        int64_t limit[ATTN_ROWS], vis[ATTN_ROWS];
        for (int64_t r = 0; r < nr; r++) {
            const int64_t i = (r0 + r) / group, j = (r0 + r) % group;
            memcpy(qa + r * dim, J->q + (J->q_starts[b] + i) * J->q_stride + (h * group + j) * dim,
                   sizeof(uint16_t) * (size_t)dim);
            limit[r] = prefix + i + 1; /* keys this row sees */
            m[r] = -INFINITY;
            l[r] = 0.f;
        }
#if defined(HAVE_AMX)
        if (amx) { /* the tiles read whole blocks of 16 rows */
            const int64_t padded = (nr + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
            memset(qa + nr * dim, 0, sizeof(uint16_t) * (size_t)((padded - nr) * dim));
        }
#endif
        memset(acc, 0, sizeof(float) * (size_t)(nr * dim));
        const int64_t visible = limit[nr - 1];
        for (int64_t i0 = 0; i0 < visible; i0 += ATTN_KEYS) {
            const int64_t nt = visible - i0 < ATTN_KEYS ? visible - i0 : ATTN_KEYS;
            for (int64_t r = 0; r < nr; r++) vis[r] = limit[r] - i0 < 0 ? 0 : limit[r] - i0 > nt ? nt : limit[r] - i0;
            attend_step(qa, nr, dim, kp + i0 / 64 * (dim / 2) * 128, vp + i0 / 2 * 128, vpairs * 128, vis, J->scale,
                        m, l, acc, attn, NULL, 0, amx);
        }
        for (int64_t r = 0; r < nr; r++) {
            const int64_t i = (r0 + r) / group, j = (r0 + r) % group;
            uint16_t *dst = J->out + (J->q_starts[b] + i) * J->out_stride + (h * group + j) * dim;
            const __m512 inv = _mm512_set1_ps(1.f / l[r]);
            for (int64_t d = 0; d < dim; d += 16) {
                const __mmask16 live = dim - d >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (dim - d)) - 1u);
                _mm256_mask_storeu_epi16(dst + d, live, (__m256i)_mm512_cvtneps_pbh(
                                                            _mm512_mul_ps(_mm512_maskz_loadu_ps(live, acc + r * dim + d), inv)));
            }
        }
    }
}

static void extend_part(void *arg, int tid, int nthreads) {
    extend_job_t *J = (extend_job_t *)arg;
    (void)tid;
    (void)nthreads;
    const int64_t dim = J->dim, kv_heads = J->kv_heads, dpanels = (dim + 63) / 64;
#if defined(HAVE_AMX)
    const int amx = amx_active() && dim % 32 == 0;
    if (amx) amx_configure(AMX_ROWS);
#else
    const int amx = 0;
#endif
    attn_scratch_t attn;
    attn_scratch_alloc(&attn, dim);
    uint16_t *qa = (uint16_t *)calloc((size_t)(ATTN_ROWS * dim), sizeof(uint16_t));
    float *acc = (float *)malloc(sizeof(float) * (size_t)(ATTN_ROWS * dim));
    int64_t cap_seq = 0; /* panels grown on demand */
    uint16_t *kp = NULL, *vp = NULL;
    DYNAMIC_FOR(t, J->bs * kv_heads, &J->next) {
        const int64_t b = t / kv_heads, h = t % kv_heads;
        const int64_t seq = J->prefix_lens[b] + J->ext_lens[b];
        if (J->ext_lens[b] == 0) continue;
        const int64_t seq_pad = (seq + 63) / 64 * 64;
        if (seq_pad > cap_seq) {
            cap_seq = seq_pad;
            free(kp);
            free(vp);
            kp = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(seq_pad * dim));
            vp = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(dpanels * 64 * seq_pad));
        }
        const int64_t *slots = J->kv_indices + b * J->max_seq, vpairs = seq_pad / 2;
        pack_k_panels(J->k, J->k_stride, slots, seq, h * dim, dim / 2, kp);
        pack_v_panels(J->v, J->v_stride, slots, seq, h * dim, dim, vpairs, vp);
        extend_rows(J, b, h, kp, vp, vpairs, &attn, qa, acc, amx);
    }
    free(kp);
    free(vp);
    free(qa);
    free(acc);
    attn_scratch_free(&attn);
#if defined(HAVE_AMX)
    if (amx) _tile_release();
#endif
}

void extend_attention(const extend_attention_args_t *args) {
    const extend_attention_args_t *a = args;
    extend_job_t job = {a->q, a->k, a->v, a->q_stride, a->k_stride, a->v_stride, a->kv_indices, a->max_seq,
                        a->q_starts, a->ext_lens, a->prefix_lens, a->bs, a->heads, a->kv_heads, a->dim, a->scale,
                        a->out, a->out_stride, 0};
    pool_run(extend_part, &job, a->num_threads);
}

int extend_attention_available(void) { return 1; }
#else
void extend_attention(const extend_attention_args_t *args) { /* never called: extend_attention_available() */
    (void)args;
}

int extend_attention_available(void) { return 0; }
#endif
