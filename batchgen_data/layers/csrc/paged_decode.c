/* Decode attention over the paged KV cache, for the CPU (fp32).
 *
 * One query token per sequence. For each (sequence, KV head) pair, the query heads of that KV
 * group score every cached key, read straight out of its block (no gather into a dense copy),
 * then a softmax and the weighted sum of the values. Work is spread over OpenMP threads by pair.
 * The head size is a compile-time constant (one function per supported size), so a query row and
 * an output accumulator stay in vector registers while a block of keys or values streams by.
 *
 * Layouts (all C-contiguous):
 *   q        [num_seqs, num_heads, head_dim]
 *   k_cache  [num_blocks, block_size, num_kv_heads, head_dim]   (v_cache the same)
 *   tables   [num_seqs, table_width]  int32 block ids
 *   seq_lens [num_seqs]               int32 tokens to attend to (the new one included)
 *   out      [num_seqs, num_heads, head_dim]
 * Returns 0, -1 when a score buffer could not be allocated, -2 for an unsupported head size.
 * Built and loaded by batchgen_data/layers/cpu_attention.py (plain C: no torch headers, so the
 * build takes well under a second).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* One (sequence, KV head) pair; the query rows are pre-scaled by `scale`. */
#define DEFINE_PAIR(D)                                                                          \
static void pair_##D(const float *qs, float *os, const float *k_cache, const float *v_cache,   \
                     const int32_t *table, int64_t len, int64_t group, int64_t row,            \
                     int64_t block_size, int64_t block_stride, int64_t head_off, float scale,  \
                     float *scores) {                                                           \
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {                                          \
        const float *kb = k_cache + (int64_t)table[t0 / block_size] * block_stride + head_off;  \
        const int64_t n = len - t0 < block_size ? len - t0 : block_size;                        \
        for (int64_t g = 0; g < group; ++g) {                                                   \
            float qg[D];                                                                        \
            for (int64_t d = 0; d < D; ++d) qg[d] = qs[g * D + d] * scale;                      \
            float *sg = scores + g * len + t0;                                                  \
            for (int64_t i = 0; i < n; ++i) {                                                   \
                const float *k = kb + i * row;                                                  \
                float acc = 0.0f;                                                               \
                _Pragma("omp simd reduction(+:acc)")                                            \
                for (int64_t d = 0; d < D; ++d) acc += qg[d] * k[d];                            \
                sg[i] = acc;                                                                    \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    for (int64_t g = 0; g < group; ++g) {                                                       \
        float *sg = scores + g * len;                                                           \
        float mx = -INFINITY;                                                                   \
        for (int64_t t = 0; t < len; ++t) mx = sg[t] > mx ? sg[t] : mx;                         \
        float sum = 0.0f;                                                                       \
        for (int64_t t = 0; t < len; ++t) { sg[t] = expf(sg[t] - mx); sum += sg[t]; }          \
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;                                       \
        for (int64_t t = 0; t < len; ++t) sg[t] *= inv;                                         \
    }                                                                                           \
    for (int64_t g = 0; g < group; ++g) {                                                       \
        float acc[D];                                                                           \
        for (int64_t d = 0; d < D; ++d) acc[d] = 0.0f;                                          \
        const float *sg = scores + g * len;                                                     \
        for (int64_t t0 = 0; t0 < len; t0 += block_size) {                                      \
            const float *vb = v_cache + (int64_t)table[t0 / block_size] * block_stride + head_off; \
            const int64_t n = len - t0 < block_size ? len - t0 : block_size;                    \
            for (int64_t i = 0; i < n; ++i) {                                                   \
                const float p = sg[t0 + i];                                                     \
                const float *v = vb + i * row;                                                  \
                _Pragma("omp simd")                                                             \
                for (int64_t d = 0; d < D; ++d) acc[d] += p * v[d];                             \
            }                                                                                   \
        }                                                                                       \
        for (int64_t d = 0; d < D; ++d) os[g * D + d] = acc[d];                                 \
    }                                                                                           \
}
DEFINE_PAIR(16)
DEFINE_PAIR(32)
DEFINE_PAIR(64)
DEFINE_PAIR(128)
DEFINE_PAIR(256)

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
    const int64_t pairs = num_seqs * num_kv_heads;
    const int64_t row = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * row;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t pair = 0; pair < pairs; ++pair) {
        const int64_t s = pair / num_kv_heads, h = pair % num_kv_heads;
        const int64_t len = seq_lens[s];
        const int32_t *table = tables + s * table_width;
        const float *qs = q + (s * num_heads + h * group) * head_dim;
        float *os = out + (s * num_heads + h * group) * head_dim;
        float *scores = (float *)malloc(sizeof(float) * (size_t)(group * (len > 0 ? len : 1)));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
#define RUN_PAIR(D) pair_##D(qs, os, k_cache, v_cache, table, len, group, row, block_size, \
                            block_stride, h * (D), scale, scores)
        switch (head_dim) {
            case 16: RUN_PAIR(16); break;
            case 32: RUN_PAIR(32); break;
            case 64: RUN_PAIR(64); break;
            case 128: RUN_PAIR(128); break;
            default: RUN_PAIR(256); break;
        }
#undef RUN_PAIR
        free(scores);
    }
    return failed ? -1 : 0;
}
