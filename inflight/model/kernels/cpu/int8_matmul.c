/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias) with int8 weights and int8 activations, AVX2.

Both operands are quantized symmetrically in blocks of 32 along K with one float32 scale per
block; the activations are quantized here, per row, on every call. Blocks are dotted in integers
and scaled into float32 accumulators.

Integer dot. AVX2 has no int8 dot product into int32 (no VNNI), and the usual maddubs route
(sign + maddubs + madd per 32 products) keeps Zen 3's two vector multiply pipes busy for 1.5
cycles. Here the activations are stored as int16 and each 32-byte weight load is split into two
int16 registers in place: the odd bytes by masking the even ones out, the even bytes by shifting
them into the high half. Both come out multiplied by 256, which an arithmetic shift of each
group's sums undoes exactly; 32 products then cost two madd on the multiply pipes and two adds
on the others. Sums fit: 32 products of at most 127 * 127 * 256 per int32 lane and group.

Layout. Converting and scaling every block separately would cost three more float ops per 32
products, so K is cut into groups of blocks laid out as block_groups.h describes: one convert +
multiply + fma per group scales up to 8 blocks at once. Weight scales are stored expanded, 8
floats per group (lane l: the scale of its block). int8_linear.py lays weights out so.
The activations of MR consecutive tokens are interleaved register by register (each 32 int16:
the values facing the even weight bytes, then those facing the odd ones), so that a register tile
reads one contiguous stream instead of MR rows that can collide in the same L1 sets.

Determinism. Every output is computed by the same instruction sequence whatever M, N, the tile
it falls in or the thread that runs it: the integer sums are exact and the float ops per output
(one fma per group, then a fixed horizontal sum, then the bias) never depend on its neighbours.
Build with -ffp-contract=off so that the compiler cannot fuse differently in different tiles.

VNNI variant (built where the compiler targets AVX512-VNNI with VL or AVX-VNNI, native.py's
variants; INFLIGHT_EMULATE_VNNI builds it on plain AVX2 with the instruction emulated, which is
how machines without VNNI test it). vpdpbusd sums 4 products of unsigned by signed bytes into
each int32 lane: 32 products a register in one instruction, against 4 above. The activations are
stored as signed bytes in the weights' byte order (MR tokens a register, as above), and each
weight register is flipped to unsigned (w + 128, an xor) as it is loaded, so a lane sums
(w + 128) * x: its sums start at -128 * (the sum of x over the lane's bytes in the group),
which quantize_row stores per token, group and lane. The sum is then the AVX2 variant's
integer sum (shifted back) exactly, and the float ops that follow are the same: both variants
give the same bits.
*/

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vnni.h"

/* AVX-512's 32 vector registers hold a tile of 8 tokens: 16 sums, each weight register read
   once for 8 tokens instead of 4 (on Zen 4, one thread, weights in cache: 608 tokens 12-14 %
   faster, 16 tokens up to 10 %; the 4-bit kernel's tile so widened was not faster, and keeps
   4); AVX2's and AVX-VNNI's 16 registers keep 4. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) /* vnni.h's VNNI on EVEX */
#define WIDE 1
#define MR 8
#else
#define WIDE 0
#endif

#include "block_groups.h"
#include "simd_math.h"
#include "work_split.h"

/* INFLIGHT_SMALL_WEIGHTS: a build for weights within -16..15 (GGUF's Q5_0), without VNNI. */
#if !VNNI && defined(INFLIGHT_SMALL_WEIGHTS)
#define SMALL 1
#else
#define SMALL 0
#endif

#if VNNI || SMALL
typedef int8_t Act; /* activations as signed bytes, in the weights' byte order */
#else
typedef int16_t Act; /* activations as int16, even- then odd-byte halves */
#endif

#define CHUNK_BYTES (128 * 1024) /* int8 weight rows per cache tile, well within L2 */
/* Weight rows prefetched ahead of the tile reading them: the first token tile over a unit
   streams its rows from memory, which the hardware prefetcher alone leaves exposed (30% of the
   time of the head at M = 16). Prefetches past the end of the weights are harmless hints. */
#define AHEAD 8
#if VNNI || SMALL
/* Quantizes one row of x: values into its slot of the interleaved tile layout (register stride
   MR * 32 bytes), 8 scales per group into xd, and per group the correction the dot's sums start
   at into xc: VNNI, per lane, -128 * (the sum of its values); SMALL, per int16 lane of the
   registers (bytes 2j and 2j + 1 of each), -16 * (the sum of its values), in int16 (modulo
   2^16: see dot_group). The sums are read back from the laid-out registers once the whole row
   is written (a register read right after its 4-byte stores waits for them to reach the cache)
   and summed by the dot itself with ones for the weights: exact (8 registers at most, of 4 or
   2 values of at most 127 a lane). */
static void quantize_row(const float *x, const Groups *groups, Act *xq, float *xd, int32_t *xc) {
    /* packs work per 128-bit half; this puts the 4-byte chunks back in element order */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    int32_t chunks[8];
    Act *row = xq;
    for (int gi = 0; gi < groups->count; gi++) {
        const int g = groups->sizes[gi], lanes = 8 / g, shift = __builtin_ctz(lanes);
        for (int i = 0; i < g; i++, x += 32) {
            __m256i q[4];
            const float amax = quantize_block(x, q);
            const __m256i bytes = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
                order);
            _mm256_storeu_si256((__m256i *)chunks, bytes);
            for (int c = 0; c < 8; c++) {
                const int lane = i * lanes + (c & (lanes - 1));
                memcpy(xq + (c >> shift) * MR * 32 + 4 * lane, &chunks[c], 4);
            }
            for (int l = 0; l < lanes; l++) xd[i * lanes + l] = amax / 127.0f;
        }
        xq += g * MR * 32;
        xd += 8;
    }
    const __m256i ones = _mm256_set1_epi8(1);
    for (int gi = 0; gi < groups->count; gi++, xc += 8) {
        __m256i sums = _mm256_setzero_si256();
        for (int r = 0; r < groups->sizes[gi]; r++, row += MR * 32) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)row);
#if VNNI
            sums = DPBUSD(sums, ones, v);
#else
            sums = _mm256_add_epi16(sums, _mm256_maddubs_epi16(ones, v));
#endif
        }
#if VNNI
        _mm256_storeu_si256((__m256i *)xc, _mm256_mullo_epi32(sums, _mm256_set1_epi32(-128)));
#else
        _mm256_storeu_si256((__m256i *)xc, _mm256_mullo_epi16(sums, _mm256_set1_epi16(-16)));
#endif
    }
}
#else
/* Quantizes one row of x: values into its slot of the interleaved tile layout (register stride
   MR * 32 int16), 8 scales per group into xd. */
static void quantize_row(const float *x, const Groups *groups, Act *xq, float *xd, int32_t *xc) {
    (void)xc;
    /* per 128-bit half (two 4-element chunks): even elements' pairs first, then odd ones' */
    const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                           0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    int32_t pairs[16]; /* per 2 chunks c, c + 1: even c, even c + 1, odd c, odd c + 1 */
    for (int gi = 0; gi < groups->count; gi++) {
        const int g = groups->sizes[gi], lanes = 8 / g, shift = __builtin_ctz(lanes);
        for (int i = 0; i < g; i++, x += 32) {
            __m256i q[4];
            const float amax = quantize_block(x, q);
            /* packs works per 128-bit half; the 0xd8 permute restores element order */
            const __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xd8);
            const __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xd8);
            _mm256_storeu_si256((__m256i *)pairs, _mm256_shuffle_epi8(lo, split));
            _mm256_storeu_si256((__m256i *)pairs + 1, _mm256_shuffle_epi8(hi, split));
            for (int c = 0; c < 8; c++) {
                const int lane = i * lanes + (c & (lanes - 1));
                int16_t *dst = xq + (c >> shift) * MR * 32 + 2 * lane;
                memcpy(dst, &pairs[(c / 2) * 4 + c % 2], 4);
                memcpy(dst + 16, &pairs[(c / 2) * 4 + 2 + c % 2], 4);
            }
            for (int l = 0; l < lanes; l++) xd[i * lanes + l] = amax / 127.0f;
        }
        xq += g * MR * 32;
        xd += 8;
    }
}
#endif

#if VNNI
/* Integer sums of one group for an mr x nr tile, as (w + 128) * x: each sum starts at the
   flip's correction (xc, token m's at xc + m * sg), so that it ends at the sum of w * x. mr and
   nr are constants after inlining, so the loops unroll and s stays in registers. */
INLINE void dot_group(const int mr, const int nr, int regs, int64_t k, const int8_t *w,
                      const Act *xq, const int32_t *xc, int64_t sg, __m256i s[MR][NR]) {
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    for (int m = 0; m < mr; m++) {
        const __m256i c = _mm256_loadu_si256((const __m256i *)(xc + m * sg));
        for (int n = 0; n < nr; n++) s[m][n] = c;
    }
    for (int r = 0; r < regs; r++, w += 32, xq += MR * 32) {
        __m256i u[NR];
        for (int n = 0; n < nr; n++) {
            _mm_prefetch((const char *)(w + (n + AHEAD) * k), _MM_HINT_T0);
            u[n] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + n * k)), flip);
        }
        for (int m = 0; m < mr; m++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(xq + m * 32));
            for (int n = 0; n < nr; n++) s[m][n] = DPBUSD(s[m][n], u[n], a);
        }
    }
}
#elif SMALL
/* Integer sums of one group for an mr x nr tile of weights within -16..15. vpmaddubsw takes
   the unsigned w + 16 (at most 31) and x: int16 pairs of at most 2 * 31 * 127 = 7874, never
   saturated. Each int16 sum starts at -16 * (the sum of its x over the group), xc's correction,
   so that it ends at the sum of w * x: at most 16 * 16 * 127 = 32512 in magnitude, in int16.
   Its partial sums may leave int16 on the way, but vpaddw wraps, so only the end must fit.
   One vpmaddwd by ones widens the group's sums. 32 products cost a multiply and an add, where
   vpsignb's route (|w| by x signed as w) needs a sign as well. */
INLINE void dot_group(const int mr, const int nr, int regs, int64_t k, const int8_t *w,
                      const Act *xq, const int32_t *xc, int64_t sg, __m256i s[MR][NR]) {
    const __m256i offset = _mm256_set1_epi8(16), ones = _mm256_set1_epi16(1);
    __m256i s16[MR][NR];
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++)
            s16[m][n] = _mm256_loadu_si256((const __m256i *)(xc + m * sg));
    for (int r = 0; r < regs; r++, w += 32, xq += MR * 32) {
        __m256i u[NR];
        for (int n = 0; n < nr; n++) {
            _mm_prefetch((const char *)(w + (n + AHEAD) * k), _MM_HINT_T0);
            u[n] = _mm256_add_epi8(_mm256_loadu_si256((const __m256i *)(w + n * k)), offset);
        }
        for (int m = 0; m < mr; m++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + m * 32));
            for (int n = 0; n < nr; n++)
                s16[m][n] = _mm256_add_epi16(s16[m][n], _mm256_maddubs_epi16(u[n], x));
        }
    }
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++) s[m][n] = _mm256_madd_epi16(s16[m][n], ones);
}

#else
/* Integer sums of one group for a full MR x NR tile. Written in assembly because GCC spills one
   of the eight accumulators around the loop, which puts a store-to-load round trip on every
   step and costs half the speed. */
static inline void dot_group_full(int regs, int64_t k, const int8_t *w, const int16_t *xq,
                                  __m256i s[MR][NR]) {
    const __m256i odd = _mm256_set1_epi16((short)0xff00);
    /* locals rather than s itself, which lives in memory and would be stored on every step */
    __m256i s00 = _mm256_setzero_si256(), s01 = s00, s10 = s00, s11 = s00;
    __m256i s20 = s00, s21 = s00, s30 = s00, s31 = s00;
    for (int r = 0; r < regs; r++, w += 32, xq += MR * 32) {
        __m256i l0, h0, l1, h1, t;
        __asm__(
            "prefetcht0 (%[w0],%[ahead])\n\t"
            "prefetcht0 (%[w1],%[ahead])\n\t"
            "vmovdqu (%[w0]), %[h0]\n\t"
            "vpsllw $8, %[h0], %[l0]\n\t"
            "vpand %[odd], %[h0], %[h0]\n\t"
            "vmovdqu (%[w1]), %[h1]\n\t"
            "vpsllw $8, %[h1], %[l1]\n\t"
            "vpand %[odd], %[h1], %[h1]\n\t"
#define TOKEN(off, sa, sb)                                                                   \
    "vpmaddwd " off "(%[x]), %[l0], %[t]\n\t"                                               \
    "vpaddd %[t], %[" sa "], %[" sa "]\n\t"                                                  \
    "vpmaddwd " off "(%[x]), %[l1], %[t]\n\t"                                               \
    "vpaddd %[t], %[" sb "], %[" sb "]\n\t"                                                  \
    "vpmaddwd " off "+32(%[x]), %[h0], %[t]\n\t"                                            \
    "vpaddd %[t], %[" sa "], %[" sa "]\n\t"                                                  \
    "vpmaddwd " off "+32(%[x]), %[h1], %[t]\n\t"                                            \
    "vpaddd %[t], %[" sb "], %[" sb "]\n\t"
            TOKEN("0", "s00", "s01") TOKEN("64", "s10", "s11") TOKEN("128", "s20", "s21")
                TOKEN("192", "s30", "s31")
#undef TOKEN
            : [s00] "+x"(s00), [s01] "+x"(s01), [s10] "+x"(s10), [s11] "+x"(s11),
              [s20] "+x"(s20), [s21] "+x"(s21), [s30] "+x"(s30), [s31] "+x"(s31),
              [l0] "=&x"(l0), [h0] "=&x"(h0),
              [l1] "=&x"(l1), [h1] "=&x"(h1), [t] "=&x"(t)
            /* the "m" operands tell the compiler which memory the step reads */
            : [w0] "r"(w), [w1] "r"(w + k), [x] "r"(xq), [odd] "m"(odd), [ahead] "r"(AHEAD * k),
              "m"(*(const int8_t(*)[32])w), "m"(*(const int8_t(*)[32])(w + k)),
              "m"(*(const int16_t(*)[MR * 32])xq));
    }
    s[0][0] = s00, s[0][1] = s01, s[1][0] = s10, s[1][1] = s11;
    s[2][0] = s20, s[2][1] = s21, s[3][0] = s30, s[3][1] = s31;
}

/* The same sums for a partial tile (the last tokens or the last row): exact integers, so they
   equal what a full tile would give. mr and nr are constants after inlining, so the loops
   unroll and s stays in registers. */
INLINE void dot_group(const int mr, const int nr, int regs, int64_t k, const int8_t *w,
                      const int16_t *xq, __m256i s[MR][NR]) {
    const __m256i odd = _mm256_set1_epi16((short)0xff00);
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++) s[m][n] = _mm256_setzero_si256();
    for (int r = 0; r < regs; r++, w += 32, xq += MR * 32) {
        __m256i lo[NR], hi[NR];
        for (int n = 0; n < nr; n++) {
            _mm_prefetch((const char *)(w + (n + AHEAD) * k), _MM_HINT_T0);
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + n * k));
            lo[n] = _mm256_slli_epi16(v, 8);
            hi[n] = _mm256_and_si256(v, odd);
        }
        for (int m = 0; m < mr; m++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(xq + m * 32));
            const __m256i b = _mm256_loadu_si256((const __m256i *)(xq + m * 32 + 16));
            for (int n = 0; n < nr; n++) {
                s[m][n] = _mm256_add_epi32(s[m][n], _mm256_madd_epi16(a, lo[n]));
                s[m][n] = _mm256_add_epi32(s[m][n], _mm256_madd_epi16(b, hi[n]));
            }
        }
    }
}

#endif

#if WIDE
/* One register step of a wide tile's half: tokens 4h..4h + 3's 32 activation bytes each
   (offset o<i> from %[x]) by the unsigned weight bytes of rows 0 and 1 into %[a<m>], %[b<m>]. */
#define WIDE_TOKEN(off, a, b)                                                                \
    "vmovdqu32 " off "(%[x]), %[p]\n\t"                                                    \
    "vpdpbusd %[p], %[u0], %[" a "]\n\t"                                                   \
    "vpdpbusd %[p], %[u1], %[" b "]\n\t"

/* The sums of a full 8 x 2 tile, in assembly (registers ymm16-31 among them, so EVEX forms:
   vpxord, vmovdqu32). Two statements a step, as one would pass GCC's 30 operands. */
static inline void dot_group_full(int regs, int64_t k, const int8_t *w, const Act *xq,
                                  const int32_t *xc, int64_t sg, __m256i s[MR][NR]) {
    const __m256i unsign = _mm256_set1_epi8((char)0x80);
#define XC(m) _mm256_loadu_si256((const __m256i *)(xc + (m) * sg))
    __m256i a0 = XC(0), a1 = XC(1), a2 = XC(2), a3 = XC(3), a4 = XC(4), a5 = XC(5), a6 = XC(6);
    __m256i a7 = XC(7), b0 = a0, b1 = a1, b2 = a2, b3 = a3, b4 = a4, b5 = a5, b6 = a6, b7 = a7;
#undef XC
    for (int r = 0; r < regs; r++, w += 32, xq += MR * 32) {
        __m256i u0, u1, p;
        __asm__("prefetcht0 (%[w0],%[ahead])\n\t"
                "prefetcht0 (%[w1],%[ahead])\n\t"
                "vpxord (%[w0]), %[unsign], %[u0]\n\t"
                "vpxord (%[w1]), %[unsign], %[u1]\n\t"
                WIDE_TOKEN("0", "a0", "b0") WIDE_TOKEN("32", "a1", "b1")
                WIDE_TOKEN("64", "a2", "b2") WIDE_TOKEN("96", "a3", "b3")
                : [a0] "+v"(a0), [b0] "+v"(b0), [a1] "+v"(a1), [b1] "+v"(b1), [a2] "+v"(a2),
                  [b2] "+v"(b2), [a3] "+v"(a3), [b3] "+v"(b3), [u0] "=&v"(u0), [u1] "=&v"(u1),
                  [p] "=&v"(p)
                /* the "m" operands tell the compiler which memory the step reads */
                : [w0] "r"(w), [w1] "r"(w + k), [x] "r"(xq), [unsign] "v"(unsign),
                  [ahead] "r"(AHEAD * k), "m"(*(const int8_t(*)[32])w),
                  "m"(*(const int8_t(*)[32])(w + k)), "m"(*(const int8_t(*)[MR * 32])xq));
        __asm__(WIDE_TOKEN("128", "a4", "b4") WIDE_TOKEN("160", "a5", "b5")
                WIDE_TOKEN("192", "a6", "b6") WIDE_TOKEN("224", "a7", "b7")
                : [a4] "+v"(a4), [b4] "+v"(b4), [a5] "+v"(a5), [b5] "+v"(b5), [a6] "+v"(a6),
                  [b6] "+v"(b6), [a7] "+v"(a7), [b7] "+v"(b7), [p] "=&v"(p)
                : [u0] "v"(u0), [u1] "v"(u1), [x] "r"(xq), "m"(*(const int8_t(*)[MR * 32])xq));
    }
    const __m256i sa[MR] = {a0, a1, a2, a3, a4, a5, a6, a7}, sb[MR] = {b0, b1, b2, b3, b4, b5, b6, b7};
    for (int m = 0; m < MR; m++) s[m][0] = sa[m], s[m][1] = sb[m];
}
#undef WIDE_TOKEN
#elif defined(DPBUSD_ASM) || SMALL
#if VNNI
/* the weights flipped to unsigned, w ^ 0x80 = w + 128, and their vpdpbusd sums */
#define PREPARE "vpxor"
#define STEP DPBUSD_STEP
#else
/* the weights offset to unsigned, w + 16, and their vpmaddubsw pair sums */
#define PREPARE "vpaddb"
#define STEP MADDUBS_STEP
#endif
/* The same sums for a full MR x NR tile, in assembly: GCC's loop kept some of the eight sums in
   memory (the small-weights build) or copied each between registers around every vpdpbusd (up
   to a fifth slower). */
static inline void dot_group_full(int regs, int64_t k, const int8_t *w, const Act *xq,
                                  const int32_t *xc, int64_t sg, __m256i s[MR][NR]) {
    const __m256i unsign = _mm256_set1_epi8(VNNI ? (char)0x80 : 16);
    __m256i s00 = _mm256_loadu_si256((const __m256i *)xc), s01 = s00;
    __m256i s10 = _mm256_loadu_si256((const __m256i *)(xc + sg)), s11 = s10;
    __m256i s20 = _mm256_loadu_si256((const __m256i *)(xc + 2 * sg)), s21 = s20;
    __m256i s30 = _mm256_loadu_si256((const __m256i *)(xc + 3 * sg)), s31 = s30;
    for (int r = 0; r < regs; r++, w += 32, xq += MR * 32) {
        __m256i u0, u1, p, t;
        __asm__(
            "prefetcht0 (%[w0],%[ahead])\n\t"
            "prefetcht0 (%[w1],%[ahead])\n\t"
            PREPARE " (%[w0]), %[unsign], %[u0]\n\t"
            PREPARE " (%[w1]), %[unsign], %[u1]\n\t"
            STEP("0", "32", "64", "96")
            : [s00] "+x"(s00), [s01] "+x"(s01), [s10] "+x"(s10), [s11] "+x"(s11),
              [s20] "+x"(s20), [s21] "+x"(s21), [s30] "+x"(s30), [s31] "+x"(s31),
              [u0] "=&x"(u0), [u1] "=&x"(u1), [p] "=&x"(p), [t] "=&x"(t) /* MADDUBS_STEP's */
            /* the "m" operands tell the compiler which memory the step reads */
            : [w0] "r"(w), [w1] "r"(w + k), [x] "r"(xq), [unsign] "x"(unsign),
              [ahead] "r"(AHEAD * k), "m"(*(const int8_t(*)[32])w),
              "m"(*(const int8_t(*)[32])(w + k)), "m"(*(const int8_t(*)[MR * 32])xq));
    }
    put_sums(s, !VNNI, s00, s01, s10, s11, s20, s21, s30, s31);
}
#undef PREPARE
#undef STEP
#endif

/* One register tile: mr tokens (interleaved at xq, scales at xd, the VNNI and small-weights
   builds' corrections at xc) x nr weight rows, all of K. */
INLINE void tile(const int mr, const int nr, const Groups *groups, int64_t k, int64_t n_total,
                 const int8_t *w, const float *ws, const Act *xq, const float *xd,
                 const int32_t *xc, const float *bias, float *y) {
    const int64_t sg = 8 * (int64_t)groups->count;
    __m256 acc[MR * NR];
    for (int i = 0; i < MR * NR; i++) acc[i] = _mm256_setzero_ps();
    for (int gi = 0; gi < groups->count; gi++) {
        const int g = groups->sizes[gi];
        __m256i s[MR][NR];
#if VNNI || SMALL
#if defined(DPBUSD_ASM) || SMALL
        if (mr == MR && nr == NR)
            dot_group_full(g, k, w, xq, xc, sg, s);
        else
#endif
            dot_group(mr, nr, g, k, w, xq, xc, sg, s);
        xc += 8;
#else
        (void)xc;
        if (mr == MR && nr == NR)
            dot_group_full(g, k, w, xq, s);
        else
            dot_group(mr, nr, g, k, w, xq, s);
        /* the weights came in times 256 (see the top): exact */
        for (int m = 0; m < mr; m++)
            for (int n = 0; n < nr; n++) s[m][n] = _mm256_srai_epi32(s[m][n], 8);
#endif
        for (int m = 0; m < mr; m++) {
            const __m256 dx = _mm256_loadu_ps(xd + m * sg);
            for (int n = 0; n < nr; n++) {
                const __m256 d = _mm256_mul_ps(dx, _mm256_loadu_ps(ws + n * sg));
                acc[m * NR + n] =
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[m][n]), d, acc[m * NR + n]);
            }
        }
        w += 32 * g;
        xq += g * MR * 32;
        ws += 8;
        xd += 8;
    }
    store_tile(acc, mr, nr, n_total, bias, y);
}

#define TILE_CASE(a, b)                                                                      \
    case (a) * NR + (b) - 1:                                                                 \
        tile(a, b, groups, k, n_total, w, ws, xq, xd, xc, bias, y);                          \
        break;

static void run_tile(int mr, int nr, const Groups *groups, int64_t k, int64_t n_total,
                     const int8_t *w, const float *ws, const Act *xq, const float *xd,
                     const int32_t *xc, const float *bias, float *y) {
    switch (mr * NR + nr - 1) {
        TILE_CASE(1, 1) TILE_CASE(1, 2) TILE_CASE(2, 1) TILE_CASE(2, 2)
        TILE_CASE(3, 1) TILE_CASE(3, 2) TILE_CASE(4, 1) TILE_CASE(4, 2)
#if MR == 8
        TILE_CASE(5, 1) TILE_CASE(5, 2) TILE_CASE(6, 1) TILE_CASE(6, 2)
        TILE_CASE(7, 1) TILE_CASE(7, 2) TILE_CASE(8, 1) TILE_CASE(8, 2)
#endif
    }
}

/* One call's buffers, for the steps that work_split.h runs. */
typedef struct {
    const Groups *groups;
    int64_t k, sg, n_total;
    const float *x, *ws, *bias;
    const int8_t *w;
    Act *xq;
    float *xd, *y;
    int32_t *xc; /* VNNI and SMALL: per token and group, the corrections (quantize_row) */
} Call;

static void quantize_token(const void *call, int64_t m) {
    const Call *c = call;
    quantize_row(c->x + m * c->k, c->groups, c->xq + (m / MR) * MR * c->k + (m % MR) * 32,
                 c->xd + m * c->sg, c->xc + m * c->sg);
}

/* Row tiles outer, token tiles inner (work_split.h's run_blocks picks the tokens). */
static void run_unit(const void *call, int64_t n0, int64_t n1, int64_t m0, int64_t m1) {
    const Call *c = call;
    const int64_t sg = c->sg;
    for (int64_t n = n0; n < n1; n += NR) {
        const int nr = n1 - n < NR ? (int)(n1 - n) : NR;
        for (int64_t m = m0; m < m1; m += MR) {
            const int mr = m1 - m < MR ? (int)(m1 - m) : MR;
            run_tile(mr, nr, c->groups, c->k, c->n_total, c->w + n * c->k, c->ws + n * sg,
                     c->xq + m * c->k, c->xd + m * sg, c->xc + m * sg,
                     c->bias ? c->bias + n : NULL,
                     c->y + m * c->n_total + n);
        }
    }
}

/* Returns 0, or -1 for a K the layout cannot hold, -2 when out of memory. */
int int8_linear(const float *x, int64_t m_total, int64_t k, const int8_t *w, const float *ws,
                int64_t n_total, const float *bias, float *y, int threads) {
    Groups groups;
    if (k <= 0 || k % 32 || make_groups(k, &groups)) return -1;
    if (threads < 1) threads = 1;
    const int64_t sg = 8 * (int64_t)groups.count;
    const int64_t m_tiles = (m_total + MR - 1) / MR;
    /* sizes rounded up to the alignment, as aligned_alloc requires */
    const size_t xq_bytes = ((size_t)(m_tiles * MR * k) * sizeof(Act) + 63) & ~(size_t)63;
    const size_t xd_bytes = ((size_t)(m_total * sg) * sizeof(float) + 63) & ~(size_t)63;
    Act *xq = aligned_alloc(64, xq_bytes);
    float *xd = aligned_alloc(64, xd_bytes);
    int32_t *xc = aligned_alloc(64, xd_bytes); /* as many int32 as xd's floats */
    if (!xq || !xd || !xc) {
        free(xq), free(xd), free(xc);
        return -2;
    }
    const Call call = {&groups, k, sg, n_total, x, ws, bias, w, xq, xd, y, xc};
    const Steps steps = {quantize_token, run_unit};
    split_work(&steps, &call, m_total, n_total, CHUNK_BYTES / k, NR, k * (int64_t)sizeof(Act), MR,
               threads);
    free(xq), free(xd), free(xc);
    return 0;
}
