/* vpdpbusd, where the compiler targets it: DPBUSD(acc, u, s) adds to each int32 lane of acc
   the 4 products of its unsigned bytes of u by its signed bytes of s. VNNI is 1 where it is
   available: AVX512-VNNI with VL (EVEX), AVX-VNNI (VEX), or, with INFLIGHT_EMULATE_VNNI,
   spelled in AVX2 (how machines without it test the kernels' VNNI code: the same sums). Where
   the instruction is real, DPBUSD_ASM is its mnemonic for the kernels' inline assembly (their
   full register tiles, which GCC's loops slowed with a register copy around every vpdpbusd). */

#ifndef INFLIGHT_VNNI_H
#define INFLIGHT_VNNI_H

#include <immintrin.h>

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define VNNI 1
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#define DPBUSD_ASM "vpdpbusd "
#elif defined(__AVXVNNI__)
#define VNNI 1
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#define DPBUSD_ASM "%{vex%} vpdpbusd " /* %{ %}: braces, in extended asm */
#elif defined(INFLIGHT_EMULATE_VNNI)
#define VNNI 1
/* vpdpbusd's sums, exactly: each int32 lane plus its 4 products of unsigned bytes of u by
   signed bytes of s. The bytes widened to int16 (0..255 and -128..127), madd sums each lane's
   even-byte and odd-byte pairs into int32 exactly. */
static inline __m256i DPBUSD(__m256i acc, __m256i u, __m256i s) {
    const __m256i low = _mm256_set1_epi16(0x00ff);
    const __m256i u_even = _mm256_and_si256(u, low), u_odd = _mm256_srli_epi16(u, 8);
    const __m256i s_even = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8);
    const __m256i s_odd = _mm256_srai_epi16(s, 8);
    const __m256i pairs = _mm256_add_epi32(_mm256_madd_epi16(u_even, s_even),
                                           _mm256_madd_epi16(u_odd, s_odd));
    return _mm256_add_epi32(acc, pairs);
}
#else
#define VNNI 0
#endif

#ifdef DPBUSD_ASM
/* Inline-assembly text of one register step of a full 4 x 2 tile of vpdpbusd sums: token m's 32
   activation bytes, at offset o<m> from %[x], by the unsigned weight bytes of rows 0 and 1
   (%[u0], %[u1]) into %[s<m>0] and %[s<m>1]; %[p] is a scratch register. */
#define DPBUSD_TOKEN(off, sa, sb)                                                            \
    "vmovdqu " off "(%[x]), %[p]\n\t"                                                       \
    DPBUSD_ASM "%[p], %[u0], %[" sa "]\n\t"                                                 \
    DPBUSD_ASM "%[p], %[u1], %[" sb "]\n\t"
#define DPBUSD_STEP(o0, o1, o2, o3)                                                          \
    DPBUSD_TOKEN(o0, "s00", "s01") DPBUSD_TOKEN(o1, "s10", "s11")                            \
    DPBUSD_TOKEN(o2, "s20", "s21") DPBUSD_TOKEN(o3, "s30", "s31")
#endif

#endif
