/* How a quantized matmul call (int8_matmul.c, q4_matmul.c, k8_matmul.c) shares its work
   between threads.

   A call has two steps: quantize each token's activations into the kernel's tiles, then run
   tiles of tokens x weight rows. Weight rows go in units small enough that every thread gets
   several (taken dynamically, so that a thread the OS preempts does not hold up the others; a
   result never depends on who computes it), at most a chunk that stays in L2 while the token
   tiles pass over it. With few tokens (decode) every thread needs every token: they are
   quantized first, then the threads share out the units. With many (prefill) each thread takes
   whole blocks of tokens, quantizes them and runs them over every unit, so that no thread waits
   for another's tokens (each reads all the weights, from the shared L3). */

#ifndef INFLIGHT_WORK_SPLIT_H
#define INFLIGHT_WORK_SPLIT_H

#include <stdint.h>

#define M_BLOCK 64 /* tokens per thread's share of a long prompt */
#define L1_TOKEN_BYTES (32 * 1024) /* quantized activations a unit keeps in L1 (32 KiB) */

/* Tokens per pass of a unit's weight rows, for `tokens` tokens of `bytes` each: all of them where
   they fit L1_TOKEN_BYTES, else one register tile of mr. All: the unit runs its rows outer and
   the tokens inner, so that each tile's rows come from memory once and serve every token tile
   while in L1, and the weights stream evenly over the work (token tiles outer had the first one
   wait on memory alone: a decode step's 16 tokens up to a fifth slower). More tokens than fit
   (a prefill's share of 64) would be reread from L2 for every row tile, even in blocks that
   fit (rows outer over blocks of 28 tokens of 576: 13-20 % slower), so there token tiles go
   outer, each over the unit's rows in L2. */
static inline int64_t token_block(int64_t tokens, int64_t bytes, int mr) {
    return tokens * bytes <= L1_TOKEN_BYTES ? tokens : mr;
}

/* The two steps on one call's buffers (`call`, the kernel's own struct). */
typedef struct {
    void (*quantize)(const void *call, int64_t m); /* token m into the tiles */
    /* weight rows [n0, n1) over tokens [m0, m1), m0 a multiple of the token tile: its row
       tiles outer, each over every token tile */
    void (*run)(const void *call, int64_t n0, int64_t n1, int64_t m0, int64_t m1);
} Steps;

/* One unit of weight rows [n0, n1) over tokens [m0, m1), a token_block of them per run. */
static inline void run_blocks(const Steps *steps, const void *call, int64_t n0, int64_t n1,
                              int64_t m0, int64_t m1, int64_t token_bytes, int mr) {
    const int64_t block = token_block(m1 - m0, token_bytes, mr);
    for (int64_t b0 = m0; b0 < m1; b0 += block)
        steps->run(call, n0, n1, b0, b0 + block < m1 ? b0 + block : m1);
}

/* rows_fit: weight rows that fit the kernel's cache chunk; nr and mr: weight rows and tokens
   per register tile; token_bytes: a token's quantized activations. */
static void split_work(const Steps *steps, const void *call, int64_t m_total, int64_t n_total,
                       int64_t rows_fit, int nr, int64_t token_bytes, int mr, int threads) {
    const int64_t fit = rows_fit / nr > 0 ? rows_fit / nr : 1;
    const int64_t share = (n_total + 4 * threads * nr - 1) / (4 * threads * nr);
    const int64_t unit = (share < fit ? share : fit) * nr;
    const int64_t units = (n_total + unit - 1) / unit;
    const int64_t m_blocks = (m_total + M_BLOCK - 1) / M_BLOCK;
    if (m_blocks >= 2 * threads) {
#pragma omp parallel for num_threads(threads) schedule(dynamic)
        for (int64_t mb = 0; mb < m_blocks; mb++) {
            const int64_t m0 = mb * M_BLOCK, m1 = m0 + M_BLOCK < m_total ? m0 + M_BLOCK : m_total;
            for (int64_t m = m0; m < m1; m++) steps->quantize(call, m);
            for (int64_t n0 = 0; n0 < n_total; n0 += unit)
                run_blocks(steps, call, n0, n0 + unit < n_total ? n0 + unit : n_total, m0, m1,
                           token_bytes, mr);
        }
    } else {
#pragma omp parallel num_threads(threads)
        {
#pragma omp for schedule(static)
            for (int64_t m = 0; m < m_total; m++) steps->quantize(call, m);
            /* implicit barrier: every token is quantized before any tile reads it */
#pragma omp for schedule(dynamic) nowait /* the region's end waits anyway */
            for (int64_t u = 0; u < units; u++) {
                const int64_t n0 = u * unit;
                run_blocks(steps, call, n0, n0 + unit < n_total ? n0 + unit : n_total, 0,
                           m_total, token_bytes, mr);
            }
        }
    }
}

#endif
