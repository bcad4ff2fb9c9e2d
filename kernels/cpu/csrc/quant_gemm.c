/* Y = X W^T for a few fp32 rows of X and a weight kept quantized (weight-only), with the
 * weight dequantized inside the product: it is read from memory in its stored bytes (1 byte a
 * weight for INT8 and FP8, half a byte for INT4) and widened to fp32 in registers. A decode
 * step on the CPU is bound by the bytes of weight it reads, so fewer bytes is speed.
 *
 * Stored formats (C-contiguous; built by batchgen_data/layers/quant.py from each checkpoint
 * format):
 *   kind 0, INT8: int8 codes [N, K];
 *   kind 1, INT4: uint8 [N, ceil(K / 2)], column c in the low nibble of byte c / 2 when c is
 *           even, the high one when odd; codes 0..15;
 *   kind 2, FP8:  uint8 [N, K], float8_e4m3fn bit patterns.
 * Scales S [N, G] (fp32) for groups of `group` columns (G = ceil(K / group); the last group
 * may be short: a group size need not divide K); zeros Z [N, G] (fp32) or NULL, which means
 * the kind's default zero `zdef` (0 for INT8, 8 for symmetric INT4). w = (code - z) * s.
 *
 * The product, for up to XROWS rows (a decode step): threads split the weight rows in pairs;
 * each vector of codes is widened in registers and multiplied straight into the rows'
 * accumulators, the scale applied once per group (`fused_rows`), on 16 lanes (AVX-512) or 8
 * (AVX2). An INT4 group of odd size (its start would split a byte) takes the scratch path
 * instead: blocks of RB weight rows widened into a per-thread fp32 scratch, then multiplied
 * there with dot-product tiles (16 lanes on AVX-512, avx2_dot.h's on AVX2).
 * `bg_quant_dequant_f32` writes the whole fp32 weight (the launcher uses it for prefill
 * chunks, which MKL multiplies).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "avx2_dot.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define RB 8      /* weight rows dequantized per block */
#define XROWS 64  /* X rows per pass over a block */

/* float8_e4m3fn -> fp32: the 7 magnitude bits shifted to fp32's exponent/mantissa position
 * read as a float (an fp32 subnormal for e4m3's subnormals, still exact) and rescaled by
 * 2^(127 - 7); the sign bit moves to bit 31. e4m3fn's NaN (0x7f/0xff) is not a weight. */
#define FP8_RESCALE 0x1p120f

static inline float fp8_scalar(uint8_t b) {
    uint32_t bits = ((uint32_t)(b & 0x80) << 24) | ((uint32_t)(b & 0x7f) << 20);
    float f;
    memcpy(&f, &bits, 4);
    return f * FP8_RESCALE;
}

static inline float code_scalar(int kind, const uint8_t *codes, int64_t c) {
    if (kind == 0) return (float)((const int8_t *)codes)[c];
    if (kind == 1) return (float)((codes[c >> 1] >> ((c & 1) * 4)) & 15);
    return fp8_scalar(codes[c]);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define LANES 16
static inline __attribute__((always_inline)) __m512 codes_vec(int kind, const uint8_t *codes, int64_t c) {
    if (kind == 0)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)(codes + c))));
    if (kind == 1) { /* c even: bytes c/2 .. c/2+7 hold columns c .. c+15 */
        const __m128i b = _mm_loadl_epi64((const __m128i *)(codes + (c >> 1)));
        const __m128i dup = _mm_shuffle_epi8(
            b, _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7));
        const __m512i v = _mm512_srlv_epi32(
            _mm512_cvtepu8_epi32(dup),
            _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4));
        return _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    }
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + c)));
    const __m512i bits = _mm512_or_si512(
        _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24),
        _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x7f)), 20));
    return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(FP8_RESCALE));
}
#else
#define LANES 8
static inline __attribute__((always_inline)) __m256 codes_vec(int kind, const uint8_t *codes, int64_t c) {
    if (kind == 0)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64((const __m128i *)(codes + c))));
    if (kind == 1) { /* c even: bytes c/2 .. c/2+3 hold columns c .. c+7 */
        int32_t word;
        memcpy(&word, codes + (c >> 1), 4);
        const __m128i dup = _mm_shuffle_epi8(
            _mm_cvtsi32_si128(word),
            _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1, -1, -1, -1, -1));
        const __m256i v = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(dup),
                                            _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
        return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
    }
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + c)));
    const __m256i bits = _mm256_or_si256(
        _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24),
        _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x7f)), 20));
    return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(FP8_RESCALE));
}
#endif

/* One weight row, dequantized: out[c] = (code(c) - z[c / group]) * s[c / group], c < K. */
static void dequant_row(int kind, const uint8_t *codes, const float *s, const float *z,
                        float zdef, int64_t K, int64_t group, float *out) {
    for (int64_t g = 0, c0 = 0; c0 < K; g++, c0 += group) {
        const int64_t c1 = c0 + group < K ? c0 + group : K;
        const float scale = s[g], zero = z ? z[g] : zdef;
        int64_t c = c0;
        if (kind == 1 && (c & 1)) { /* an odd group start: reach a whole byte first */
            out[c] = (code_scalar(kind, codes, c) - zero) * scale;
            c++;
        }
#if LANES == 16
        const __m512 vs = _mm512_set1_ps(scale), vz = _mm512_set1_ps(zero);
        for (; c + 16 <= c1; c += 16)
            _mm512_storeu_ps(out + c, _mm512_mul_ps(_mm512_sub_ps(codes_vec(kind, codes, c), vz),
                                                    vs));
#else
        const __m256 vs = _mm256_set1_ps(scale), vz = _mm256_set1_ps(zero);
        for (; c + 8 <= c1; c += 8)
            _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_sub_ps(codes_vec(kind, codes, c), vz),
                                                    vs));
#endif
        for (; c < c1; c++) out[c] = (code_scalar(kind, codes, c) - zero) * scale;
    }
}

static inline int64_t row_bytes(int kind, int64_t K) { return kind == 1 ? (K + 1) / 2 : K; }

#if LANES == 16
/* 16-lane dot tile: y[m * ldy + j] = dot(xs[m], W[j * K ...]) for m < mt (<= 4), j < 4. */
#define QMT 4
static inline __attribute__((always_inline)) void dot_tile16(const float *const *xs, int mt,
                                                             const float *W, int64_t K,
                                                             float *y, int64_t ldy) {
    __m512 acc[QMT][4];
    for (int m = 0; m < QMT; m++)
        for (int j = 0; j < 4; j++) acc[m][j] = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 16 <= K; c += 16) {
        const __m512 w0 = _mm512_loadu_ps(W + c), w1 = _mm512_loadu_ps(W + K + c);
        const __m512 w2 = _mm512_loadu_ps(W + 2 * K + c), w3 = _mm512_loadu_ps(W + 3 * K + c);
        for (int m = 0; m < QMT; m++) {
            if (m >= mt) break;
            const __m512 x = _mm512_loadu_ps(xs[m] + c);
            acc[m][0] = _mm512_fmadd_ps(x, w0, acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(x, w1, acc[m][1]);
            acc[m][2] = _mm512_fmadd_ps(x, w2, acc[m][2]);
            acc[m][3] = _mm512_fmadd_ps(x, w3, acc[m][3]);
        }
    }
    if (c < K) { /* the last K % 16 columns, masked */
        const __mmask16 mask = (__mmask16)((1u << (K - c)) - 1);
        const __m512 w0 = _mm512_maskz_loadu_ps(mask, W + c);
        const __m512 w1 = _mm512_maskz_loadu_ps(mask, W + K + c);
        const __m512 w2 = _mm512_maskz_loadu_ps(mask, W + 2 * K + c);
        const __m512 w3 = _mm512_maskz_loadu_ps(mask, W + 3 * K + c);
        for (int m = 0; m < QMT; m++) {
            if (m >= mt) break;
            const __m512 x = _mm512_maskz_loadu_ps(mask, xs[m] + c);
            acc[m][0] = _mm512_fmadd_ps(x, w0, acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(x, w1, acc[m][1]);
            acc[m][2] = _mm512_fmadd_ps(x, w2, acc[m][2]);
            acc[m][3] = _mm512_fmadd_ps(x, w3, acc[m][3]);
        }
    }
    for (int m = 0; m < mt; m++)
        for (int j = 0; j < 4; j++) y[m * ldy + j] = _mm512_reduce_add_ps(acc[m][j]);
}

static inline float dot16(const float *x, const float *w, int64_t K) {
    __m512 acc = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 16 <= K; c += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + c), _mm512_loadu_ps(w + c), acc);
    if (c < K) {
        const __mmask16 mask = (__mmask16)((1u << (K - c)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + c),
                              _mm512_maskz_loadu_ps(mask, w + c), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

static void block_dots(const float *const *xs, int64_t rows, const float *W, int64_t n,
                       int64_t K, float *y, int64_t ldy) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4)
        for (int64_t r = 0; r < rows; r += QMT) { /* constant tile heights: see avx2_dot.h */
            const int64_t left = rows - r;
            if (left >= 4) dot_tile16(xs + r, 4, W + j * K, K, y + r * ldy + j, ldy);
            else if (left == 3) dot_tile16(xs + r, 3, W + j * K, K, y + r * ldy + j, ldy);
            else if (left == 2) dot_tile16(xs + r, 2, W + j * K, K, y + r * ldy + j, ldy);
            else dot_tile16(xs + r, 1, W + j * K, K, y + r * ldy + j, ldy);
        }
    for (; j < n; j++)
        for (int64_t r = 0; r < rows; r++) y[r * ldy + j] = dot16(xs[r], W + j * K, K);
}
#else
static void block_dots(const float *const *xs, int64_t rows, const float *W, int64_t n,
                       int64_t K, float *y, int64_t ldy) {
    dots(xs, rows, W, n, K, y, ldy);
}
#endif

/* ---- widen in registers, no scratch ----------------------------------------------------------
 * For a decode step's rows of X (up to XROWS) storing a weight widened and reading it back cost
 * more than the products (measured against the scratch path below). Here each vector of codes is widened in
 * registers and multiplied straight into the rows' accumulators; the scale is applied once per
 * group (acc * s added into the row's total) and the zero (stored, or INT4's default 8) enters
 * as a per-group correction, s * z * sum(x over the group), from the row sums of X computed
 * once per call: one instruction less per vector than subtracting it from the codes. Two weight rows per tile, so a single
 * row of X still has two independent FMA chains; the rows of X pass FUSED_ROWS at a time over
 * the same two weight rows, which stay in L1, so each weight is read from memory once. */
#define FUSED_ROWS 4
#if LANES == 16
typedef __m512 vf;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VSET(x) _mm512_set1_ps(x)
#define VSUM(v) _mm512_reduce_add_ps(v)
#else
typedef __m256 vf;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VSET(x) _mm256_set1_ps(x)
#define VSUM(v) hsum8(v)
#endif

/* y[m * ldy + j] for m < mt, j < two (1 or 2 weight rows: codes c[j], scales s[j]). */
static inline __attribute__((always_inline)) void fused_tile(
    const int kind, const float *const *xs, const int mt, const uint8_t *const *c,
    const float *const *s, const int two, float zdef, int64_t K, int64_t group, float *y,
    int64_t ldy) {
    vf tot[FUSED_ROWS][2];
    float tail[FUSED_ROWS][2];
    for (int m = 0; m < FUSED_ROWS; m++)
        for (int j = 0; j < 2; j++) tot[m][j] = VZERO(), tail[m][j] = 0.f;
    for (int64_t g = 0, c0 = 0; c0 < K; g++, c0 += group) {
        const int64_t c1 = c0 + group < K ? c0 + group : K;
        vf acc[FUSED_ROWS][2];
        for (int m = 0; m < FUSED_ROWS; m++) acc[m][0] = acc[m][1] = VZERO();
        int64_t col = c0;
        for (; col + LANES <= c1; col += LANES) {
            const vf w0 = codes_vec(kind, c[0], col);
            const vf w1 = two == 2 ? codes_vec(kind, c[1], col) : w0;
            for (int m = 0; m < FUSED_ROWS; m++) {
                if (m >= mt) break;
                const vf x = VLOAD(xs[m] + col);
                acc[m][0] = VFMA(x, w0, acc[m][0]);
                if (two == 2) acc[m][1] = VFMA(x, w1, acc[m][1]);
            }
        }
        for (int j = 0; j < two; j++) {
            const float sc = s[j][g];
            const vf vs = VSET(sc);
            for (int m = 0; m < mt; m++) tot[m][j] = VFMA(acc[m][j], vs, tot[m][j]);
            for (int64_t t = col; t < c1; t++) { /* a group's last columns short of a vector */
                const float w = code_scalar(kind, c[j], t) * sc;
                for (int m = 0; m < mt; m++) tail[m][j] += xs[m][t] * w;
            }
        }
    }
    for (int m = 0; m < mt; m++)
        for (int j = 0; j < two; j++) y[m * ldy + j] = VSUM(tot[m][j]) + tail[m][j];
}

#define FUSED_CASE(KIND, MT)                                                                   \
    fused_tile(KIND, xs + m0, MT, cj, sj, two, zdef, K, group, Y + m0 * N + n, N)

static void fused_rows(int kind, const float *X, const uint8_t *codes, const float *S,
                       const float *Z, float zdef, float *Y, int64_t M, int64_t N, int64_t K,
                       int64_t group, int num_threads) {
    const int64_t G = (K + group - 1) / group, rb = row_bytes(kind, K);
    const float *xs[XROWS];
    for (int64_t m = 0; m < M; m++) xs[m] = X + m * K;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; n += 2) {
        const int two = N - n >= 2 ? 2 : 1;
        const uint8_t *cj[2] = {codes + n * rb, codes + (n + two - 1) * rb};
        const float *sj[2] = {S + n * G, S + (n + two - 1) * G};
        /* every FUSED_ROWS rows of X against the same two weight rows, still in L1 */
        for (int64_t m0 = 0; m0 < M; m0 += FUSED_ROWS) {
        const int mt = (int)(M - m0 < FUSED_ROWS ? M - m0 : FUSED_ROWS);
        /* constant kind and row count per call, so the inlined tile specialises */
        switch (kind * 8 + mt) {
        case 0 * 8 + 1: FUSED_CASE(0, 1); break;
        case 0 * 8 + 2: FUSED_CASE(0, 2); break;
        case 0 * 8 + 3: FUSED_CASE(0, 3); break;
        case 0 * 8 + 4: FUSED_CASE(0, 4); break;
        case 1 * 8 + 1: FUSED_CASE(1, 1); break;
        case 1 * 8 + 2: FUSED_CASE(1, 2); break;
        case 1 * 8 + 3: FUSED_CASE(1, 3); break;
        case 1 * 8 + 4: FUSED_CASE(1, 4); break;
        case 2 * 8 + 1: FUSED_CASE(2, 1); break;
        case 2 * 8 + 2: FUSED_CASE(2, 2); break;
        case 2 * 8 + 3: FUSED_CASE(2, 3); break;
        default: FUSED_CASE(2, 4); break;
        }
        }
    }
    if (!Z && zdef == 0.f) return;
    /* the zeros: y -= sum_g s_g * z_g * (sum of x over group g), z_g stored or the default */
    float *xsum = (float *)malloc(sizeof(float) * (size_t)(M * G));
    if (!xsum) return;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t c1 = (g + 1) * group < K ? (g + 1) * group : K;
            float acc = 0.f;
            for (int64_t t = g * group; t < c1; t++) acc += X[m * K + t];
            xsum[m * G + g] = acc;
        }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m = 0; m < M; m++) {
            float corr = 0.f;
            for (int64_t g = 0; g < G; g++)
                corr += S[n * G + g] * (Z ? Z[n * G + g] : zdef) * xsum[m * G + g];
            Y[m * N + n] -= corr;
        }
    free(xsum);
}

int bg_quant_gemm_supported(void) { return LANES; }

static int bad_args(int kind, int64_t K, int64_t group) {
    return kind < 0 || kind > 2 || K < 1 || group < 1;
}

int bg_quant_gemm_f32(const float *X, const uint8_t *codes, const float *S, const float *Z,
                      float zdef, float *Y, int64_t M, int64_t N, int64_t K, int64_t group,
                      int kind, int num_threads) {
    if (bad_args(kind, K, group)) return -1;
    if (M <= XROWS && (kind != 1 || group % 2 == 0 || group >= K)) {
        /* (an INT4 group must start on a whole byte for the vector loads) */
        fused_rows(kind, X, codes, S, Z, zdef, Y, M, N, K, group, num_threads);
        return 0;
    }
    const int64_t G = (K + group - 1) / group, rb = row_bytes(kind, K);
    const int64_t blocks = (N + RB - 1) / RB;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = (float *)malloc(sizeof(float) * RB * K);
        const float *xs[XROWS];
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            if (!scratch) continue;
            const int64_t n0 = b * RB, n = N - n0 < RB ? N - n0 : RB;
            for (int64_t j = 0; j < n; j++)
                dequant_row(kind, codes + (n0 + j) * rb, S + (n0 + j) * G,
                            Z ? Z + (n0 + j) * G : NULL, zdef, K, group, scratch + j * K);
            for (int64_t m0 = 0; m0 < M; m0 += XROWS) {
                const int64_t rows = M - m0 < XROWS ? M - m0 : XROWS;
                for (int64_t r = 0; r < rows; r++) xs[r] = X + (m0 + r) * K;
                block_dots(xs, rows, scratch, n, K, Y + m0 * N + n0, N);
            }
        }
        free(scratch);
    }
    return failed ? -2 : 0;
}

/* The whole weight dequantized, out [N, K] fp32 (prefill chunks multiply it with MKL). */
int bg_quant_dequant_f32(const uint8_t *codes, const float *S, const float *Z, float zdef,
                         float *out, int64_t N, int64_t K, int64_t group, int kind,
                         int num_threads) {
    if (bad_args(kind, K, group)) return -1;
    const int64_t G = (K + group - 1) / group, rb = row_bytes(kind, K);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t j = 0; j < N; j++)
        dequant_row(kind, codes + j * rb, S + j * G, Z ? Z + j * G : NULL, zdef, K, group,
                    out + j * K);
    return 0;
}

#else /* no AVX2/FMA in this build: the callers keep the torch path */

int bg_quant_gemm_supported(void) { return 0; }

int bg_quant_gemm_f32(const float *X, const uint8_t *codes, const float *S, const float *Z,
                      float zdef, float *Y, int64_t M, int64_t N, int64_t K, int64_t group,
                      int kind, int num_threads) {
    (void)X; (void)codes; (void)S; (void)Z; (void)zdef; (void)Y; (void)M; (void)N; (void)K;
    (void)group; (void)kind; (void)num_threads;
    return -1;
}

int bg_quant_dequant_f32(const uint8_t *codes, const float *S, const float *Z, float zdef,
                         float *out, int64_t N, int64_t K, int64_t group, int kind,
                         int num_threads) {
    (void)codes; (void)S; (void)Z; (void)zdef; (void)out; (void)N; (void)K; (void)group;
    (void)kind; (void)num_threads;
    return -1;
}

#endif
