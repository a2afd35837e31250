/* Paged decode attention for the CPU, float32 (AVX2 + FMA).

   Each decode row has one query token per head. The key and value caches are head-major,
   [kv_heads, slots, head_dim], and a row's tokens live in the slots its block table names. One
   task per (row, kv head): the query heads of its GQA group read every key and value once from
   memory (again from L1 for the group's other heads). Scores for the whole context are kept,
   then exponentiated, then used to sum the values; the sum of the exponentials divides at the
   end. Each row's result depends on that row alone, in a fixed order of operations.

   Keys go 8 at a time: 8 dot-product accumulators, one horizontal 8-way sum, so that one
   reduction serves 8 scores. Values go in 64-float column slices. head_dim must be a multiple
   of 8. (Accumulating
   in double instead was measured on an earlier kernel: ~1.6x slower at short contexts, and the
   logits of SmolLM2 came no closer to a float64 reference, whose distance is dominated by the
   float32 matmuls.) */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd_math.h"

/* offsets[t]: where token t of a row lives in a head-major cache, in floats from the head's
   start, block by block (no division per token). */
static void token_offsets(const int32_t *table, int64_t len, int64_t block_size,
                          int64_t head_dim, int64_t *offsets) {
    for (int64_t b = 0, t0 = 0; t0 < len; b++, t0 += block_size) {
        const int64_t base = (int64_t)table[b] * block_size;
        for (int64_t o = 0; o < block_size && t0 + o < len; o++)
            offsets[t0 + o] = (base + o) * head_dim;
    }
}

/* scores[g][t] = scale * q_g . k_t for t < len; the lanes of a last partial chunk repeat its
   last key, and their scores are never read. */
static void attend_keys(const float *q, int64_t q_stride_h, int64_t group, const float *keys,
                        const float *values, const int64_t *offsets, int64_t len,
                        int64_t head_dim, float scale, float *scores, int64_t scores_stride) {
    const __m256 vscale = _mm256_set1_ps(scale);
    /* Prefetches: a row's blocks are scattered pages, which the hardware prefetcher finds only
       late, and at decode batch sizes the caches are read from memory. The first two chunks'
       keys now; then, at each chunk, the keys two chunks ahead and the chunk's values (which
       attend_values reads once every score is known). About 10 % off a layer of 16 rows. */
    for (int64_t t = 0; t < 16 && t < len; t++)
        for (int64_t d = 0; d < head_dim; d += 16)
            _mm_prefetch((const char *)(keys + offsets[t] + d), _MM_HINT_T0);
    for (int64_t t0 = 0; t0 < len; t0 += 8) {
        const float *k[8];
        for (int j = 0; j < 8; j++) k[j] = keys + offsets[t0 + j < len ? t0 + j : len - 1];
        for (int j = 0; j < 8; j++) {
            const int64_t ahead = t0 + 16 + j < len ? t0 + 16 + j : len - 1;
            const int64_t here = t0 + j < len ? t0 + j : len - 1;
            for (int64_t d = 0; d < head_dim; d += 16) {
                _mm_prefetch((const char *)(keys + offsets[ahead] + d), _MM_HINT_T0);
                _mm_prefetch((const char *)(values + offsets[here] + d), _MM_HINT_T1);
            }
        }
        for (int64_t g = 0; g < group; g++) {
            const float *qg = q + g * q_stride_h;
            __m256 acc[8];
            for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
            for (int64_t d = 0; d < head_dim; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qg + d);
                for (int j = 0; j < 8; j++)
                    acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j] + d), acc[j]);
            }
            _mm256_storeu_ps(scores + g * scores_stride + t0, _mm256_mul_ps(hsum8(acc), vscale));
        }
    }
}

/* s[t] = exp(s[t] - max s) for t < len, zero in the padding up to the next multiple of 8;
   returns the sum. */
static float exponentiate(float *s, int64_t len) {
    __m256 top = _mm256_set1_ps(-INFINITY);
    for (int64_t t = 0; t < len; t += 8) {
        const __m256 v = _mm256_loadu_ps(s + t);
        top = _mm256_max_ps(top, len - t >= 8 ? v
                                              : _mm256_blendv_ps(top, v, _mm256_castsi256_ps(
                                                                             lane_mask(len - t))));
    }
    const __m256 shift = _mm256_set1_ps(hmax256(top));
    __m256 total = _mm256_setzero_ps();
    for (int64_t t = 0; t < len; t += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), shift));
        if (len - t < 8) e = _mm256_and_ps(e, _mm256_castsi256_ps(lane_mask(len - t)));
        _mm256_storeu_ps(s + t, e);
        total = _mm256_add_ps(total, e);
    }
    return hsum256(total);
}

/* out[d] = (sum_t p[t] v_t[d]) * inverse, for one query head. Columns go 64 at a time (eight
   independent accumulators, enough to keep both FMA pipes busy), so that a token's row is read
   front to back in one pass. */
static void attend_values(const float *p, const float *values, const int64_t *offsets,
                          int64_t len, int64_t head_dim, float inverse, float *out) {
    const __m256 scale = _mm256_set1_ps(inverse);
    for (int64_t d = 0; d < head_dim; d += 64) {
        const int n = head_dim - d >= 64 ? 8 : (int)(head_dim - d) / 8;
        __m256 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t t = 0; t < len; t++) {
            const float *v = values + offsets[t] + d;
            const __m256 pt = _mm256_broadcast_ss(p + t);
            for (int i = 0; i < n; i++)
                acc[i] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 8 * i), acc[i]);
        }
        for (int i = 0; i < n; i++) _mm256_storeu_ps(out + d + 8 * i, _mm256_mul_ps(acc[i], scale));
    }
}

int decode_attention(
    const float *q, int64_t q_stride_t, int64_t q_stride_h,
    const float *k_cache, const float *v_cache, int64_t kv_stride_h,
    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
    int64_t rows, int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
    int64_t max_seq_len, float scale,
    float *out, int64_t out_stride_t, int64_t out_stride_h, int threads)
{
    if (head_dim % 8) return -1;
    const int64_t group = q_heads / kv_heads;
    const int64_t stride = (max_seq_len + 7) / 8 * 8; /* scores per query head, padded */
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * group * stride);
        int64_t *offsets = malloc(sizeof(int64_t) * stride);
        if (scores == NULL || offsets == NULL) {
#pragma omp atomic write
            failed = -2;
        }
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t h = 0; h < kv_heads; h++) {
                if (scores == NULL || offsets == NULL) continue;
                const int64_t len = seq_lens[r];
                const float *qh = q + r * q_stride_t + h * group * q_stride_h;
                token_offsets(block_tables + r * bt_stride, len, block_size, head_dim, offsets);
                attend_keys(qh, q_stride_h, group, k_cache + h * kv_stride_h,
                            v_cache + h * kv_stride_h, offsets, len, head_dim, scale, scores,
                            stride);
                for (int64_t g = 0; g < group; g++) {
                    float *p = scores + g * stride;
                    const float total = exponentiate(p, len);
                    attend_values(p, v_cache + h * kv_stride_h, offsets, len, head_dim,
                                  1.0f / total,
                                  out + r * out_stride_t + (h * group + g) * out_stride_h);
                }
            }
        }
        free(scores);
        free(offsets);
    }
    return failed;
}

/* Store the step's new keys and values, k and v [tokens, kv_heads, head_dim] (any token and
   head strides), at their slots of the head-major caches. */
void store_kv(const float *k, int64_t k_stride_t, int64_t k_stride_h, const float *v,
              int64_t v_stride_t, int64_t v_stride_h, float *k_cache, float *v_cache,
              int64_t kv_stride_h, const int64_t *slots, int64_t tokens, int64_t kv_heads,
              int64_t head_dim)
{
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            const float *ks = k + t * k_stride_t + h * k_stride_h;
            const float *vs = v + t * v_stride_t + h * v_stride_h;
            float *kd = k_cache + h * kv_stride_h + slots[t] * head_dim;
            float *vd = v_cache + h * kv_stride_h + slots[t] * head_dim;
            memcpy(kd, ks, sizeof(float) * head_dim);
            memcpy(vd, vs, sizeof(float) * head_dim);
        }
    }
}
