/* The routed experts of one MoE layer for a few tokens, in one call (fp32, AVX2 + FMA).
 *
 * out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = ids[t, j], for the
 * T tokens of a decode step (or a short prefill chunk). Torch's path for this is a sort, a
 * gather, two grouped matmuls, the activation and a scatter-add: about ten dispatches per
 * layer, each costing more than its arithmetic at a few tokens, and matmul kernels tuned for
 * many rows. Here:
 *   1. the (token, choice) pairs are bucketed by expert (a counting sort, one thread);
 *   2. gate/up: threads take (expert, 8 intermediate columns) items; each item streams its 8
 *      gate rows and 8 up rows of the expert's w13 once and takes their dot products with every
 *      token the expert received, then applies SiLU(gate) * up into inter [pairs, I];
 *   3. down: threads take slices of the H output columns and, for each active expert, stream
 *      those rows of w2 once against the expert's inter rows, adding weight * result to out.
 * Each thread writes only its own columns in both phases, so there are no atomics, and one
 * barrier separates the phases. An expert without tokens costs nothing.
 *
 * Weights stay in the layer's own layout (`FusedMoE.w13` [E, 2I, H]: rows 0..I-1 gate,
 * I..2I-1 up; `w2` [E, H, I]), so nothing is copied or repacked. Dot products sum in another
 * order than a BLAS matmul, so results agree with torch to float rounding.
 *
 * Layouts (C-contiguous): X [T, H], W13 [E, 2I, H], W2 [E, H, I], ids [T, k] int64 (each in
 * [0, E)), wts [T, k] f32, out [T, H], work: `bg_moe_experts_workspace(T, k, E, I)` bytes.
 * Built and loaded by kernels/cpu/build.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Pair bookkeeping + the gate|up values: (2E + 1 + P) int64 + P * 2I floats, P = T * k. */
int64_t bg_moe_experts_workspace(int64_t T, int64_t k, int64_t E, int64_t I) {
    const int64_t P = T * k;
    return (2 * E + 1 + P) * (int64_t)sizeof(int64_t) + P * 2 * I * (int64_t)sizeof(float);
}

#include "avx2_dot.h"

#if defined(__AVX2__) && defined(__FMA__)
#define CJ 8   /* intermediate columns per gate/up work item */
#define CH 16  /* output columns per down work item */
int bg_moe_experts_supported(void) { return 1; }

int bg_moe_experts_f32(const float *X, const float *W13, const float *W2, const int64_t *ids,
                       const float *wts, float *out, void *work, int64_t T, int64_t k,
                       int64_t E, int64_t H, int64_t I, int num_threads) {
    const int64_t P = T * k;
    int64_t *start = (int64_t *)work;       /* [E + 1] first sorted pair of each expert */
    int64_t *fill = start + E + 1;          /* [E] scratch: next free slot per expert */
    int64_t *pair = fill + E;               /* [P] sorted position -> pair t * k + j */
    float *gu = (float *)(pair + P);        /* [P, 2I]: gate, then (after SiLU) inter */
    memset(start, 0, (size_t)(E + 1) * sizeof(int64_t));
    for (int64_t p = 0; p < P; p++) {
        if (ids[p] < 0 || ids[p] >= E) return -2;
        start[ids[p] + 1]++;
    }
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    memcpy(fill, start, (size_t)E * sizeof(int64_t));
    for (int64_t p = 0; p < P; p++) pair[fill[ids[p]]++] = p; /* stable: tokens in order */
    const int64_t col_items = (I + CJ - 1) / CJ, out_items = (H + CH - 1) / CH;

#pragma omp parallel num_threads(num_threads)
    {
        const float *xr[64];
#pragma omp for schedule(dynamic, 4)
        for (int64_t item = 0; item < E * col_items; item++) {
            const int64_t e = item / col_items, j0 = (item % col_items) * CJ;
            const int64_t n = I - j0 < CJ ? I - j0 : CJ, s = start[e], cnt = start[e + 1] - s;
            const float *Wg = W13 + (e * 2 * I + j0) * H, *Wu = Wg + I * H;
            for (int64_t r0 = 0; r0 < cnt; r0 += 64) { /* 64 token rows at a time */
                const int64_t rows = cnt - r0 < 64 ? cnt - r0 : 64;
                for (int64_t r = 0; r < rows; r++) xr[r] = X + (pair[s + r0 + r] / k) * H;
                float *g = gu + (s + r0) * 2 * I + j0, *u = g + I;
                dots(xr, rows, Wg, n, H, g, 2 * I);
                dots(xr, rows, Wu, n, H, u, 2 * I);
                for (int64_t r = 0; r < rows; r++)
                    for (int64_t j = 0; j < n; j++) {
                        const float gv = g[r * 2 * I + j];
                        g[r * 2 * I + j] = gv / (1.0f + expf(-gv)) * u[r * 2 * I + j];
                    }
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < out_items; item++) {
            const int64_t h0 = item * CH, n = H - h0 < CH ? H - h0 : CH;
            float y[64 * CH];
            for (int64_t t = 0; t < T; t++) memset(out + t * H + h0, 0, (size_t)n * sizeof(float));
            for (int64_t e = 0; e < E; e++) {
                const int64_t s = start[e], cnt = start[e + 1] - s;
                for (int64_t r0 = 0; r0 < cnt; r0 += 64) {
                    const int64_t rows = cnt - r0 < 64 ? cnt - r0 : 64;
                    for (int64_t r = 0; r < rows; r++) xr[r] = gu + (s + r0 + r) * 2 * I;
                    dots(xr, rows, W2 + (e * H + h0) * I, n, I, y, CH);
                    for (int64_t r = 0; r < rows; r++) {
                        const int64_t p = pair[s + r0 + r];
                        float *o = out + (p / k) * H + h0;
                        for (int64_t j = 0; j < n; j++) o[j] += wts[p] * y[r * CH + j];
                    }
                }
            }
        }
    }
    return 0;
}

#else /* no AVX2/FMA in this build: the caller keeps the torch path */

int bg_moe_experts_supported(void) { return 0; }

int bg_moe_experts_f32(const float *X, const float *W13, const float *W2, const int64_t *ids,
                       const float *wts, float *out, void *work, int64_t T, int64_t k,
                       int64_t E, int64_t H, int64_t I, int num_threads) {
    (void)X; (void)W13; (void)W2; (void)ids; (void)wts; (void)out; (void)work; (void)T;
    (void)k; (void)E; (void)H; (void)I; (void)num_threads;
    return -1;
}

#endif
