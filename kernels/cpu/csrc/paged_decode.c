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
 *
 * bg_paged_decode_fp8 reads an FP8 cache (float8_e4m3fn codes, uint8 here; one k_scale and one
 * v_scale per layer: batchgen_data/layers/kv_quant.py). Each code is widened in registers to
 * code / 256, exactly (the sign and 7 magnitude bits placed as an fp16's and converted, or the
 * same value built from fp32 bits in the portable path); 256 * k_scale folds into the query's
 * pre-scale and 256 * v_scale into the output, so the loops are the fp32 kernel's.
 * bg_paged_decode_windowed is either over a sliding window (each query sees the last `window`
 * tokens, itself included; 0: all) and with attention sinks (`sinks`: one logit per query head
 * joining the softmax's denominator with no value behind it, NULL: none) and with logit
 * soft-capping (`softcap` > 0: each score s becomes softcap * tanh(s / softcap), Gemma 2). A
 * window's tasks start at its first token, so the chunks outside it are never read; the sinks
 * join the merge.
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

/* Asks for the next block (n bytes from p) into L2 while the current one is worked on. */
static inline void prefetch_l2(const void *p, int64_t n) {
    for (int64_t off = 0; off < n; off += 64) _mm_prefetch((const char *)p + off, _MM_HINT_T1);
}

/* 16 lanes of a row: fp32 as stored, or 16 e4m3 codes widened to code / 256 (exact: the sign
 * to bit 15 and the magnitude bits to bits 7..13 make the fp16 of code / 256). */
static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_fp8(const uint8_t *p) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i h = _mm256_or_si256(
        _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
        _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
    return _mm512_cvtph_ps(h);
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
#define DEFINE_CHUNK(D, NAME, T)                                                                 \
static void chunk_##NAME##_##D(const float *qs, const T *k_cache, const T *v_cache,             \
                      const int32_t *table, int64_t t0, int64_t t1, int64_t num_heads,          \
                      int64_t group, int64_t row, int64_t block_size, int64_t block_stride,     \
                      float *scores, float *part_m, float *part_l, float *part_acc,            \
                      float softcap) {                                                          \
    enum { NV = D / 16 };                                                                       \
    const int64_t n = t1 - t0;                                                                  \
    for (int64_t b0 = t0, m = 0; b0 < t1; b0 += m) {                                             \
        const int64_t off = b0 % block_size; /* a window's first block: from its token */       \
        const T *kb = k_cache + (int64_t)table[b0 / block_size] * block_stride + off * row; \
        m = t1 - b0 < block_size - off ? t1 - b0 : block_size - off;                             \
        if (b0 + m < t1)                                                                         \
            prefetch_l2(k_cache + (int64_t)table[b0 / block_size + 1] * block_stride, block_stride * (int64_t)sizeof(T)); \
        for (int64_t hq = 0; hq < num_heads; ++hq) {                                            \
            const T *k_head = kb + (hq / group) * D;                                        \
            __m512 qv[NV];                                                                      \
            for (int c = 0; c < NV; ++c) qv[c] = _mm512_loadu_ps(qs + hq * D + 16 * c);         \
            float *sh = scores + hq * CHUNK_TOKENS + (b0 - t0);                                 \
            int64_t i = 0;                                                                      \
            for (; i + 16 <= m; i += 16) {                                                      \
                __m512 acc[16];                                                                 \
                for (int u = 0; u < 16; ++u) {                                                  \
                    const T *k = k_head + (i + u) * row;                                    \
                    __m512 a = _mm512_mul_ps(qv[0], load16_##NAME(k));                        \
                    for (int c = 1; c < NV; ++c)                                                \
                        a = _mm512_fmadd_ps(qv[c], load16_##NAME(k + 16 * c), a);             \
                    acc[u] = a;                                                                 \
                }                                                                               \
                _mm512_storeu_ps(sh + i, lane_sums16(acc));                                     \
            }                                                                                   \
            for (; i < m; ++i) {                                                                \
                const T *k = k_head + i * row;                                              \
                __m512 a = _mm512_mul_ps(qv[0], load16_##NAME(k));                            \
                for (int c = 1; c < NV; ++c)                                                    \
                    a = _mm512_fmadd_ps(qv[c], load16_##NAME(k + 16 * c), a);                 \
                sh[i] = _mm512_reduce_add_ps(a);                                                \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    if (softcap > 0.0f) /* Gemma 2: each score s becomes softcap * tanh(s / softcap) */         \
        for (int64_t hq = 0; hq < num_heads; ++hq)                                              \
            for (int64_t t = 0; t < n; ++t)                                                     \
                scores[hq * CHUNK_TOKENS + t] = softcap * tanhf(scores[hq * CHUNK_TOKENS + t] / softcap);\
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
    for (int64_t b0 = t0, m = 0; b0 < t1; b0 += m) {                                             \
        const int64_t off = b0 % block_size; /* a window's first block: from its token */       \
        const T *vb = v_cache + (int64_t)table[b0 / block_size] * block_stride + off * row; \
        m = t1 - b0 < block_size - off ? t1 - b0 : block_size - off;                             \
        if (b0 + m < t1)                                                                         \
            prefetch_l2(v_cache + (int64_t)table[b0 / block_size + 1] * block_stride, block_stride * (int64_t)sizeof(T)); \
        for (int64_t hq = 0; hq < num_heads; ++hq) {                                            \
            const T *v_head = vb + (hq / group) * D;                                        \
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
                const T *v0 = v_head + i * row, *v1 = v0 + row;                             \
                for (int c = 0; c < NV; ++c) {                                                  \
                    a0[c] = _mm512_fmadd_ps(p0, load16_##NAME(v0 + 16 * c), a0[c]);           \
                    a1[c] = _mm512_fmadd_ps(p1, load16_##NAME(v1 + 16 * c), a1[c]);           \
                }                                                                               \
            }                                                                                   \
            if (i < m) {                                                                        \
                const __m512 p0 = _mm512_set1_ps(ph[i]);                                        \
                const T *v0 = v_head + i * row;                                             \
                for (int c = 0; c < NV; ++c)                                                    \
                    a0[c] = _mm512_fmadd_ps(p0, load16_##NAME(v0 + 16 * c), a0[c]);           \
            }                                                                                   \
            for (int c = 0; c < NV; ++c)                                                        \
                _mm512_storeu_ps(dst + 16 * c, _mm512_add_ps(a0[c], a1[c]));                    \
        }                                                                                       \
    }                                                                                           \
}
#else /* portable C: the compiler vectorises the inner loops */
/* A key or value row as fp32: stored so (no copy), or e4m3 codes widened to code / 256 into
 * `tmp` (normals from their fp32 bits, subnormals as m * 2^-17). */
static inline const float *row_f32(const float *p, float *tmp, int64_t n) {
    (void)tmp;
    (void)n;
    return p;
}
static inline const float *row_fp8(const uint8_t *p, float *tmp, int64_t n) {
    for (int64_t d = 0; d < n; ++d) {
        const uint32_t mag = p[d] & 0x7Fu;
        union { uint32_t u; float f; } nb = {(mag << 20) + (112u << 23)};
        const float r = (mag >> 3) ? nb.f : (float)(mag & 7u) * 7.62939453125e-06f;
        tmp[d] = (p[d] & 0x80u) ? -r : r;
    }
    return tmp;
}
#define DEFINE_CHUNK(D, NAME, T)                                                                 \
static void chunk_##NAME##_##D(const float *qs, const T *k_cache, const T *v_cache,             \
                      const int32_t *table, int64_t t0, int64_t t1, int64_t num_heads,          \
                      int64_t group, int64_t row, int64_t block_size, int64_t block_stride,     \
                      float *scores, float *part_m, float *part_l, float *part_acc,            \
                      float softcap) {                                                          \
    const int64_t n = t1 - t0;                                                                  \
    for (int64_t b0 = t0, m = 0; b0 < t1; b0 += m) {                                             \
        const int64_t off = b0 % block_size; /* a window's first block: from its token */       \
        const T *kb = k_cache + (int64_t)table[b0 / block_size] * block_stride + off * row; \
        m = t1 - b0 < block_size - off ? t1 - b0 : block_size - off;                             \
        for (int64_t hq = 0; hq < num_heads; ++hq) {                                            \
            const T *k_head = kb + (hq / group) * D;                                        \
            float qv[D];                                                                        \
            for (int64_t d = 0; d < D; ++d) qv[d] = qs[hq * D + d];                             \
            float *sh = scores + hq * CHUNK_TOKENS + (b0 - t0);                                 \
            for (int64_t i = 0; i < m; ++i) {                                                   \
                float kr[D];                                                                    \
                const float *k = row_##NAME(k_head + i * row, kr, D);                           \
                float acc = 0.0f;                                                               \
                _Pragma("omp simd reduction(+:acc)")                                            \
                for (int64_t d = 0; d < D; ++d) acc += qv[d] * k[d];                            \
                sh[i] = acc;                                                                    \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    if (softcap > 0.0f) /* Gemma 2: each score s becomes softcap * tanh(s / softcap) */         \
        for (int64_t hq = 0; hq < num_heads; ++hq)                                              \
            for (int64_t t = 0; t < n; ++t)                                                     \
                scores[hq * CHUNK_TOKENS + t] = softcap * tanhf(scores[hq * CHUNK_TOKENS + t] / softcap);\
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
    for (int64_t b0 = t0, m = 0; b0 < t1; b0 += m) {                                             \
        const int64_t off = b0 % block_size; /* a window's first block: from its token */       \
        const T *vb = v_cache + (int64_t)table[b0 / block_size] * block_stride + off * row; \
        m = t1 - b0 < block_size - off ? t1 - b0 : block_size - off;                             \
        for (int64_t hq = 0; hq < num_heads; ++hq) {                                            \
            const T *v_head = vb + (hq / group) * D;                                        \
            const float *ph = scores + hq * CHUNK_TOKENS + (b0 - t0);                           \
            float acc[D];                                                                       \
            float *dst = part_acc + hq * D;                                                     \
            for (int64_t d = 0; d < D; ++d) acc[d] = dst[d];                                    \
            for (int64_t i = 0; i < m; ++i) {                                                   \
                const float p = ph[i];                                                          \
                float vr[D];                                                                    \
                const float *v = row_##NAME(v_head + i * row, vr, D);                           \
                _Pragma("omp simd")                                                             \
                for (int64_t d = 0; d < D; ++d) acc[d] += p * v[d];                             \
            }                                                                                   \
            for (int64_t d = 0; d < D; ++d) dst[d] = acc[d];                                    \
        }                                                                                       \
    }                                                                                           \
}
#endif
DEFINE_CHUNK(16, f32, float)
DEFINE_CHUNK(32, f32, float)
DEFINE_CHUNK(64, f32, float)
DEFINE_CHUNK(128, f32, float)
DEFINE_CHUNK(256, f32, float)
DEFINE_CHUNK(16, fp8, uint8_t)
DEFINE_CHUNK(32, fp8, uint8_t)
DEFINE_CHUNK(64, fp8, uint8_t)
DEFINE_CHUNK(128, fp8, uint8_t)
DEFINE_CHUNK(256, fp8, uint8_t)

int bg_paged_decode_supports(int64_t head_dim) {
    return head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
}

/* The kernel over either cache: `fp8` says which chunk functions read it; the query rows are
 * pre-scaled by scale * q_factor and the output by out_factor (1 and 1 for fp32). */
static int paged_decode(const float *q, const void *k_cache, const void *v_cache, int fp8,
                        const int32_t *tables, const int32_t *seq_lens, float *out,
                        int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t block_size, int64_t table_width,
                        float scale, float q_factor, float out_factor, int64_t window,
                        const float *sinks, float softcap, int num_threads) {
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
        const int64_t lo = window > 0 && len > window ? len - window : 0;
        first_task[s + 1] = first_task[s] + (len - lo + chunk - 1) / chunk;
    }
    const float qs_factor = scale * q_factor;
    for (int64_t i = 0; i < num_seqs * num_heads * head_dim; ++i) qscaled[i] = q[i] * qs_factor;
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
            const int64_t len = seq_lens[s];
            const int64_t first = window > 0 && len > window ? len - window : 0;
            const int64_t t0 = first + (task - first_task[s]) * chunk;
            const int64_t t1 = t0 + chunk < len ? t0 + chunk : len;
            const float *qs = qscaled + s * num_heads * head_dim;
            const int32_t *table = tables + s * table_width;
            float *pm = part_m + task * num_heads, *pl = part_l + task * num_heads;
            float *pa = part_acc + task * num_heads * head_dim;
#define RUN_CHUNK(D, NAME, T) chunk_##NAME##_##D(qs, (const T *)k_cache, (const T *)v_cache, \
                               table, t0, t1, num_heads, group, row, block_size, block_stride, \
                               scores, pm, pl, pa, softcap)
            if (fp8) {
                switch (head_dim) {
                    case 16: RUN_CHUNK(16, fp8, uint8_t); break;
                    case 32: RUN_CHUNK(32, fp8, uint8_t); break;
                    case 64: RUN_CHUNK(64, fp8, uint8_t); break;
                    case 128: RUN_CHUNK(128, fp8, uint8_t); break;
                    default: RUN_CHUNK(256, fp8, uint8_t); break;
                }
            } else {
                switch (head_dim) {
                    case 16: RUN_CHUNK(16, f32, float); break;
                    case 32: RUN_CHUNK(32, f32, float); break;
                    case 64: RUN_CHUNK(64, f32, float); break;
                    case 128: RUN_CHUNK(128, f32, float); break;
                    default: RUN_CHUNK(256, f32, float); break;
                }
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
            float mx = sinks != NULL ? sinks[hq] : -INFINITY;
            for (int64_t c = first_task[s]; c < first_task[s + 1]; ++c)
                mx = part_m[c * num_heads + hq] > mx ? part_m[c * num_heads + hq] : mx;
            float denom = sinks != NULL ? expf(sinks[hq] - mx) : 0.0f;
            for (int64_t c = first_task[s]; c < first_task[s + 1]; ++c) {
                const float w = expf(part_m[c * num_heads + hq] - mx);
                denom += w * part_l[c * num_heads + hq];
                const float *a = part_acc + (c * num_heads + hq) * head_dim;
                for (int64_t d = 0; d < head_dim; ++d) o[d] += w * a[d];
            }
            const float inv = denom > 0.0f ? out_factor / denom : 0.0f;
            for (int64_t d = 0; d < head_dim; ++d) o[d] *= inv;
        }
    }
    free(part);
    free(qscaled);
    free(first_task);
    return failed ? -1 : 0;
}

int bg_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                        const int32_t *tables, const int32_t *seq_lens, float *out,
                        int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t block_size, int64_t table_width,
                        float scale, int num_threads) {
    return paged_decode(q, k_cache, v_cache, 0, tables, seq_lens, out, num_seqs, num_heads,
                        num_kv_heads, head_dim, block_size, table_width, scale, 1.0f, 1.0f,
                        0, NULL, 0.0f, num_threads);
}

/* The same over an FP8 cache: K = code * k_scale, V = code * v_scale. */
int bg_paged_decode_fp8(const float *q, const uint8_t *k_cache, const uint8_t *v_cache,
                        const int32_t *tables, const int32_t *seq_lens, float *out,
                        int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t block_size, int64_t table_width,
                        float scale, float k_scale, float v_scale, int num_threads) {
    return paged_decode(q, k_cache, v_cache, 1, tables, seq_lens, out, num_seqs, num_heads,
                        num_kv_heads, head_dim, block_size, table_width, scale,
                        256.0f * k_scale, 256.0f * v_scale, 0, NULL, 0.0f, num_threads);
}

/* Either cache (`fp8`; k_scale / v_scale ignored for fp32) over a sliding window, with
 * attention sinks and with logit soft-capping (`softcap` > 0; see the head of this file). */
int bg_paged_decode_windowed(const float *q, const void *k_cache, const void *v_cache, int fp8,
                             const int32_t *tables, const int32_t *seq_lens, float *out,
                             int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t block_size, int64_t table_width,
                             float scale, float k_scale, float v_scale, int64_t window,
                             const float *sinks, float softcap, int num_threads) {
    const float qf = fp8 ? 256.0f * k_scale : 1.0f, of = fp8 ? 256.0f * v_scale : 1.0f;
    return paged_decode(q, k_cache, v_cache, fp8, tables, seq_lens, out, num_seqs, num_heads,
                        num_kv_heads, head_dim, block_size, table_width, scale, qf, of, window,
                        sinks, softcap, num_threads);
}
