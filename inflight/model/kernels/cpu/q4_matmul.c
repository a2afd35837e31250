/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias) with 4-bit weights and int8 activations, AVX2.

Weights: per block of 32 along K, w = d * q + m with q in 0..15 and float32 d, m (GGUF's Q4_1,
whose weights come back as stored, up to the rounding of d). Activations: int8 per block of 32,
x = e * p with p in -127..127, quantized here, per row, on every call, with the block's
s = e * sum(p). Then a block contributes d * e * sum(q * p) + m * s.

Integer dot. vpmaddubsw multiplies unsigned by signed bytes and adds pairs into int16: with q at
most 15 a pair is at most 2 * 15 * 127 = 3810, so the int16 sums of a whole group (8 registers)
stay below 32767 and one vpmaddwd by ones per group widens them into int32 lanes. 32 products
cost one multiply and one add, against two of each in the int8 kernel; the weights, two per
byte, are half its memory traffic.

Layout: block_groups.h, with the registers of a group packed in pairs: register 2i in the low
nibbles of a 32-byte word, 2i + 1 in its high nibbles (an odd last register alone). Weight
scales d and minimums m are stored expanded, 8 floats per group (lane l: its block's). The
activations of MR consecutive tokens are interleaved register by register; their scales e
expanded the same way, their sums s in the first lane of each block only (so that the lanes'
sum counts each block's m * s once).

VNNI variant (vnni.h): vpdpbusd takes the nibbles as its unsigned operand and sums 4 products
into each int32 lane at once: one instruction for 32 products, no int16 sums to widen. The
int32 sums are the AVX2 path's exactly, so both give the same bits.

Determinism. As in int8_matmul.c: the integer sums are exact and every output takes the same
float ops (per group: convert, multiply, two fma; then a fixed horizontal sum and the bias)
whatever M, N, its tile or its thread. Build with -ffp-contract=off.
*/

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "block_groups.h"
#include "simd_math.h"
#include "vnni.h"
#include "work_split.h"

#define CHUNK_BYTES (64 * 1024) /* packed weight rows per cache tile, well within L2 */
#define AHEAD 8 /* weight rows prefetched ahead (see int8_matmul.c) */

/* Packed bytes of one weight row. */
static int64_t row_bytes(const Groups *groups) {
    int64_t bytes = 0;
    for (int gi = 0; gi < groups->count; gi++) bytes += (groups->sizes[gi] + 1) / 2 * 32;
    return bytes;
}

/* Quantizes one row of x: bytes into its slot of the interleaved tile layout (register stride
   MR * 32), per group 8 scales into xe and 8 block sums into xs. */
static void quantize_row(const float *x, const Groups *groups, int8_t *xq, float *xe, float *xs) {
    /* packs work per 128-bit half; this puts the 4-byte chunks back in element order */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    int32_t chunks[8];
    for (int gi = 0; gi < groups->count; gi++) {
        const int g = groups->sizes[gi], lanes = 8 / g, shift = __builtin_ctz(lanes);
        for (int i = 0; i < g; i++, x += 32) {
            __m256i q[4];
            const float amax = quantize_block(x, q);
            const __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]),
                                                   _mm256_add_epi32(q[2], q[3]));
            const __m256i bytes = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
                order);
            _mm256_storeu_si256((__m256i *)chunks, bytes);
            for (int c = 0; c < 8; c++) {
                const int lane = i * lanes + (c & (lanes - 1));
                memcpy(xq + (c >> shift) * MR * 32 + lane * 4, &chunks[c], 4);
            }
            const float e = amax / 127.0f;
            int32_t sums[8];
            _mm256_storeu_si256((__m256i *)sums, total);
            int32_t sum = 0;
            for (int j = 0; j < 8; j++) sum += sums[j];
            for (int l = 0; l < lanes; l++) {
                xe[i * lanes + l] = e;
                xs[i * lanes + l] = l == 0 ? e * (float)sum : 0.0f;
            }
        }
        xq += g * MR * 32;
        xe += 8;
        xs += 8;
    }
}

#if VNNI
/* Integer sums of one group of g registers for an mr x nr tile, accumulated in int32 by
   vpdpbusd; mr and nr are constants after inlining, so the loops unroll. */
INLINE void dot_group(const int mr, const int nr, int g, int64_t kq, const uint8_t *w,
                      const int8_t *xq, __m256i s[MR][NR]) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++) s[m][n] = _mm256_setzero_si256();
    for (int r = 0; r < g; r += 2, w += 32, xq += 2 * MR * 32) {
        __m256i word[NR];
        for (int n = 0; n < nr; n++) {
            _mm_prefetch((const char *)(w + (n + AHEAD) * kq), _MM_HINT_T0);
            word[n] = _mm256_loadu_si256((const __m256i *)(w + n * kq));
        }
        for (int half = 0; half < 2 && r + half < g; half++) {
            for (int n = 0; n < nr; n++) {
                const __m256i q = _mm256_and_si256(_mm256_srli_epi16(word[n], 4 * half), low);
                for (int m = 0; m < mr; m++) {
                    const __m256i p =
                        _mm256_loadu_si256((const __m256i *)(xq + (half * MR + m) * 32));
                    s[m][n] = DPBUSD(s[m][n], q, p);
                }
            }
        }
    }
}
#else
/* Integer sums of one group of g registers for an mr x nr tile; mr and nr are constants after
   inlining, so the loops unroll and the sums stay in registers. */
INLINE void dot_group(const int mr, const int nr, int g, int64_t kq, const uint8_t *w,
                      const int8_t *xq, __m256i s[MR][NR]) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256i s16[MR][NR];
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++) s16[m][n] = _mm256_setzero_si256();
    for (int r = 0; r < g; r += 2, w += 32, xq += 2 * MR * 32) {
        __m256i word[NR];
        for (int n = 0; n < nr; n++) {
            _mm_prefetch((const char *)(w + (n + AHEAD) * kq), _MM_HINT_T0);
            word[n] = _mm256_loadu_si256((const __m256i *)(w + n * kq));
        }
        for (int n = 0; n < nr; n++) {
            const __m256i q = _mm256_and_si256(word[n], low);
            for (int m = 0; m < mr; m++) {
                const __m256i p = _mm256_loadu_si256((const __m256i *)(xq + m * 32));
                s16[m][n] = _mm256_add_epi16(s16[m][n], _mm256_maddubs_epi16(q, p));
            }
        }
        if (r + 1 == g) break;
        for (int n = 0; n < nr; n++) {
            const __m256i q = _mm256_and_si256(_mm256_srli_epi16(word[n], 4), low);
            for (int m = 0; m < mr; m++) {
                const __m256i p = _mm256_loadu_si256((const __m256i *)(xq + (MR + m) * 32));
                s16[m][n] = _mm256_add_epi16(s16[m][n], _mm256_maddubs_epi16(q, p));
            }
        }
    }
    const __m256i ones = _mm256_set1_epi16(1);
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++) s[m][n] = _mm256_madd_epi16(s16[m][n], ones);
}

#endif

#if !VNNI || defined(DPBUSD_ASM)
#if VNNI
#define STEP DPBUSD_STEP
#else
#define STEP MADDUBS_STEP
#endif
/* The same sums for a full MR x NR tile and an even g. Written in assembly because GCC spills
   an int16 sum around the loop (sixteen vector registers: eight sums, two words, two nibble
   registers, an activation, a product and the nibble mask), which puts a store-to-load round
   trip on every step: 82 against 62 cycles per group of 8 blocks (one core, data in L1); the
   VNNI build's loop copied each sum between registers around every vpdpbusd. */
static inline void dot_group_full(int g, int64_t kq, const uint8_t *w, const int8_t *xq,
                                  __m256i s[MR][NR]) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256i s00 = _mm256_setzero_si256(), s01 = s00, s10 = s00, s11 = s00;
    __m256i s20 = s00, s21 = s00, s30 = s00, s31 = s00;
    for (int r = 0; r < g; r += 2, w += 32, xq += 2 * MR * 32) {
        __m256i w0, w1, q0, q1, p, t;
        __asm__(
            "prefetcht0 (%[w0],%[ahead])\n\t"
            "prefetcht0 (%[w1],%[ahead])\n\t"
            "vmovdqu (%[w0]), %[v0]\n\t"
            "vmovdqu (%[w1]), %[v1]\n\t"
            "vpand %[v0], %[low], %[u0]\n\t"
            "vpand %[v1], %[low], %[u1]\n\t"
            STEP("0", "32", "64", "96")
            "vpsrlw $4, %[v0], %[u0]\n\t"
            "vpsrlw $4, %[v1], %[u1]\n\t"
            "vpand %[u0], %[low], %[u0]\n\t"
            "vpand %[u1], %[low], %[u1]\n\t"
            STEP("128", "160", "192", "224")
            : [s00] "+x"(s00), [s01] "+x"(s01), [s10] "+x"(s10), [s11] "+x"(s11),
              [s20] "+x"(s20), [s21] "+x"(s21), [s30] "+x"(s30), [s31] "+x"(s31),
              [v0] "=&x"(w0), [v1] "=&x"(w1), [u0] "=&x"(q0), [u1] "=&x"(q1), [p] "=&x"(p),
              [t] "=&x"(t) /* MADDUBS_STEP's product */
            /* the "m" operands tell the compiler which memory the step reads */
            : [w0] "r"(w), [w1] "r"(w + kq), [x] "r"(xq), [low] "x"(low),
              [ahead] "r"(AHEAD * kq), "m"(*(const uint8_t(*)[32])w),
              "m"(*(const uint8_t(*)[32])(w + kq)), "m"(*(const int8_t(*)[2 * MR * 32])xq));
    }
    put_sums(s, !VNNI, s00, s01, s10, s11, s20, s21, s30, s31);
}
#undef STEP
#endif

/* One register tile: mr tokens (interleaved at xq, scales at xe, sums at xs) x nr weight rows,
   all of K. */
INLINE void tile(const int mr, const int nr, const Groups *groups, int64_t kq, int64_t n_total,
                 const uint8_t *w, const float *wd, const float *wm, const int8_t *xq,
                 const float *xe, const float *xs, const float *bias, float *y) {
    const int64_t sg = 8 * (int64_t)groups->count;
    __m256 acc[MR * NR];
    for (int i = 0; i < MR * NR; i++) acc[i] = _mm256_setzero_ps();
    for (int gi = 0; gi < groups->count; gi++) {
        const int g = groups->sizes[gi];
        __m256i s[MR][NR];
#if VNNI && !defined(DPBUSD_ASM) /* VNNI emulated */
        dot_group(mr, nr, g, kq, w, xq, s);
#else
        if (mr == MR && nr == NR && g % 2 == 0)
            dot_group_full(g, kq, w, xq, s);
        else
            dot_group(mr, nr, g, kq, w, xq, s);
#endif
        for (int m = 0; m < mr; m++) {
            const __m256 e = _mm256_loadu_ps(xe + m * sg), sum = _mm256_loadu_ps(xs + m * sg);
            for (int n = 0; n < nr; n++) {
                const __m256 d = _mm256_mul_ps(e, _mm256_loadu_ps(wd + n * sg));
                __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[m][n]), d, acc[m * NR + n]);
                acc[m * NR + n] = _mm256_fmadd_ps(_mm256_loadu_ps(wm + n * sg), sum, a);
            }
        }
        w += (g + 1) / 2 * 32;
        xq += g * MR * 32;
        wd += 8, wm += 8, xe += 8, xs += 8;
    }
    store_tile(acc, mr, nr, n_total, bias, y);
}

#define TILE_CASE(a, b)                                                                      \
    case (a) * NR + (b) - 1:                                                                 \
        tile(a, b, groups, kq, n_total, w, wd, wm, xq, xe, xs, bias, y);                     \
        break;

static void run_tile(int mr, int nr, const Groups *groups, int64_t kq, int64_t n_total,
                     const uint8_t *w, const float *wd, const float *wm, const int8_t *xq,
                     const float *xe, const float *xs, const float *bias, float *y) {
    switch (mr * NR + nr - 1) {
        TILE_CASE(1, 1) TILE_CASE(1, 2) TILE_CASE(2, 1) TILE_CASE(2, 2)
        TILE_CASE(3, 1) TILE_CASE(3, 2) TILE_CASE(4, 1) TILE_CASE(4, 2)
    }
}

/* One call's buffers, for the steps that work_split.h runs. */
typedef struct {
    const Groups *groups;
    int64_t k, kq, sg, n_total;
    const float *x, *wd, *wm, *bias;
    const uint8_t *w;
    int8_t *xq;
    float *xe, *xs, *y;
} Call;

static void quantize_token(const void *call, int64_t m) {
    const Call *c = call;
    quantize_row(c->x + m * c->k, c->groups, c->xq + (m / MR) * MR * c->k + (m % MR) * 32,
                 c->xe + m * c->sg, c->xs + m * c->sg);
}

/* Row tiles outer, token tiles inner (work_split.h's run_blocks picks the tokens). */
static void run_unit(const void *call, int64_t n0, int64_t n1, int64_t m0, int64_t m1) {
    const Call *c = call;
    const int64_t sg = c->sg;
    for (int64_t n = n0; n < n1; n += NR) {
        const int nr = n1 - n < NR ? (int)(n1 - n) : NR;
        for (int64_t m = m0; m < m1; m += MR) {
            const int mr = m1 - m < MR ? (int)(m1 - m) : MR;
            run_tile(mr, nr, c->groups, c->kq, c->n_total, c->w + n * c->kq, c->wd + n * sg,
                     c->wm + n * sg, c->xq + m * c->k, c->xe + m * sg, c->xs + m * sg,
                     c->bias ? c->bias + n : NULL, c->y + m * c->n_total + n);
        }
    }
}

/* Returns 0, or -1 for a K the layout cannot hold, -2 when out of memory. */
int q4_linear(const float *x, int64_t m_total, int64_t k, const uint8_t *w, const float *wd,
              const float *wm, int64_t n_total, const float *bias, float *y, int threads) {
    Groups groups;
    if (k <= 0 || k % 32 || make_groups(k, &groups)) return -1;
    if (threads < 1) threads = 1;
    const int64_t sg = 8 * (int64_t)groups.count, kq = row_bytes(&groups);
    const int64_t m_tiles = (m_total + MR - 1) / MR;
    /* sizes rounded up to the alignment, as aligned_alloc requires */
    const size_t xq_bytes = ((size_t)(m_tiles * MR * k) + 63) & ~(size_t)63;
    const size_t xs_bytes = ((size_t)(m_total * sg) * sizeof(float) + 63) & ~(size_t)63;
    int8_t *xq = aligned_alloc(64, xq_bytes);
    float *xe = aligned_alloc(64, xs_bytes), *xs = aligned_alloc(64, xs_bytes);
    if (!xq || !xe || !xs) {
        free(xq), free(xe), free(xs);
        return -2;
    }
    const Call call = {&groups, k, kq, sg, n_total, x, wd, wm, bias, w, xq, xe, xs, y};
    const Steps steps = {quantize_token, run_unit};
    split_work(&steps, &call, m_total, n_total, CHUNK_BYTES / kq, NR, k, MR, threads);
    free(xq), free(xe), free(xs);
    return 0;
}
