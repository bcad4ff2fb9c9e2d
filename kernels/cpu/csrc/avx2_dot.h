/* Dot products of a few activation rows with weight rows in the plain [N, K] layout, on 8
 * float lanes (AVX2 + FMA): the shared core of moe_experts.c and rows_gemm.c.
 *
 * `dots` walks 4 weight rows at a time against up to DOT_MT activation rows (given as pointers, so
 * a caller can gather tokens without copying them) in DOT_MT x 4 vector accumulators, each weight
 * vector loaded once per tile; lanes are summed at the end of K. Any K: the last K % 8 columns
 * are read through a mask. Summation order differs from a BLAS matmul (float rounding).
 */
#ifndef BATCHGEN_AVX2_DOT_H
#define BATCHGEN_AVX2_DOT_H
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <stdint.h>

#define DOT_MT 3 /* activation rows per tile: 3 x 4 accumulators = 12 of the 16 vector registers */

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Lanes [0, rem) of a K-tail load (rem in 1..7); the rest read as 0. */
static inline __m256i tail_mask(int64_t rem) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)rem), lane);
}

/* acc[m][j] += x_m * w_j over one 8-column step (the x rows' vectors loaded here). */
#define DOT_STEP(LOADX)                                                                        \
    for (int m = 0; m < DOT_MT; m++) {                                                         \
        if (m >= mt) break;                                                                    \
        const __m256 x = LOADX;                                                                \
        acc[m][0] = _mm256_fmadd_ps(x, w0, acc[m][0]);                                         \
        acc[m][1] = _mm256_fmadd_ps(x, w1, acc[m][1]);                                         \
        acc[m][2] = _mm256_fmadd_ps(x, w2, acc[m][2]);                                         \
        acc[m][3] = _mm256_fmadd_ps(x, w3, acc[m][3]);                                         \
    }

/* y[m * ldy + j] = dot(xs[m], W[j * K ...]) for m < mt (<= DOT_MT), j < 4. */
static inline __attribute__((always_inline)) void dot_tile(const float *const *xs, int mt,
                                                           const float *W, int64_t K,
                                                           float *y, int64_t ldy) {
    __m256 acc[DOT_MT][4];
    for (int m = 0; m < DOT_MT; m++)
        for (int j = 0; j < 4; j++) acc[m][j] = _mm256_setzero_ps();
    const int64_t body = K & ~(int64_t)7;
    for (int64_t c = 0; c < body; c += 8) {
        /* the next 4 rows at the same column, one line each per 16 columns: the hardware
         * prefetcher alone does not follow eight row streams of a tall weight */
        if (!(c & 15))
            for (int j = 4; j < 8; j++) _mm_prefetch((const char *)(W + j * K + c), _MM_HINT_T0);
        const __m256 w0 = _mm256_loadu_ps(W + c), w1 = _mm256_loadu_ps(W + K + c);
        const __m256 w2 = _mm256_loadu_ps(W + 2 * K + c), w3 = _mm256_loadu_ps(W + 3 * K + c);
        DOT_STEP(_mm256_loadu_ps(xs[m] + c))
    }
    if (body < K) { /* the last K % 8 columns, masked */
        const __m256i mask = tail_mask(K - body);
        const __m256 w0 = _mm256_maskload_ps(W + body, mask);
        const __m256 w1 = _mm256_maskload_ps(W + K + body, mask);
        const __m256 w2 = _mm256_maskload_ps(W + 2 * K + body, mask);
        const __m256 w3 = _mm256_maskload_ps(W + 3 * K + body, mask);
        DOT_STEP(_mm256_maskload_ps(xs[m] + body, mask))
    }
    for (int m = 0; m < mt; m++)
        for (int j = 0; j < 4; j++) y[m * ldy + j] = hsum8(acc[m][j]);
}

/* One dot product of length K (any K). */
static inline float dot1(const float *x, const float *w, int64_t K) {
    __m256 acc = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 8 <= K; c += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + c), _mm256_loadu_ps(w + c), acc);
    if (c < K) {
        const __m256i mask = tail_mask(K - c);
        acc = _mm256_fmadd_ps(_mm256_maskload_ps(x + c, mask), _mm256_maskload_ps(w + c, mask),
                              acc);
    }
    return hsum8(acc);
}

/* Dot products of `n` weight rows (W, stride K) with the rows xs[0..rows): y[r * ldy + j]. */
static inline void dots(const float *const *xs, int64_t rows, const float *W, int64_t n, int64_t K,
                 float *y, int64_t ldy) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4)
        for (int64_t r = 0; r < rows; r += DOT_MT) {
            /* a constant row count per call, so that the inlined tile unrolls its row loop
             * and keeps the accumulators in registers (a runtime count spills them) */
            const int64_t left = rows - r;
            if (left >= 3)
                dot_tile(xs + r, 3, W + j * K, K, y + r * ldy + j, ldy);
            else if (left == 2)
                dot_tile(xs + r, 2, W + j * K, K, y + r * ldy + j, ldy);
            else
                dot_tile(xs + r, 1, W + j * K, K, y + r * ldy + j, ldy);
        }
    for (; j < n; j++) /* the last n % 4 weight rows */
        for (int64_t r = 0; r < rows; r++) y[r * ldy + j] = dot1(xs[r], W + j * K, K);
}

#endif
#endif
