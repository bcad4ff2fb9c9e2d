/* Y = X W^T (+ bias) for a few rows of X, for the CPU (fp32): the matmuls of a decode step.
 *
 * A decode step multiplies 1-16 token rows by every weight matrix, so its cost is reading the
 * weights once from memory. Library GEMMs tune for many rows: at 4-8 rows MKL's sgemm ran at
 * about half the memory bandwidth here and oneDNN's packed kernel at ~2/3 of it. This kernel
 * keeps the weight in its [N, K] layout and works on a block of NB weight rows at a time: it
 * streams the block once from memory (with software prefetch a little ahead), and while the
 * block sits in L1/L2 it takes dot products with every X row, MT rows at a time, in
 * NB x MT vector accumulators (16 lanes each), summed across lanes at the end of K. Threads
 * (OpenMP) split the weight rows, so each thread streams its own contiguous part of W.
 *
 * Layouts (C-contiguous): X [M, K], W [N, K], bias [N] or NULL, Y [M, N].
 * Needs AVX-512F; `bg_small_gemm_supported()` says whether this build has it. The summation
 * order differs from MKL's, so results match F.linear to float rounding, not bit for bit.
 * Built and loaded by kernels/cpu/build.py.
 */
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>

/* NB x MT accumulators + NB weight vectors + one X vector = 31 of the 32 vector registers.
 * 6 x 4 measured best among 8x3, 4x6, 6x4, 4x4, 8x2 and 5x5 at 4-24 rows (the SmolLM2-135M
 * weight shapes, 2 threads); 1 KiB beat 512 B and 2 KiB of prefetch distance. */
#ifndef NB
#define NB 6    /* weight rows per block */
#endif
#ifndef MT
#define MT 4    /* X rows per tile */
#endif
#ifndef PF
#define PF 256  /* prefetch distance in floats (1 KiB) along each weight row */
#endif

static inline __attribute__((always_inline)) void tile(const float *X, int64_t K,
                                                       const float *W, float *Y, int64_t ldy,
                                                       const float *bias, const int mt,
                                                       const int nb) {
    __m512 acc[MT][NB];
    _Pragma("GCC unroll 16") for (int m = 0; m < mt; m++)
        _Pragma("GCC unroll 16") for (int j = 0; j < nb; j++) acc[m][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 w[NB];
        _Pragma("GCC unroll 16") for (int j = 0; j < nb; j++) {
            w[j] = _mm512_loadu_ps(W + j * K + k);
            _mm_prefetch((const char *)(W + j * K + k + PF), _MM_HINT_T0);
        }
        _Pragma("GCC unroll 16") for (int m = 0; m < mt; m++) {
            const __m512 x = _mm512_loadu_ps(X + m * K + k);
            _Pragma("GCC unroll 16") for (int j = 0; j < nb; j++)
                acc[m][j] = _mm512_fmadd_ps(x, w[j], acc[m][j]);
        }
    }
    if (k < K) { /* the last K % 16 columns, masked */
        const __mmask16 mask = (__mmask16)((1u << (K - k)) - 1u);
        __m512 w[NB];
        _Pragma("GCC unroll 16") for (int j = 0; j < nb; j++)
            w[j] = _mm512_maskz_loadu_ps(mask, W + j * K + k);
        _Pragma("GCC unroll 16") for (int m = 0; m < mt; m++) {
            const __m512 x = _mm512_maskz_loadu_ps(mask, X + m * K + k);
            _Pragma("GCC unroll 16") for (int j = 0; j < nb; j++)
                acc[m][j] = _mm512_fmadd_ps(x, w[j], acc[m][j]);
        }
    }
    _Pragma("GCC unroll 16") for (int m = 0; m < mt; m++)
        _Pragma("GCC unroll 16") for (int j = 0; j < nb; j++) {
            const float s = _mm512_reduce_add_ps(acc[m][j]);
            Y[m * ldy + j] = bias ? s + bias[j] : s;
        }
}

/* One block of nb weight rows against mt X rows; the full-size cases get unrolled code. */
static void block(const float *X, int64_t K, const float *W, float *Y, int64_t ldy,
                  const float *bias, int mt, int nb) {
    if (nb == NB) {
        switch (mt) {
#if MT >= 6
        case 6: tile(X, K, W, Y, ldy, bias, 6, NB); return;
#endif
#if MT >= 5
        case 5: tile(X, K, W, Y, ldy, bias, 5, NB); return;
#endif
#if MT >= 4
        case 4: tile(X, K, W, Y, ldy, bias, 4, NB); return;
#endif
#if MT >= 3
        case 3: tile(X, K, W, Y, ldy, bias, 3, NB); return;
#endif
#if MT >= 2
        case 2: tile(X, K, W, Y, ldy, bias, 2, NB); return;
#endif
        default: tile(X, K, W, Y, ldy, bias, 1, NB); return;
        }
    }
    for (int m = 0; m < mt; m++) /* the last few weight rows */
        for (int j = 0; j < nb; j++)
            tile(X + m * K, K, W + j * K, Y + m * ldy + j, ldy, bias ? bias + j : 0, 1, 1);
}

int bg_small_gemm_supported(void) { return 1; }

int bg_small_gemm_f32(const float *X, const float *W, const float *bias, float *Y, int64_t M,
                      int64_t N, int64_t K, int num_threads) {
    const int64_t nblocks = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t n0 = b * NB;
        const int nb = (int)((N - n0) < NB ? (N - n0) : NB);
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            const int mt = (int)((M - m0) < MT ? (M - m0) : MT);
            block(X + m0 * K, K, W + n0 * K, Y + m0 * N + n0, N, bias ? bias + n0 : 0, mt, nb);
        }
    }
    return 0;
}

#else /* no AVX-512 in this build: the caller keeps the library matmul */

int bg_small_gemm_supported(void) { return 0; }

int bg_small_gemm_f32(const float *X, const float *W, const float *bias, float *Y, int64_t M,
                      int64_t N, int64_t K, int num_threads) {
    (void)X; (void)W; (void)bias; (void)Y; (void)M; (void)N; (void)K; (void)num_threads;
    return -1;
}

#endif
