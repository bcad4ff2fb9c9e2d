/* exp(x) on 16 float lanes (AVX-512F), shared by the kernels that need it (softmax in
 * paged_decode.c, SiLU in norm_rope.c).
 *
 * x = n ln2 + r with |r| <= ln2/2, exp(r) = 1 + r + r^2 P(r) (a degree-5 minimax P, Cephes'
 * expf), times 2^n. Within 2 ulp of expf. Inputs are clamped to [-87.3, 88.7]: below, the
 * result is ~1e-38 instead of a denormal or 0; above, ~1.6e38 instead of inf.
 */
#ifndef BATCHGEN_VEC_EXP_H
#define BATCHGEN_VEC_EXP_H
#if defined(__AVX512F__)
#include <immintrin.h>

static inline __m512 bg_exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.33654f)), _mm512_set1_ps(88.7f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

#endif
#endif
