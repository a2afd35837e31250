/* The grouping of K shared by the quantized matmul kernels (int8_matmul.c, q4_matmul.c).

   K is cut into blocks of 32 values, each with its own scale, and the blocks into groups of g
   (8 while they last, then 4, 2, 1): within a group, int32 lane l of every 32-byte register holds
   4-byte chunks of block l / (8 / g) only, so the lanes sum whole blocks and one float scale
   step serves the group. Byte j of chunk c of block i sits at
   r * 32 + (i * (8 / g) + c % (8 / g)) * 4 + j with r = c / (8 / g). */

#ifndef INFLIGHT_BLOCK_GROUPS_H
#define INFLIGHT_BLOCK_GROUPS_H

#include <immintrin.h>
#include <stdint.h>

#include "simd_math.h"

/* The register tile: MR tokens x NR weight rows, whose MR * NR float accumulators reduce 8 at a
   time in hsum8 (each output's lanes alone, so the same bits whatever the tile). A kernel may
   define a wider MR before including this (int8_matmul.c where 32 vector registers allow). */
#ifndef MR
#define MR 4
#endif
#define NR 2

#define MAX_GROUPS 1024 /* K up to about 256k */
#define INLINE static inline __attribute__((always_inline))

typedef struct {
    int count;
    int sizes[MAX_GROUPS]; /* blocks per group */
} Groups;

static int make_groups(int64_t k, Groups *groups) {
    int64_t blocks = k / 32;
    groups->count = 0;
    for (int g = 8; g >= 1; g /= 2) {
        while (blocks >= g) {
            if (groups->count == MAX_GROUPS) return -1;
            groups->sizes[groups->count++] = g;
            blocks -= g;
        }
    }
    return 0;
}

/* One block of 32 activations quantized symmetrically: q = round-half-even(x * 127 / amax) as
   int32 in q[4], and amax returned (the block's scale is amax / 127). */
static inline float quantize_block(const float *x, __m256i q[4]) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v[4], m = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(x + 8 * j);
        m = _mm256_max_ps(m, _mm256_and_ps(v[j], abs_mask));
    }
    const float amax = hmax256(m);
    const __m256 inv = _mm256_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
    for (int j = 0; j < 4; j++) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
    return amax;
}

#if MR == 4 /* the 4-token tile's assembly helpers */
/* Inline-assembly text of one register step of a full MR x NR tile whose sums are int16 pairs
   (the 4-bit kernel, the int8 kernel's build for small weights, the K-quant kernel's centered
   build): token m's 32 activation bytes, at offset o<m> from %[x], times the unsigned weight
   bytes of rows 0 and 1 (%[u0], %[u1]) by vpmaddubsw, added to %[s<m>0] and %[s<m>1] by
   vpaddw; %[p] and %[t] are scratch registers. */
#define MADDUBS_TOKEN(off, sa, sb)                                                           \
    "vmovdqu " off "(%[x]), %[p]\n\t"                                                       \
    "vpmaddubsw %[p], %[u0], %[t]\n\t"                                                      \
    "vpaddw %[t], %[" sa "], %[" sa "]\n\t"                                                  \
    "vpmaddubsw %[p], %[u1], %[t]\n\t"                                                      \
    "vpaddw %[t], %[" sb "], %[" sb "]\n\t"
#define MADDUBS_STEP(o0, o1, o2, o3)                                                         \
    MADDUBS_TOKEN(o0, "s00", "s01") MADDUBS_TOKEN(o1, "s10", "s11")                          \
    MADDUBS_TOKEN(o2, "s20", "s21") MADDUBS_TOKEN(o3, "s30", "s31")

/* A full tile's eight integer sums into s: as they are (int32 lanes) or, where `pairs`, int16
   pair sums widened by one vpmaddwd by ones. */
INLINE void put_sums(__m256i s[MR][NR], int pairs, __m256i s00, __m256i s01, __m256i s10,
                     __m256i s11, __m256i s20, __m256i s21, __m256i s30, __m256i s31) {
    const __m256i sums[MR][NR] = {{s00, s01}, {s10, s11}, {s20, s21}, {s30, s31}};
    const __m256i ones = _mm256_set1_epi16(1);
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++)
            s[m][n] = pairs ? _mm256_madd_epi16(sums[m][n], ones) : sums[m][n];
}
#endif

/* Writes an mr x nr tile's outputs (row stride n_total) from its accumulators, acc[m * NR + n]
   for token m and row n: a fixed horizontal sum, then the bias. Partial tiles go through the
   same sum, padded with zeros, so that an output never depends on its neighbours. */
INLINE void store_tile(const __m256 acc[MR * NR], int mr, int nr, int64_t n_total,
                       const float *bias, float *y) {
    float out[MR * NR];
    for (int h = 0; h < MR * NR / 8; h++) _mm256_storeu_ps(out + 8 * h, hsum8(acc + 8 * h));
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++)
            y[m * n_total + n] = out[m * NR + n] + (bias ? bias[n] : 0.0f);
}

#endif
