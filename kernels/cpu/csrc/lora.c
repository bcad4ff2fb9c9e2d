/* The LoRA deltas of one linear layer for a step whose rows run under many adapters (fp32 CPU,
 * AVX2 + FMA): y[t] += (x[t] A_l^T) B_l^T for every row t of each adapter segment.
 *
 * With torch ops a decode step's deltas are several small ops per adapted layer (gathers, two
 * batched matmuls, a scatter-add), whose dispatch costs far more than the products' few FLOPs.
 * This is one call per layer that reads each segment's rows in place (no gather), each slot's
 * A and B once per block of rows, and adds into y in place (no scatter); the whole-step C
 * decode stack (decode_stack.c) calls it too, so a LoRA decode step runs there.
 *
 * Layouts (C-contiguous): X rows of K floats at stride ldx; Y rows at stride ldy;
 * A [L, nshards * R, K]: the shards' A stacked (rows i R .. i R + R - 1 belong to shard i, zero
 * rows past an adapter's rank), so one shrink serves a fused q|k|v or gate|up layer;
 * BT [L, R, ldb]: B transposed (the scale folded in), its columns [shard_ends[i - 1],
 * shard_ends[i]) multiplied by the shard's R columns of h; rows ldb >= N floats apart (the
 * layer pads them: at N = 3072 the 16 rows of a tile 12 KiB apart fell into one L1 set and the
 * expand ran at half speed). Segment s is the rows
 * tok[seg_starts[s] .. seg_starts[s + 1]) under slot seg_slots[s]; each row at most once.
 *
 * Per block of up to ROWS rows of a segment: h = dots of the rows with A's rows (avx2_dot.h),
 * then y += h B^T in tiles of 4 rows x 16 columns. Every row's arithmetic is the same whatever the blocks and threads (bit for bit
 * reproducible); the order of sums differs from torch's matmuls (float rounding).
 * Built and loaded by kernels/cpu/build.py; driven by batchgen_data/kernels/cpu/lora.py.
 */
#include <stdint.h>
#include <stdlib.h>

#include "avx2_dot.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define ROWS 32   /* rows of one segment per block: h [ROWS, nshards R] */
#define EX_MT 4   /* rows per expand tile: 4 x 2 accumulators + 2 B vectors */

int bg_lora_supported(void) { return 1; }

/* ys[m][0..16) += sum_r h[m * ldh + r] * B[r * ldb + 0..16), m < mt; `cols` < 16 masks. */
static inline __attribute__((always_inline)) void expand_tile(float *const *ys, const int mt,
                                                              const float *h, int64_t ldh,
                                                              const float *B, int64_t ldb,
                                                              int64_t R, int64_t cols) {
    __m256 acc[EX_MT][2];
    if (cols == 16) {
        for (int m = 0; m < mt; m++) {
            acc[m][0] = _mm256_loadu_ps(ys[m]);
            acc[m][1] = _mm256_loadu_ps(ys[m] + 8);
        }
        for (int64_t r = 0; r < R; r++) {
            const __m256 b0 = _mm256_loadu_ps(B + r * ldb), b1 = _mm256_loadu_ps(B + r * ldb + 8);
            for (int m = 0; m < mt; m++) {
                const __m256 hv = _mm256_broadcast_ss(h + m * ldh + r);
                acc[m][0] = _mm256_fmadd_ps(hv, b0, acc[m][0]);
                acc[m][1] = _mm256_fmadd_ps(hv, b1, acc[m][1]);
            }
        }
        for (int m = 0; m < mt; m++) {
            _mm256_storeu_ps(ys[m], acc[m][0]);
            _mm256_storeu_ps(ys[m] + 8, acc[m][1]);
        }
        return;
    }
    const __m256i k0 = tail_mask(cols < 8 ? cols : 8);
    const __m256i k1 = cols > 8 ? tail_mask(cols - 8) : _mm256_setzero_si256();
    for (int m = 0; m < mt; m++) {
        acc[m][0] = _mm256_maskload_ps(ys[m], k0);
        acc[m][1] = _mm256_maskload_ps(ys[m] + 8, k1);
    }
    for (int64_t r = 0; r < R; r++) {
        const __m256 b0 = _mm256_maskload_ps(B + r * ldb, k0);
        const __m256 b1 = _mm256_maskload_ps(B + r * ldb + 8, k1);
        for (int m = 0; m < mt; m++) {
            const __m256 hv = _mm256_broadcast_ss(h + m * ldh + r);
            acc[m][0] = _mm256_fmadd_ps(hv, b0, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(hv, b1, acc[m][1]);
        }
    }
    for (int m = 0; m < mt; m++) {
        _mm256_maskstore_ps(ys[m], k0, acc[m][0]);
        _mm256_maskstore_ps(ys[m] + 8, k1, acc[m][1]);
    }
}

/* One block: rows tok[0..n) (n <= ROWS) of one segment under A_l, BT_l (rows ldb apart). */
static void block(const float *X, int64_t ldx, float *Y, int64_t ldy, int64_t K,
                  const float *Al, const float *Bl, int64_t ldb, int64_t R, int64_t nshards,
                  const int64_t *shard_ends, const int64_t *tok, int64_t n, float *h) {
    const int64_t W = nshards * R;
    const float *xs[ROWS];
    for (int64_t m = 0; m < n; m++) xs[m] = X + tok[m] * ldx;
    dots(xs, n, Al, W, K, h, W); /* h [n, W] */
    float *ys[EX_MT];
    /* rows outer, columns inner: each tile's y lines follow the last one's (B's lines come
     * from L1/L2 again, 16 KiB a rank-16 tile row), where columns outer would walk y's
     * lines of a prefill chunk out of cache */
    for (int64_t m0 = 0; m0 < n; m0 += EX_MT) {
        const int64_t mt = n - m0 < EX_MT ? n - m0 : EX_MT;
        for (int64_t i = 0, o0 = 0; i < nshards; o0 = shard_ends[i], i++) {
            const float *hm = h + m0 * W + i * R;
            for (int64_t o = o0; o < shard_ends[i]; o += 16) {
                const int64_t cols = shard_ends[i] - o < 16 ? shard_ends[i] - o : 16;
                for (int64_t m = 0; m < mt; m++) ys[m] = Y + tok[m0 + m] * ldy + o;
                /* constant row counts, so each call unrolls its row loops */
                if (mt == 4) expand_tile(ys, 4, hm, W, Bl + o, ldb, R, cols);
                else if (mt == 3) expand_tile(ys, 3, hm, W, Bl + o, ldb, R, cols);
                else if (mt == 2) expand_tile(ys, 2, hm, W, Bl + o, ldb, R, cols);
                else expand_tile(ys, 1, hm, W, Bl + o, ldb, R, cols);
            }
        }
    }
}

/* Returns 0; -1 when the scratch space cannot be allocated, -2 for a bad shape. */
int bg_lora_f32(const float *X, int64_t ldx, float *Y, int64_t ldy, int64_t K, const float *A,
                const float *BT, int64_t ldb, int64_t R, int64_t nshards,
                const int64_t *shard_ends, const int64_t *tok, const int64_t *seg_starts,
                const int64_t *seg_slots, int64_t S, int num_threads) {
    if (R <= 0 || nshards <= 0 || K <= 0 || ldb < shard_ends[nshards - 1]) return -2;
    const int64_t N = shard_ends[nshards - 1], W = nshards * R;
    /* work units: (segment, block of ROWS rows); unit u of segment s starts at first[s] */
    int64_t units = 0;
    for (int64_t s = 0; s < S; s++) units += (seg_starts[s + 1] - seg_starts[s] + ROWS - 1) / ROWS;
    if (units == 0) return 0;
    const int64_t rows = seg_starts[S] - seg_starts[0];
    /* threads only for work that pays for waking them (a prefill chunk), never for a few
     * decode rows: the result is the same either way */
    const int nt = rows * (W * K + R * N) >= (1 << 20) ? num_threads : 1;
    int err = 0;
#pragma omp parallel num_threads(nt) reduction(| : err)
    {
        float *h = malloc(sizeof(float) * (size_t)(ROWS * W));
        if (!h) err = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < units; u++) {
            if (!h) continue;
            int64_t s = 0, left = u, nb = 0;
            for (; s < S; s++) { /* the unit's segment (S is small: at most max_loras) */
                nb = (seg_starts[s + 1] - seg_starts[s] + ROWS - 1) / ROWS;
                if (left < nb) break;
                left -= nb;
            }
            const int64_t start = seg_starts[s] + left * ROWS;
            const int64_t n = seg_starts[s + 1] - start < ROWS ? seg_starts[s + 1] - start : ROWS;
            block(X, ldx, Y, ldy, K, A + seg_slots[s] * W * K, BT + seg_slots[s] * R * ldb, ldb,
                  R, nshards, shard_ends, tok + start, n, h);
        }
        free(h);
    }
    return err ? -1 : 0;
}

#else /* no AVX2/FMA in this build: the caller keeps the torch path */

int bg_lora_supported(void) { return 0; }

int bg_lora_f32(const float *X, int64_t ldx, float *Y, int64_t ldy, int64_t K, const float *A,
                const float *BT, int64_t ldb, int64_t R, int64_t nshards,
                const int64_t *shard_ends, const int64_t *tok, const int64_t *seg_starts,
                const int64_t *seg_slots, int64_t S, int num_threads) {
    (void)X; (void)ldx; (void)Y; (void)ldy; (void)K; (void)A; (void)BT; (void)ldb; (void)R;
    (void)nshards;
    (void)shard_ends; (void)tok; (void)seg_starts; (void)seg_slots; (void)S; (void)num_threads;
    return -1;
}

#endif
