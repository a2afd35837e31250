/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for GGUF's Q6_K and Q5_K weights, AVX2.

Weights: per superblock of 256 along K (so K a multiple of 256), unsigned integers u, one byte
each (Q6_K: 0..63, Q5_K: 0..31), and per half block of 16 values h an integer scale c_h and an
integer minimum n_h, both int8, with two float32 multipliers per superblock, d and f:
w = d * c_h * u + f * n_h. Q6_K: w = d * c * (u - 32), so n = c and f = -32 * d. Q5_K: c and n
are its 6-bit scale and minimum of the 32-block holding h, f = -dmin. Every product d * c and
f * n is exact in float32 (an fp16 value times at most 13 bits). These are the stored integers
and scales: nothing is re-quantized.

Activations: int8 per block of 32, x = e * p with p in -127..127, quantized here, per row, on
every call, with per half block the sum t_h = e * sum(p over h). A block contributes
d e (c_0 sum_0(u p) + c_1 sum_1(u p)) + f (n_0 t_0 + n_1 t_1), sum_h over half h.

Integer dot. vpmaddubsw multiplies unsigned by signed bytes into int16 pairs: at most
2 * 63 * 127 = 16002, so two registers' pairs add in int16; a pair never straddles two half
blocks. Then one vpmaddwd by the half's scales c (each int16 lane facing its block's) widens
and scales at once, so that one int32 sum per block covers both halves: at most
4 * 2 * 32004 * 128 < 2^25 in magnitude, exact.

Layout: a superblock is one group of 8 blocks as block_groups.h lays it out (g = 8): int32 lane
l of register r holds bytes 4r..4r+3 of block l, so registers 0-3 hold the first halves of the
8 blocks and 4-7 the second halves. Per superblock and row, 32 int8: c of the first halves
(lane order), c of the second, n of the first, n of the second; and 2 float32, d and f.
Activations of MR tokens interleave register by register; per token and superblock, 8 scales
e (lane order) and 16 sums t (first halves, then second).

VNNI variant (vnni.h): vpdpbusd sums each lane's 4 products u * p in int32 at once, a half's 4
registers into one sum per block, which one int32 multiply by c_h then scales: the integers of
the AVX2 path exactly, so both give the same bits.

Centered build (INFLIGHT_CENTERED, for Q6_K): w = d * c_h * (u - 32), so a block contributes
d e sum_h c_h sum_h((u - 32) p), all of it integer: each half's sum starts at -32 * (its sum of
p), which quantize_row stores per token, half and int16 lane, and the minimums' float terms go.
In int16: vpmaddubsw pairs of u (at most 63) by p stay below 16002, never saturated, and a half's
four registers add in int16 (vpaddw wraps; the end, a sum of 8 products (u - 32) p, is at most
8 * 32 * 127 = 32512 in magnitude), so one vpmaddwd by the half's scales per four registers,
where the general build needs one per two and three float ops more per superblock. VNNI: the
same integers, the correction widened to int32 first.

Determinism. As in q4_matmul.c: the integer sums are exact and every output takes the same
float ops (per superblock: convert, multiply, three fma, one in the centered build; then a fixed
horizontal sum and the bias) whatever M, N, its tile or its thread. Build with -ffp-contract=off.
*/

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "block_groups.h"
#include "simd_math.h"
#include "vnni.h"
#include "work_split.h"

#define SUPER 256
#define CHUNK_BYTES (96 * 1024) /* weight rows per cache tile, well within L2 */
#define AHEAD 8                 /* weight rows prefetched ahead (see int8_matmul.c) */

#ifdef INFLIGHT_CENTERED
#define CENTERED 1
#else
#define CENTERED 0
#endif

/* Quantizes one row of x (K / 256 superblocks): bytes into its slot of the interleaved tile
   layout (register stride MR * 32), per superblock 8 scales into xe and into xs 16 half sums,
   or, in the centered build, the same 64 bytes as int16 corrections: per half h and int16 lane
   j of its registers (bytes 2j and 2j + 1 of each), -32 * (the sum of those bytes' p). */
static void quantize_row(const float *x, int64_t supers, int8_t *xq, float *xe, float *xs) {
    /* packs work per 128-bit half; this puts the 4-byte chunks back in element order */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    int32_t chunks[8];
    for (int64_t sb = 0; sb < supers; sb++, xq += 8 * MR * 32, xe += 8, xs += 16) {
        int16_t corr[2][16] = {{0}}; /* the centered build's, copied into xs at the end */
        for (int i = 0; i < 8; i++, x += 32) {
            __m256i q[4];
            const float amax = quantize_block(x, q);
            const __m256i bytes = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
                order);
            _mm256_storeu_si256((__m256i *)chunks, bytes);
            for (int c = 0; c < 8; c++) memcpy(xq + c * MR * 32 + i * 4, &chunks[c], 4);
            const float e = amax / 127.0f;
            xe[i] = e;
            if (CENTERED) {
                /* chunk c (bytes 4c..4c + 3 of block i) sits in register c, lane i */
                const int8_t *p = (const int8_t *)chunks;
                for (int c = 0; c < 8; c++)
                    for (int j = 0; j < 4; j++) corr[c / 4][2 * i + j / 2] -= 32 * p[4 * c + j];
            } else {
                for (int h = 0; h < 2; h++) {
                    int32_t sums[8], sum = 0;
                    _mm256_storeu_si256((__m256i *)sums,
                                        _mm256_add_epi32(q[2 * h], q[2 * h + 1]));
                    for (int j = 0; j < 8; j++) sum += sums[j];
                    xs[8 * h + i] = e * (float)sum;
                }
            }
        }
        if (CENTERED) memcpy(xs, corr, sizeof corr);
    }
}

/* Register r of nr weight rows' superblock (rows kq bytes apart) into u, the rows AHEAD
   further on prefetched (every other register: a 64-byte line holds two). */
INLINE void load_register(const int nr, int r, int64_t kq, const uint8_t *w, __m256i u[NR]) {
    for (int n = 0; n < nr; n++) {
        if (r % 2 == 0) _mm_prefetch((const char *)(w + (n + AHEAD) * kq + r * 32), _MM_HINT_T0);
        u[n] = _mm256_loadu_si256((const __m256i *)(w + n * kq + r * 32));
    }
}

#if VNNI
#ifdef DPBUSD_ASM
/* One half's four registers of vpdpbusd sums for a full MR x NR tile, added to t, in assembly:
   GCC's loop copies every accumulator between registers around each vpdpbusd. */
static inline void dot_half_full(int h, int64_t kq, const uint8_t *w, const int8_t *xq,
                                 __m256i t[MR][NR]) {
    __m256i s00 = t[0][0], s01 = t[0][1], s10 = t[1][0], s11 = t[1][1];
    __m256i s20 = t[2][0], s21 = t[2][1], s30 = t[3][0], s31 = t[3][1];
    for (int r = 4 * h; r < 4 * h + 4; r++) {
        const uint8_t *w0 = w + r * 32;
        const int8_t *x = xq + r * MR * 32;
        __m256i u0, u1, p;
        __asm__(
            "prefetcht0 (%[w0],%[ahead])\n\t"
            "prefetcht0 (%[w1],%[ahead])\n\t"
            "vmovdqu (%[w0]), %[u0]\n\t"
            "vmovdqu (%[w1]), %[u1]\n\t"
            DPBUSD_STEP("0", "32", "64", "96")
            : [s00] "+x"(s00), [s01] "+x"(s01), [s10] "+x"(s10), [s11] "+x"(s11),
              [s20] "+x"(s20), [s21] "+x"(s21), [s30] "+x"(s30), [s31] "+x"(s31),
              [u0] "=&x"(u0), [u1] "=&x"(u1), [p] "=&x"(p)
            /* the "m" operands tell the compiler which memory the step reads */
            : [w0] "r"(w0), [w1] "r"(w0 + kq), [x] "r"(x), [ahead] "r"(AHEAD * kq),
              "m"(*(const uint8_t(*)[32])w0), "m"(*(const uint8_t(*)[32])(w0 + kq)),
              "m"(*(const int8_t(*)[MR * 32])x));
    }
    t[0][0] = s00, t[0][1] = s01, t[1][0] = s10, t[1][1] = s11;
    t[2][0] = s20, t[2][1] = s21, t[3][0] = s30, t[3][1] = s31;
}
#endif

/* Integer sums of one superblock for an mr x nr tile: s[m][n] lane l, sum over both halves h
   of block l of c_h * sum(u p), each half's sum made by vpdpbusd and scaled by one int32
   multiply; in the centered build sum((u - 32) p), each half's sum started at its correction
   (xc, token m's at xc + m * sx), widened. mr and nr are constants after inlining. */
INLINE void dot_super(const int mr, const int nr, int64_t kq, int64_t sc, const uint8_t *w,
                      const int8_t *wc, const int8_t *xq, const int16_t *xc, int64_t sx,
                      __m256i s[MR][NR]) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++) s[m][n] = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
        __m256i t[MR][NR];
        for (int m = 0; m < mr; m++) {
            const __m256i start =
                CENTERED ? _mm256_madd_epi16(
                               _mm256_loadu_si256((const __m256i *)(xc + m * sx + 16 * h)), ones)
                         : _mm256_setzero_si256();
            for (int n = 0; n < nr; n++) t[m][n] = start;
        }
#ifdef DPBUSD_ASM
        if (mr == MR && nr == NR)
            dot_half_full(h, kq, w, xq, t);
        else
#endif
        for (int r = 4 * h; r < 4 * h + 4; r++) {
            __m256i u[NR];
            load_register(nr, r, kq, w, u);
            for (int m = 0; m < mr; m++) {
                const __m256i p = _mm256_loadu_si256((const __m256i *)(xq + (r * MR + m) * 32));
                for (int n = 0; n < nr; n++) t[m][n] = DPBUSD(t[m][n], u[n], p);
            }
        }
        for (int n = 0; n < nr; n++) {
            const __m256i c =
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(wc + n * sc + 8 * h)));
            for (int m = 0; m < mr; m++)
                s[m][n] = _mm256_add_epi32(s[m][n], _mm256_mullo_epi32(t[m][n], c));
        }
    }
}
#else
/* c of the 8 blocks' half h (int8 at p), each twice, as int16: lanes 2l and 2l + 1 hold block
   l's, facing the two int16 pair sums that vpmaddubsw makes of block l's 4 bytes in lane l. */
static inline __m256i pair_scales(const int8_t *p) {
    const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_blend_epi16(v, _mm256_slli_epi32(v, 16), 0xaa);
}

/* Integer sums of one superblock for an mr x nr tile: s[m][n] lane l, sum over both halves h
   of block l of c_h * sum(u p). vpmaddwd by the pair scales widens and scales at once: a lane
   holds at most 4 * 2 * 32004 * 128 < 2^25. mr and nr are constants after inlining. */
INLINE void dot_super(const int mr, const int nr, int64_t kq, int64_t sc, const uint8_t *w,
                      const int8_t *wc, const int8_t *xq, const int16_t *xc, int64_t sx,
                      __m256i s[MR][NR]) {
    (void)xc, (void)sx; /* the centered build's (VNNI runs it here; AVX2 in dot_centered) */
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++) s[m][n] = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
        __m256i c[NR];
        for (int n = 0; n < nr; n++) c[n] = pair_scales(wc + n * sc + 8 * h);
        for (int r = 4 * h; r < 4 * h + 4; r += 2) {
            __m256i u0[NR], u1[NR];
            for (int n = 0; n < nr; n++) {
                _mm_prefetch((const char *)(w + (n + AHEAD) * kq + r * 32), _MM_HINT_T0);
                u0[n] = _mm256_loadu_si256((const __m256i *)(w + n * kq + r * 32));
                u1[n] = _mm256_loadu_si256((const __m256i *)(w + n * kq + (r + 1) * 32));
            }
            for (int m = 0; m < mr; m++) {
                const __m256i *p0 = (const __m256i *)(xq + (r * MR + m) * 32);
                const __m256i *p1 = (const __m256i *)(xq + ((r + 1) * MR + m) * 32);
                for (int n = 0; n < nr; n++) {
                    const __m256i pairs =
                        _mm256_add_epi16(_mm256_maddubs_epi16(u0[n], _mm256_loadu_si256(p0)),
                                         _mm256_maddubs_epi16(u1[n], _mm256_loadu_si256(p1)));
                    s[m][n] = _mm256_add_epi32(s[m][n], _mm256_madd_epi16(pairs, c[n]));
                }
            }
        }
    }
}

#endif

#if CENTERED && !VNNI
/* Integer sums of one superblock for an mr x nr tile of a centered weight: s[m][n] lane l, sum
   over both halves h of block l of c_h * sum((u - 32) p). Each half's int16 pair sums start at
   its correction (xc, token m's at xc + m * sx) and take its four registers; one vpmaddwd by the
   pair scales widens and scales them. */
INLINE void dot_centered(const int mr, const int nr, int64_t kq, int64_t sc, const uint8_t *w,
                         const int8_t *wc, const int8_t *xq, const int16_t *xc, int64_t sx,
                         __m256i s[MR][NR]) {
    for (int h = 0; h < 2; h++) {
        __m256i s16[MR][NR];
        for (int m = 0; m < mr; m++) {
            const __m256i c = _mm256_loadu_si256((const __m256i *)(xc + m * sx + 16 * h));
            for (int n = 0; n < nr; n++) s16[m][n] = c;
        }
        for (int r = 4 * h; r < 4 * h + 4; r++) {
            __m256i u[NR];
            load_register(nr, r, kq, w, u);
            for (int m = 0; m < mr; m++) {
                const __m256i p = _mm256_loadu_si256((const __m256i *)(xq + (r * MR + m) * 32));
                for (int n = 0; n < nr; n++)
                    s16[m][n] = _mm256_add_epi16(s16[m][n], _mm256_maddubs_epi16(u[n], p));
            }
        }
        for (int n = 0; n < nr; n++) {
            const __m256i c = pair_scales(wc + n * sc + 8 * h);
            for (int m = 0; m < mr; m++) {
                const __m256i scaled = _mm256_madd_epi16(s16[m][n], c);
                s[m][n] = h ? _mm256_add_epi32(s[m][n], scaled) : scaled;
            }
        }
    }
}

/* The same sums for a full MR x NR tile, the int16 sums in assembly: GCC's loop kept some of
   the eight in memory. */
static inline void dot_centered_full(int64_t kq, int64_t sc, const uint8_t *w, const int8_t *wc,
                                     const int8_t *xq, const int16_t *xc, int64_t sx,
                                     __m256i s[MR][NR]) {
    for (int h = 0; h < 2; h++) {
        const int16_t *c = xc + 16 * h;
        __m256i s00 = _mm256_loadu_si256((const __m256i *)c), s01 = s00;
        __m256i s10 = _mm256_loadu_si256((const __m256i *)(c + sx)), s11 = s10;
        __m256i s20 = _mm256_loadu_si256((const __m256i *)(c + 2 * sx)), s21 = s20;
        __m256i s30 = _mm256_loadu_si256((const __m256i *)(c + 3 * sx)), s31 = s30;
        for (int r = 4 * h; r < 4 * h + 4; r++) {
            const uint8_t *w0 = w + r * 32;
            const int8_t *x = xq + r * MR * 32;
            __m256i u0, u1, p, t;
            __asm__(
                "prefetcht0 (%[w0],%[ahead])\n\t"
                "prefetcht0 (%[w1],%[ahead])\n\t"
                "vmovdqu (%[w0]), %[u0]\n\t"
                "vmovdqu (%[w1]), %[u1]\n\t"
                MADDUBS_STEP("0", "32", "64", "96")
                : [s00] "+x"(s00), [s01] "+x"(s01), [s10] "+x"(s10), [s11] "+x"(s11),
                  [s20] "+x"(s20), [s21] "+x"(s21), [s30] "+x"(s30), [s31] "+x"(s31),
                  [u0] "=&x"(u0), [u1] "=&x"(u1), [p] "=&x"(p), [t] "=&x"(t)
                /* the "m" operands tell the compiler which memory the step reads */
                : [w0] "r"(w0), [w1] "r"(w0 + kq), [x] "r"(x), [ahead] "r"(AHEAD * kq),
                  "m"(*(const uint8_t(*)[32])w0), "m"(*(const uint8_t(*)[32])(w0 + kq)),
                  "m"(*(const int8_t(*)[MR * 32])x));
        }
        const __m256i c0 = pair_scales(wc + 8 * h), c1 = pair_scales(wc + sc + 8 * h);
        const __m256i t[MR][NR] = {{_mm256_madd_epi16(s00, c0), _mm256_madd_epi16(s01, c1)},
                                   {_mm256_madd_epi16(s10, c0), _mm256_madd_epi16(s11, c1)},
                                   {_mm256_madd_epi16(s20, c0), _mm256_madd_epi16(s21, c1)},
                                   {_mm256_madd_epi16(s30, c0), _mm256_madd_epi16(s31, c1)}};
        for (int m = 0; m < MR; m++)
            for (int n = 0; n < NR; n++) s[m][n] = h ? _mm256_add_epi32(s[m][n], t[m][n]) : t[m][n];
    }
}
#endif

/* 8 int8 at p times the float f, as float32 lanes (exact: see the top). */
static inline __m256 scaled(const int8_t *p, __m256 f) {
    const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(v), f);
}

/* One register tile: mr tokens (interleaved at xq, scales at xe, sums at xs) x nr weight rows
   (bytes at w, integer scales at wc, multipliers at wf), all of K. */
INLINE void tile(const int mr, const int nr, int64_t supers, int64_t kq, int64_t n_total,
                 const uint8_t *w, const int8_t *wc, const float *wf, const int8_t *xq,
                 const float *xe, const float *xs, const float *bias, float *y) {
    const int64_t se = 8 * supers, ss = 16 * supers, sc = 32 * supers, sf = 2 * supers;
    __m256 acc[MR * NR];
    for (int i = 0; i < MR * NR; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < supers; sb++) {
        __m256i s[MR][NR];
#if CENTERED
        /* xs holds the corrections (see quantize_row): 32 int16 a superblock */
        const int16_t *xc = (const int16_t *)xs;
#if VNNI
        dot_super(mr, nr, kq, sc, w, wc, xq, xc, 2 * ss, s);
#else
        if (mr == MR && nr == NR)
            dot_centered_full(kq, sc, w, wc, xq, xc, 2 * ss, s);
        else
            dot_centered(mr, nr, kq, sc, w, wc, xq, xc, 2 * ss, s);
#endif
        for (int m = 0; m < mr; m++) {
            const __m256 e = _mm256_loadu_ps(xe + m * se);
            for (int n = 0; n < nr; n++) {
                const __m256 d = _mm256_mul_ps(e, _mm256_broadcast_ss(wf + n * sf));
                acc[m * NR + n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[m][n]), d, acc[m * NR + n]);
            }
        }
#else
        dot_super(mr, nr, kq, sc, w, wc, xq, NULL, 0, s);
        __m256 d[NR], low[NR][2];
        for (int n = 0; n < nr; n++) {
            d[n] = _mm256_broadcast_ss(wf + n * sf);
            const __m256 f = _mm256_broadcast_ss(wf + n * sf + 1);
            for (int h = 0; h < 2; h++) low[n][h] = scaled(wc + n * sc + 16 + 8 * h, f);
        }
        for (int m = 0; m < mr; m++) {
            const __m256 e = _mm256_loadu_ps(xe + m * se);
            const __m256 t0 = _mm256_loadu_ps(xs + m * ss), t1 = _mm256_loadu_ps(xs + m * ss + 8);
            for (int n = 0; n < nr; n++) {
                __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[m][n]), _mm256_mul_ps(e, d[n]),
                                           acc[m * NR + n]);
                a = _mm256_fmadd_ps(low[n][0], t0, a);
                acc[m * NR + n] = _mm256_fmadd_ps(low[n][1], t1, a);
            }
        }
#endif
        w += SUPER, xq += 8 * MR * 32;
        wc += 32, wf += 2, xe += 8, xs += 16;
    }
    store_tile(acc, mr, nr, n_total, bias, y);
}

#define TILE_CASE(a, b)                                                                      \
    case (a) * NR + (b) - 1:                                                                 \
        tile(a, b, supers, kq, n_total, w, wc, wf, xq, xe, xs, bias, y);                     \
        break;

static void run_tile(int mr, int nr, int64_t supers, int64_t kq, int64_t n_total,
                     const uint8_t *w, const int8_t *wc, const float *wf, const int8_t *xq,
                     const float *xe, const float *xs, const float *bias, float *y) {
    switch (mr * NR + nr - 1) {
        TILE_CASE(1, 1) TILE_CASE(1, 2) TILE_CASE(2, 1) TILE_CASE(2, 2)
        TILE_CASE(3, 1) TILE_CASE(3, 2) TILE_CASE(4, 1) TILE_CASE(4, 2)
    }
}

/* One call's buffers, for the steps that work_split.h runs. */
typedef struct {
    int64_t k, supers, n_total;
    const float *x, *wf, *bias;
    const uint8_t *w;
    const int8_t *wc;
    int8_t *xq;
    float *xe, *xs, *y;
} Call;

static void quantize_token(const void *call, int64_t m) {
    const Call *c = call;
    quantize_row(c->x + m * c->k, c->supers, c->xq + (m / MR) * MR * c->k + (m % MR) * 32,
                 c->xe + m * 8 * c->supers, c->xs + m * 16 * c->supers);
}

static void run_unit(const void *call, int64_t n0, int64_t n1, int64_t m0, int64_t m1) {
    const Call *c = call;
    const int64_t sb = c->supers;
    for (int64_t n = n0; n < n1; n += NR) {
        const int nr = n1 - n < NR ? (int)(n1 - n) : NR;
        for (int64_t m = m0; m < m1; m += MR) {
            const int mr = m1 - m < MR ? (int)(m1 - m) : MR;
            run_tile(mr, nr, sb, c->k, c->n_total, c->w + n * c->k, c->wc + n * 32 * sb,
                     c->wf + n * 2 * sb, c->xq + m * c->k, c->xe + m * 8 * sb,
                     c->xs + m * 16 * sb, c->bias ? c->bias + n : NULL,
                     c->y + m * c->n_total + n);
        }
    }
}

/* Returns 0, or -1 for a K that is no positive multiple of 256, -2 when out of memory. */
int k8_linear(const float *x, int64_t m_total, int64_t k, const uint8_t *w, const int8_t *wc,
              const float *wf, int64_t n_total, const float *bias, float *y, int threads) {
    if (k <= 0 || k % SUPER) return -1;
    if (threads < 1) threads = 1;
    const int64_t supers = k / SUPER, m_tiles = (m_total + MR - 1) / MR;
    /* sizes rounded up to the alignment, as aligned_alloc requires */
    const size_t xq_bytes = ((size_t)(m_tiles * MR * k) + 63) & ~(size_t)63;
    const size_t xe_bytes = ((size_t)(m_total * 8 * supers) * sizeof(float) + 63) & ~(size_t)63;
    const size_t xs_bytes = ((size_t)(m_total * 16 * supers) * sizeof(float) + 63) & ~(size_t)63;
    int8_t *xq = aligned_alloc(64, xq_bytes);
    float *xe = aligned_alloc(64, xe_bytes), *xs = aligned_alloc(64, xs_bytes);
    if (!xq || !xe || !xs) {
        free(xq), free(xe), free(xs);
        return -2;
    }
    const Call call = {k, supers, n_total, x, wf, bias, w, wc, xq, xe, xs, y};
    const Steps steps = {quantize_token, run_unit};
    split_work(&steps, &call, m_total, n_total, CHUNK_BYTES / k, NR, k, MR, threads);
    free(xq), free(xe), free(xs);
    return 0;
}
