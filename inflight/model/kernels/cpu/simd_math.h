/* Vector math shared by the CPU kernels (AVX2 + FMA, float32).

   glibc's expf is scalar here (its vector variants are only declared under -ffast-math), and at
   one call per element it dominated SiLU and the softmax of attention. */

#ifndef INFLIGHT_SIMD_MATH_H
#define INFLIGHT_SIMD_MATH_H

#include <immintrin.h>

/* e^x for 8 floats, within 2 ulp of expf over its normal range. x = n ln2 + r, |r| <= ln2 / 2,
   with ln2 split in two so that n ln2 is exact enough; e^r by a degree-7 polynomial (Cephes'
   coefficients); 2^n built in the exponent bits. Inputs are clamped to [-87.3, 88] (where n
   stays within a normal exponent), so below about -87.3 it returns about 1.2e-38 rather than a
   denormal or 0, and above 88 about 1.65e38 rather than infinity; NaN stays NaN. */
static inline __m256 exp256(__m256 x) {
    /* the clamp's constant first: min/max return their second operand when one is NaN */
    x = _mm256_min_ps(_mm256_set1_ps(88.0f), x);
    x = _mm256_max_ps(_mm256_set1_ps(-87.3365447504f), x);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* 2^n: n + 127 in the exponent field */
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* Horizontal sums of 8 vectors, lane i of the result from v[i] alone, in a fixed order. */
static inline __m256 hsum8(const __m256 v[8]) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* Sum of the 8 lanes in a fixed order. */
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Max of the 8 lanes. */
static inline float hmax256(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Lanes [0, n) all ones, the rest zero, for 0 <= n <= 8: the mask of a partial chunk. */
static inline __m256i lane_mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

#endif
