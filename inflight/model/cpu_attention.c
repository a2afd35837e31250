/* Paged decode attention for the CPU, float32.

   Each decode row has one query token per head. The key and value caches are head-major,
   [kv_heads, slots, head_dim], and a row's tokens live in the slots its block table names. One
   task per (row, kv head): the query heads of its GQA group read every key and value once.
   Scores for the whole context are kept, then softmaxed, then used to sum the values: each
   row's result depends on that row alone, in a fixed order of operations. (Accumulating in
   double instead was measured: ~1.6x slower at short contexts, and the logits of SmolLM2 came
   no closer to a float64 reference, whose distance is dominated by the float32 matmuls.) */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int decode_attention(
    const float *q, int64_t q_stride_t, int64_t q_stride_h,
    const float *k_cache, const float *v_cache, int64_t kv_stride_h,
    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
    int64_t rows, int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
    int64_t max_seq_len, float scale,
    float *out, int64_t out_stride_t, int64_t out_stride_h, int threads)
{
    const int64_t group = q_heads / kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * group * max_seq_len);
        float *acc = malloc(sizeof(float) * group * head_dim);
        if (scores == NULL || acc == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t h = 0; h < kv_heads; h++) {
                if (scores == NULL || acc == NULL) continue;
                const int64_t len = seq_lens[r];
                const int32_t *table = block_tables + r * bt_stride;
                const float *keys = k_cache + h * kv_stride_h;
                const float *values = v_cache + h * kv_stride_h;
                const float *qh = q + r * q_stride_t + h * group * q_stride_h;
                /* Block by block: no division per token to find its slot. */
                for (int64_t b = 0, t0 = 0; t0 < len; b++, t0 += block_size) {
                    const float *block = keys + (int64_t)table[b] * block_size * head_dim;
                    const int64_t n = len - t0 < block_size ? len - t0 : block_size;
                    for (int64_t o = 0; o < n; o++) {
                        const float *key = block + o * head_dim;
                        for (int64_t g = 0; g < group; g++) {
                            const float *qg = qh + g * q_stride_h;
                            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                            for (int64_t i = 0; i < head_dim; i++) dot += qg[i] * key[i];
                            scores[g * max_seq_len + t0 + o] = dot * scale;
                        }
                    }
                }
                for (int64_t g = 0; g < group; g++) {
                    float *s = scores + g * max_seq_len;
                    float top = s[0];
                    for (int64_t t = 1; t < len; t++) top = s[t] > top ? s[t] : top;
                    float total = 0.0f;
#pragma omp simd reduction(+ : total)
                    for (int64_t t = 0; t < len; t++) {
                        s[t] = expf(s[t] - top);
                        total += s[t];
                    }
                    const float inverse = 1.0f / total;
#pragma omp simd
                    for (int64_t t = 0; t < len; t++) s[t] *= inverse;
                    for (int64_t i = 0; i < head_dim; i++) acc[g * head_dim + i] = 0.0f;
                }
                for (int64_t b = 0, t0 = 0; t0 < len; b++, t0 += block_size) {
                    const float *block = values + (int64_t)table[b] * block_size * head_dim;
                    const int64_t n = len - t0 < block_size ? len - t0 : block_size;
                    for (int64_t o = 0; o < n; o++) {
                        const float *value = block + o * head_dim;
                        for (int64_t g = 0; g < group; g++) {
                            const float p = scores[g * max_seq_len + t0 + o];
                            float *a = acc + g * head_dim;
#pragma omp simd
                            for (int64_t i = 0; i < head_dim; i++) a[i] += p * value[i];
                        }
                    }
                }
                for (int64_t g = 0; g < group; g++) {
                    float *o = out + r * out_stride_t + (h * group + g) * out_stride_h;
                    for (int64_t i = 0; i < head_dim; i++) o[i] = acc[g * head_dim + i];
                }
            }
        }
        free(scores);
        free(acc);
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
