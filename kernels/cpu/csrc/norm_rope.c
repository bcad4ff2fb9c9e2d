/* Small per-token steps of a decoder layer on the CPU (fp32): fused residual add + RMSNorm, and
 * the rotary embedding of q and k in place.
 *
 * In a decode step these run on a few rows of a few hundred floats, so in torch their cost is
 * dispatch and allocation, not arithmetic, paid twice a layer every step. Each is one plain
 * loop here.
 *
 * RMSNorm follows the HF reference in fp32: h = x (+ residual); out = w * (h * 1/sqrt(mean(h^2)
 * + eps)). The mean is summed in a different order than torch's, so results agree to float
 * rounding. The rotation is the "rotate half" form, x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin,
 * with the same separate multiplies and add as torch's (the build does not contract them into
 * FMAs: -std=c11 keeps -ffp-contract=off), so it is bitwise equal to the torch path.
 * Built and loaded by kernels/cpu/build.py.
 */
#include <math.h>
#include <stdint.h>

/* x, residual (or NULL), out, res_out (or NULL when residual is NULL): [rows, n]; weight [n]. */
void bg_add_rms_norm_f32(const float *x, const float *residual, const float *weight, float eps,
                         float *out, float *res_out, int64_t rows, int64_t n, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= 64)
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * n;
        float *o = out + r * n;
        const float *h = xr;
        if (residual != 0) {
            const float *rr = residual + r * n;
            float *hr = res_out + r * n;
#pragma omp simd
            for (int64_t i = 0; i < n; ++i) hr[i] = xr[i] + rr[i];
            h = hr;
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; ++i) ss += h[i] * h[i];
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) o[i] = weight[i] * (h[i] * inv);
    }
}

/* x: `tokens` rows of `heads` x head_dim floats, row t starting at x + t * token_stride (q and k
 * heads side by side inside the fused qkv output). cos_sin: [max_positions, head_dim] rows of
 * [cos | sin] (head_dim / 2 each). positions: [tokens]. Rotates x in place. */
void bg_rotate_f32(float *x, int64_t tokens, int64_t heads, int64_t head_dim,
                   int64_t token_stride, const float *cos_sin, const int64_t *positions) {
    const int64_t half = head_dim / 2;
    for (int64_t t = 0; t < tokens; ++t) {
        const float *c = cos_sin + positions[t] * head_dim;
        const float *s = c + half;
        for (int64_t h = 0; h < heads; ++h) {
            float *x1 = x + t * token_stride + h * head_dim;
            float *x2 = x1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

/* SwiGLU's activation: out[r, i] = silu(g) * u with g = gu[r, i], u = gu[r, I + i] (the fused
 * gate|up projection's output, [rows, 2 I]); out is [rows, I]. silu(g) = g / (1 + exp(-g)),
 * the same expression as torch's CPU kernel; exp is computed differently (a vector polynomial
 * here, vec_exp.h), so results agree with torch to float rounding. */
#include "vec_exp.h"

void bg_silu_mul_f32(const float *gu, float *out, int64_t rows, int64_t I, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * I >= 65536)
    for (int64_t r = 0; r < rows; ++r) {
        const float *g = gu + r * 2 * I, *u = g + I;
        float *o = out + r * I;
        int64_t i = 0;
#if defined(__AVX512F__)
        const __m512 one = _mm512_set1_ps(1.0f);
        for (; i + 16 <= I; i += 16) {
            const __m512 gv = _mm512_loadu_ps(g + i);
            const __m512 e = bg_exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)),
                                                  _mm512_loadu_ps(u + i)));
        }
#endif
        for (; i < I; ++i) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
