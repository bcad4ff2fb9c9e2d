/* Y = X W^T for a few rows of X on the plain [N, K] weight layout (fp32, AVX2 + FMA).
 *
 * The output projection of a tied-embedding model keeps the embedding's plain rows (a lookup
 * needs them), and on a CPU without AVX-512 torch multiplies them with MKL's sgemm: at 8-32 rows
 * that ran at about a third of the machine's FMA peak and well under its memory bandwidth in
 * the MoE benchmark (`benchmarks/moe_step_profile.py`, a 49k-row vocabulary). Here threads split
 * the weight rows in blocks of RB; each block is read from memory once and, while it sits in
 * L1, multiplied with every row of X (avx2_dot.h). Results match F.linear to float rounding.
 *
 * Layouts (C-contiguous): X [M, K], W [N, K], Y [M, N]. Built and loaded by build.py.
 */
#include <stdint.h>

#include "avx2_dot.h"

#if defined(__AVX2__) && defined(__FMA__)
#define RB 8       /* weight rows per block: 8 rows of K = 512 floats are 16 KiB */
#define XROWS 64   /* X rows per pass over a block */

int bg_rows_gemm_supported(void) { return 1; }

int bg_rows_gemm_f32(const float *X, const float *W, float *Y, int64_t M, int64_t N, int64_t K,
                     int num_threads) {
    const int64_t blocks = (N + RB - 1) / RB;
#pragma omp parallel num_threads(num_threads)
    {
        const float *xs[XROWS];
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t n0 = b * RB, n = N - n0 < RB ? N - n0 : RB;
            for (int64_t m0 = 0; m0 < M; m0 += XROWS) {
                const int64_t rows = M - m0 < XROWS ? M - m0 : XROWS;
                for (int64_t r = 0; r < rows; r++) xs[r] = X + (m0 + r) * K;
                dots(xs, rows, W + n0 * K, n, K, Y + m0 * N + n0, N);
            }
        }
    }
    return 0;
}

#else /* no AVX2/FMA in this build: the caller keeps F.linear */

int bg_rows_gemm_supported(void) { return 0; }

int bg_rows_gemm_f32(const float *X, const float *W, float *Y, int64_t M, int64_t N, int64_t K,
                     int num_threads) {
    (void)X; (void)W; (void)Y; (void)M; (void)N; (void)K; (void)num_threads;
    return -1;
}

#endif
