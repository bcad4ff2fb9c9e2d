/* Y = X W^T (+ bias) on weights repacked into column panels, for the CPU (fp32): the matmuls of
 * decode steps with more rows than `small_gemm.c` serves well.
 *
 * `bg_panel_pack_f32` copies W [N, K] once, at load time, into panels of PANEL = 48 output
 * columns: panel p holds, for every k, the 48 values W[48p .. 48p + 47][k] side by side (the last
 * panel zero-padded). The product then needs no horizontal sums: for a tile of up to MR = 8 rows
 * of X and one panel, each k loads three vectors of the panel, broadcasts the 8 X values and
 * does 24 FMAs into 24 accumulators (the classic outer-product micro-kernel of BLAS libraries).
 * A panel is read from memory once and from L2 for the next row tiles. Threads (OpenMP) split
 * the panels.
 *
 * Layouts (C-contiguous): X [M, K], packed [ceil(N / 48), K, 48], bias [N] or NULL, Y [M, N].
 * Needs AVX-512F; `bg_panel_gemm_supported()` says whether this build has it. Results match
 * F.linear to float rounding (another summation order), not bit for bit.
 * Built and loaded by kernels/cpu/build.py.
 */
#include <stdint.h>
#include <string.h>

#define PANEL 48

int64_t bg_panel_packed_floats(int64_t N, int64_t K) { return (N + PANEL - 1) / PANEL * PANEL * K; }

void bg_panel_pack_f32(const float *W, float *packed, int64_t N, int64_t K, int num_threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; ++p) {
        float *dst = packed + p * K * PANEL;
        for (int64_t k = 0; k < K; ++k)
            for (int64_t j = 0; j < PANEL; ++j) {
                const int64_t n = p * PANEL + j;
                dst[k * PANEL + j] = n < N ? W[n * K + k] : 0.0f;
            }
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>

#define MR 8

static inline __attribute__((always_inline)) void tile(const float *X, int64_t K,
                                                       const float *P, float *Y, int64_t ldy,
                                                       const float *bias, int64_t cols,
                                                       const int mr) {
    __m512 acc[MR][3];
    _Pragma("GCC unroll 8") for (int r = 0; r < mr; ++r) {
        acc[r][0] = _mm512_setzero_ps();
        acc[r][1] = _mm512_setzero_ps();
        acc[r][2] = _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < K; ++k) {
        const float *pk = P + k * PANEL;
        const __m512 b0 = _mm512_loadu_ps(pk), b1 = _mm512_loadu_ps(pk + 16),
                     b2 = _mm512_loadu_ps(pk + 32);
        _mm_prefetch((const char *)(pk + 8 * PANEL), _MM_HINT_T0);
        _Pragma("GCC unroll 8") for (int r = 0; r < mr; ++r) {
            const __m512 a = _mm512_set1_ps(X[r * K + k]);
            acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(a, b2, acc[r][2]);
        }
    }
    __m512 bv[3];
    for (int c = 0; c < 3; ++c) {
        const int64_t left = cols - 16 * c;
        const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF
                          : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u);
        bv[c] = bias ? _mm512_maskz_loadu_ps(m, bias + 16 * c) : _mm512_setzero_ps();
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < mr; ++r)
        for (int c = 0; c < 3; ++c) {
            const int64_t left = cols - 16 * c;
            if (left <= 0) break;
            const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
            _mm512_mask_storeu_ps(Y + r * ldy + 16 * c, m, _mm512_add_ps(acc[r][c], bv[c]));
        }
}

int bg_panel_gemm_supported(void) { return 1; }

int bg_panel_gemm_f32(const float *X, const float *packed, const float *bias, float *Y,
                      int64_t M, int64_t N, int64_t K, int num_threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; ++p) {
        const float *P = packed + p * K * PANEL;
        const int64_t n0 = p * PANEL;
        const int64_t cols = N - n0 < PANEL ? N - n0 : PANEL;
        const float *bp = bias ? bias + n0 : 0;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int mr = (int)(M - m0 < MR ? M - m0 : MR);
            const float *Xm = X + m0 * K;
            float *Ym = Y + m0 * N + n0;
            switch (mr) {
            case 8: tile(Xm, K, P, Ym, N, bp, cols, 8); break;
            case 7: tile(Xm, K, P, Ym, N, bp, cols, 7); break;
            case 6: tile(Xm, K, P, Ym, N, bp, cols, 6); break;
            case 5: tile(Xm, K, P, Ym, N, bp, cols, 5); break;
            case 4: tile(Xm, K, P, Ym, N, bp, cols, 4); break;
            case 3: tile(Xm, K, P, Ym, N, bp, cols, 3); break;
            case 2: tile(Xm, K, P, Ym, N, bp, cols, 2); break;
            default: tile(Xm, K, P, Ym, N, bp, cols, 1); break;
            }
        }
    }
    return 0;
}

#else /* no AVX-512 in this build: the caller keeps the library matmul */

int bg_panel_gemm_supported(void) { return 0; }

int bg_panel_gemm_f32(const float *X, const float *packed, const float *bias, float *Y,
                      int64_t M, int64_t N, int64_t K, int num_threads) {
    (void)X; (void)packed; (void)bias; (void)Y; (void)M; (void)N; (void)K; (void)num_threads;
    return -1;
}

#endif
