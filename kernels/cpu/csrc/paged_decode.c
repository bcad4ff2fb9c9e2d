/* Decode attention over the paged KV cache, for the CPU (fp32).
 *
 * One query token per sequence. Each sequence's cached tokens are cut into chunks of whole
 * blocks; a task takes one chunk of one sequence and, for every query head, scores the chunk's
 * keys, takes a local softmax (max and sum) and the weighted sum of its values. A block is one
 * contiguous run of memory (block_size tokens x all KV heads), so a task streams it from memory
 * once and then reuses it from L1 for every head; tasks are spread over OpenMP threads, which
 * keeps both cores busy even for one long sequence. A final pass merges each sequence's chunk
 * results (the "split-K" of flash decoding). The head size is a compile-time constant (one
 * function per supported size) so query rows and accumulators live in vector registers.
 *
 * Layouts (all C-contiguous):
 *   q        [num_seqs, num_heads, head_dim]
 *   k_cache  [num_blocks, block_size, num_kv_heads, head_dim]   (v_cache the same)
 *   tables   [num_seqs, table_width]  int32 block ids
 *   seq_lens [num_seqs]               int32 tokens to attend to (the new one included)
 *   out      [num_seqs, num_heads, head_dim]
 * Returns 0, -1 when a buffer could not be allocated, -2 for an unsupported head size.
 * Built and loaded by kernels/cpu/attention.py (plain C: no torch headers, so the
 * build takes well under a second).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK_TOKENS 256 /* tokens per task, rounded down to whole blocks (at least one) */

/* One task: tokens [t0, t1) of one sequence. `qs` holds the sequence's query rows, pre-scaled.
 * Writes, per query head, the chunk's max score, its sum of exp(score - max), and
 * acc = sum of exp(score - max) * v, to part_m / part_l / part_acc. `scores` has room for
 * num_heads * CHUNK_TOKENS floats. */
#if defined(__AVX512F__)
#include <immintrin.h>

#include "vec_exp.h"

/* Asks for the next block (n floats from p) into L2 while the current one is worked on. */
static inline void prefetch_l2(const float *p, int64_t n) {
    for (int64_t off = 0; off < n; off += 16) _mm_prefetch((const char *)(p + off), _MM_HINT_T1);
}

/* The 16 lane sums of v[0..15], as one vector (lane t = sum of v[t]): a transpose-and-add
 * tree, ~45 shuffles/adds instead of 16 separate horizontal sums. */
static inline __m512 lane_sums16(const __m512 *v) {
    __m512 s[8], u[4], w[2];
    for (int i = 0; i < 8; ++i) /* per 128-bit lane: [a, b, a', b'] partial sums */
        s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) { /* per 128-bit lane: [a, b, c, d] */
        const __m512d a = _mm512_castps_pd(s[2 * i]), b = _mm512_castps_pd(s[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; ++i) /* fold the four 128-bit lanes pairwise */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                         _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

/* Vector form: scores 16 tokens at a time (a tree of lane sums), a vector exp, and value rows
 * accumulated into two register sets (even/odd tokens) so the FMAs do not wait on each other. */
#define DEFINE_CHUNK(D)                                                                          \
static void chunk_##D(const float *qs, const float *k_cache, const float *v_cache,              \
                      const int32_t *table, int64_t t0, int64_t t1, int64_t num_heads,          \
                      int64_t group, int64_t row, int64_t block_size, int64_t block_stride,     \
                      float *scores, float *part_m, float *part_l, float *part_acc) {          \
    enum { NV = D / 16 };                                                                       \
    const int64_t n = t1 - t0;                                                                  \
    for (int64_t b0 = t0; b0 < t1; b0 += block_size) {                                          \
        const float *kb = k_cache + (int64_t)table[b0 / block_size] * block_stride;             \
        const int64_t m = t1 - b0 < block_size ? t1 - b0 : block_size;                          \
        if (b0 + block_size < t1)                                                               \
            prefetch_l2(k_cache + (int64_t)table[b0 / block_size + 1] * block_stride, block_stride); \
        for (int64_t hq = 0; hq < num_heads; ++hq) {                                            \
            const float *k_head = kb + (hq / group) * D;                                        \
            __m512 qv[NV];                                                                      \
            for (int c = 0; c < NV; ++c) qv[c] = _mm512_loadu_ps(qs + hq * D + 16 * c);         \
            float *sh = scores + hq * CHUNK_TOKENS + (b0 - t0);                                 \
            int64_t i = 0;                                                                      \
            for (; i + 16 <= m; i += 16) {                                                      \
                __m512 acc[16];                                                                 \
                for (int u = 0; u < 16; ++u) {                                                  \
                    const float *k = k_head + (i + u) * row;                                    \
                    __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));                        \
                    for (int c = 1; c < NV; ++c)                                                \
                        a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + 16 * c), a);             \
                    acc[u] = a;                                                                 \
                }                                                                               \
                _mm512_storeu_ps(sh + i, lane_sums16(acc));                                     \
            }                                                                                   \
            for (; i < m; ++i) {                                                                \
                const float *k = k_head + i * row;                                              \
                __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));                            \
                for (int c = 1; c < NV; ++c)                                                    \
                    a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + 16 * c), a);                 \
                sh[i] = _mm512_reduce_add_ps(a);                                                \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    for (int64_t hq = 0; hq < num_heads; ++hq) {                                                \
        float *sh = scores + hq * CHUNK_TOKENS;                                                 \
        __m512 vmx = _mm512_set1_ps(-INFINITY);                                                 \
        for (int64_t t = 0; t < n; t += 16) {                                                   \
            const __mmask16 k = n - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - t)) - 1u); \
            vmx = _mm512_mask_max_ps(vmx, k, vmx, _mm512_maskz_loadu_ps(k, sh + t));            \
        }                                                                                       \
        const float mx = _mm512_reduce_max_ps(vmx);                                             \
        __m512 vsum = _mm512_setzero_ps();                                                      \
        for (int64_t t = 0; t < n; t += 16) {                                                   \
            const __mmask16 k = n - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - t)) - 1u); \
            const __m512 e = bg_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sh + t),         \
                                                      _mm512_set1_ps(mx)));                     \
            _mm512_mask_storeu_ps(sh + t, k, e);                                                \
            vsum = _mm512_mask_add_ps(vsum, k, vsum, e);                                        \
        }                                                                                       \
        part_m[hq] = mx;                                                                        \
        part_l[hq] = _mm512_reduce_add_ps(vsum);                                                \
        memset(part_acc + hq * D, 0, sizeof(float) * D);                                        \
    }                                                                                           \
    for (int64_t b0 = t0; b0 < t1; b0 += block_size) {                                          \
        const float *vb = v_cache + (int64_t)table[b0 / block_size] * block_stride;             \
        const int64_t m = t1 - b0 < block_size ? t1 - b0 : block_size;                          \
        if (b0 + block_size < t1)                                                               \
            prefetch_l2(v_cache + (int64_t)table[b0 / block_size + 1] * block_stride, block_stride); \
        for (int64_t hq = 0; hq < num_heads; ++hq) {                                            \
            const float *v_head = vb + (hq / group) * D;                                        \
            const float *ph = scores + hq * CHUNK_TOKENS + (b0 - t0);                           \
            float *dst = part_acc + hq * D;                                                     \
            __m512 a0[NV], a1[NV];                                                              \
            for (int c = 0; c < NV; ++c) {                                                      \
                a0[c] = _mm512_loadu_ps(dst + 16 * c);                                          \
                a1[c] = _mm512_setzero_ps();                                                    \
            }                                                                                   \
            int64_t i = 0;                                                                      \
            for (; i + 2 <= m; i += 2) {                                                        \
                const __m512 p0 = _mm512_set1_ps(ph[i]), p1 = _mm512_set1_ps(ph[i + 1]);        \
                const float *v0 = v_head + i * row, *v1 = v0 + row;                             \
                for (int c = 0; c < NV; ++c) {                                                  \
                    a0[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * c), a0[c]);           \
                    a1[c] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v1 + 16 * c), a1[c]);           \
                }                                                                               \
            }                                                                                   \
            if (i < m) {                                                                        \
                const __m512 p0 = _mm512_set1_ps(ph[i]);                                        \
                const float *v0 = v_head + i * row;                                             \
                for (int c = 0; c < NV; ++c)                                                    \
                    a0[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * c), a0[c]);           \
            }                                                                                   \
            for (int c = 0; c < NV; ++c)                                                        \
                _mm512_storeu_ps(dst + 16 * c, _mm512_add_ps(a0[c], a1[c]));                    \
        }                                                                                       \
    }                                                                                           \
}
#else /* portable C: the compiler vectorises the inner loops */
#define DEFINE_CHUNK(D)                                                                          \
static void chunk_##D(const float *qs, const float *k_cache, const float *v_cache,              \
                      const int32_t *table, int64_t t0, int64_t t1, int64_t num_heads,          \
                      int64_t group, int64_t row, int64_t block_size, int64_t block_stride,     \
                      float *scores, float *part_m, float *part_l, float *part_acc) {          \
    const int64_t n = t1 - t0;                                                                  \
    for (int64_t b0 = t0; b0 < t1; b0 += block_size) {                                          \
        const float *kb = k_cache + (int64_t)table[b0 / block_size] * block_stride;             \
        const int64_t m = t1 - b0 < block_size ? t1 - b0 : block_size;                          \
        for (int64_t hq = 0; hq < num_heads; ++hq) {                                            \
            const float *k_head = kb + (hq / group) * D;                                        \
            float qv[D];                                                                        \
            for (int64_t d = 0; d < D; ++d) qv[d] = qs[hq * D + d];                             \
            float *sh = scores + hq * CHUNK_TOKENS + (b0 - t0);                                 \
            for (int64_t i = 0; i < m; ++i) {                                                   \
                const float *k = k_head + i * row;                                              \
                float acc = 0.0f;                                                               \
                _Pragma("omp simd reduction(+:acc)")                                            \
                for (int64_t d = 0; d < D; ++d) acc += qv[d] * k[d];                            \
                sh[i] = acc;                                                                    \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    for (int64_t hq = 0; hq < num_heads; ++hq) {                                                \
        float *sh = scores + hq * CHUNK_TOKENS;                                                 \
        float mx = -INFINITY;                                                                   \
        for (int64_t t = 0; t < n; ++t) mx = sh[t] > mx ? sh[t] : mx;                           \
        float sum = 0.0f;                                                                       \
        for (int64_t t = 0; t < n; ++t) { sh[t] = expf(sh[t] - mx); sum += sh[t]; }            \
        part_m[hq] = mx;                                                                        \
        part_l[hq] = sum;                                                                       \
        memset(part_acc + hq * D, 0, sizeof(float) * D);                                        \
    }                                                                                           \
    for (int64_t b0 = t0; b0 < t1; b0 += block_size) {                                          \
        const float *vb = v_cache + (int64_t)table[b0 / block_size] * block_stride;             \
        const int64_t m = t1 - b0 < block_size ? t1 - b0 : block_size;                          \
        for (int64_t hq = 0; hq < num_heads; ++hq) {                                            \
            const float *v_head = vb + (hq / group) * D;                                        \
            const float *ph = scores + hq * CHUNK_TOKENS + (b0 - t0);                           \
            float acc[D];                                                                       \
            float *dst = part_acc + hq * D;                                                     \
            for (int64_t d = 0; d < D; ++d) acc[d] = dst[d];                                    \
            for (int64_t i = 0; i < m; ++i) {                                                   \
                const float p = ph[i];                                                          \
                const float *v = v_head + i * row;                                              \
                _Pragma("omp simd")                                                             \
                for (int64_t d = 0; d < D; ++d) acc[d] += p * v[d];                             \
            }                                                                                   \
            for (int64_t d = 0; d < D; ++d) dst[d] = acc[d];                                    \
        }                                                                                       \
    }                                                                                           \
}
#endif
DEFINE_CHUNK(16)
DEFINE_CHUNK(32)
DEFINE_CHUNK(64)
DEFINE_CHUNK(128)
DEFINE_CHUNK(256)

int bg_paged_decode_supports(int64_t head_dim) {
    return head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
}

int bg_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                        const int32_t *tables, const int32_t *seq_lens, float *out,
                        int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t block_size, int64_t table_width,
                        float scale, int num_threads) {
    if (!bg_paged_decode_supports(head_dim)) return -2;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * row;
    int64_t chunk = (CHUNK_TOKENS / block_size) * block_size;
    if (chunk < block_size) chunk = block_size;
    if (chunk > CHUNK_TOKENS) return -2; /* block_size > CHUNK_TOKENS: not supported */

    /* task list: first_task[s] .. first_task[s + 1] - 1 are sequence s's chunks */
    int64_t *first_task = (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));
    float *qscaled = (float *)malloc(sizeof(float) * (size_t)(num_seqs * num_heads * head_dim));
    if (first_task == NULL || qscaled == NULL) {
        free(first_task);
        free(qscaled);
        return -1;
    }
    first_task[0] = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t len = seq_lens[s] > 0 ? seq_lens[s] : 0;
        first_task[s + 1] = first_task[s] + (len + chunk - 1) / chunk;
    }
    for (int64_t i = 0; i < num_seqs * num_heads * head_dim; ++i) qscaled[i] = q[i] * scale;
    const int64_t tasks = first_task[num_seqs];
    float *part = (float *)malloc(sizeof(float) * (size_t)((tasks > 0 ? tasks : 1) * num_heads * (head_dim + 2)));
    if (part == NULL) {
        free(first_task);
        free(qscaled);
        return -1;
    }
    float *part_m = part;
    float *part_l = part + tasks * num_heads;
    float *part_acc = part + 2 * tasks * num_heads;
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(num_heads * CHUNK_TOKENS));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; ++task) {
            if (scores == NULL) continue;
            int64_t lo = 0, hi = num_seqs - 1; /* this task's sequence: search first_task */
            while (lo < hi) {
                const int64_t mid = (lo + hi + 1) / 2;
                if (first_task[mid] <= task) lo = mid; else hi = mid - 1;
            }
            const int64_t s = lo;
            const int64_t t0 = (task - first_task[s]) * chunk;
            const int64_t len = seq_lens[s];
            const int64_t t1 = t0 + chunk < len ? t0 + chunk : len;
            const float *qs = qscaled + s * num_heads * head_dim;
            const int32_t *table = tables + s * table_width;
            float *pm = part_m + task * num_heads, *pl = part_l + task * num_heads;
            float *pa = part_acc + task * num_heads * head_dim;
#define RUN_CHUNK(D) chunk_##D(qs, k_cache, v_cache, table, t0, t1, num_heads, group, row, \
                               block_size, block_stride, scores, pm, pl, pa)
            switch (head_dim) {
                case 16: RUN_CHUNK(16); break;
                case 32: RUN_CHUNK(32); break;
                case 64: RUN_CHUNK(64); break;
                case 128: RUN_CHUNK(128); break;
                default: RUN_CHUNK(256); break;
            }
#undef RUN_CHUNK
        }
        free(scores);
    }

    /* merge: out = sum_c exp(m_c - M) acc_c / sum_c exp(m_c - M) l_c */
    for (int64_t s = 0; s < num_seqs; ++s) {
        for (int64_t hq = 0; hq < num_heads; ++hq) {
            float *o = out + (s * num_heads + hq) * head_dim;
            memset(o, 0, sizeof(float) * (size_t)head_dim);
            float mx = -INFINITY;
            for (int64_t c = first_task[s]; c < first_task[s + 1]; ++c)
                mx = part_m[c * num_heads + hq] > mx ? part_m[c * num_heads + hq] : mx;
            float denom = 0.0f;
            for (int64_t c = first_task[s]; c < first_task[s + 1]; ++c) {
                const float w = expf(part_m[c * num_heads + hq] - mx);
                denom += w * part_l[c * num_heads + hq];
                const float *a = part_acc + (c * num_heads + hq) * head_dim;
                for (int64_t d = 0; d < head_dim; ++d) o[d] += w * a[d];
            }
            const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
            for (int64_t d = 0; d < head_dim; ++d) o[d] *= inv;
        }
    }
    free(part);
    free(qscaled);
    free(first_task);
    return failed ? -1 : 0;
}
