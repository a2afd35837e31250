/* Fused elementwise ops for the CPU float32 path: each replaces a chain of small torch ops
   (whose dispatch, at decode batch sizes, costs more than their arithmetic). Rows are
   independent and computed in a fixed order, whatever the batch. */

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "simd_math.h"

/* Small calls run on the calling thread: waking the pool costs more than they do. Above this,
   the pool: its workers spin between a step's regions, and a 16-row decode step's norms and
   RoPE (16 x 576 values, 16 x 12 heads x 64) took 0.34-0.37 ms a step on one thread, 0.23-0.24 on
   two (SmolLM2, 30 layers), half their rows having been written by the other core. */
#define PARALLEL_MIN 4096

/* out = w * (s * rsqrt(mean(s^2) + eps)) with s = x, or s = x + residual (then stored in
   res_out, the next residual). */
void rms_norm(const float *x, int64_t x_stride, const float *residual, int64_t r_stride,
              float *out, float *res_out, const float *w, int64_t rows, int64_t size, float eps,
              int threads)
{
#pragma omp parallel for num_threads(threads) if (rows * size >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * size;
        const float *s = xr;
        if (residual != NULL) {
            const float *rr = residual + r * r_stride;
            float *so = res_out + r * size;
#pragma omp simd
            for (int64_t i = 0; i < size; i++) so[i] = xr[i] + rr[i];
            s = so;
        }
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < size; i++) squares += s[i] * s[i];
        const float scale = 1.0f / sqrtf(squares / (float)size + eps);
#pragma omp simd
        for (int64_t i = 0; i < size; i++) o[i] = w[i] * (s[i] * scale);
    }
}

/* silu(x) * y = x / (1 + e^-x) * y */
static inline __m256 silu_times(__m256 x, __m256 y) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), x));
    return _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), y);
}

/* out[r] = silu(gate) * up, where row r of gate_up holds gate then up. */
void silu_mul(const float *gate_up, int64_t stride, float *out, int64_t rows, int64_t size,
              int threads)
{
#pragma omp parallel for num_threads(threads) if (rows * size >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * stride, *u = g + size;
        float *o = out + r * size;
        int64_t i = 0;
        for (; i + 8 <= size; i += 8)
            _mm256_storeu_ps(o + i, silu_times(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
        if (i < size) { /* masked moves are slow on some CPUs: the last partial chunk only */
            const __m256i mask = lane_mask((int)(size - i));
            const __m256 x = _mm256_maskload_ps(g + i, mask), y = _mm256_maskload_ps(u + i, mask);
            _mm256_maskstore_ps(o + i, mask, silu_times(x, y));
        }
    }
}

/* Rotary embedding of one tensor [tokens, heads, dim] (any token and head strides) into a
   contiguous out, by the token's cos and sin rows [tokens, dim]: the same float operations as
   x * cos + rotate_half(x) * sin. */
void rope(const float *x, int64_t stride_t, int64_t stride_h, float *out, const float *cos_,
          const float *sin_, int64_t tokens, int64_t heads, int64_t dim, int threads)
{
    const int64_t half = dim / 2;
#pragma omp parallel for num_threads(threads) if (tokens * heads * dim >= PARALLEL_MIN)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_ + t * dim, *s = sin_ + t * dim;
        for (int64_t h = 0; h < heads; h++) {
            const float *v = x + t * stride_t + h * stride_h;
            float *o = out + (t * heads + h) * dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                o[i] = v[i] * c[i] + (-v[i + half]) * s[i];
                o[i + half] = v[i + half] * c[i + half] + v[i] * s[i + half];
            }
        }
    }
}

/* out[r] = the index of row r's largest value, the first where several tie, as torch.argmax
   (a NaN counts as the largest: the first NaN's index). Each lane keeps its own largest and
   where it was first seen (a strictly larger value replaces it); the lanes then give the
   largest, the lowest index among ties. torch's took 0.47 ms over 16 x 49,152 logits. */
void argmax_rows(const float *x, int64_t stride, int64_t rows, int64_t size, int64_t *out,
                 int threads)
{
#pragma omp parallel for num_threads(threads) if (rows * size >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *v = x + r * stride;
        int64_t i = 0, best = 0;
        float top = v[0];
        if (size >= 8) {
            __m256 most = _mm256_loadu_ps(v), nan = _mm256_cmp_ps(most, most, _CMP_UNORD_Q);
            __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), where = at;
            const __m256i eight = _mm256_set1_epi32(8);
            for (i = 8; i + 8 <= size; i += 8) {
                const __m256 y = _mm256_loadu_ps(v + i);
                at = _mm256_add_epi32(at, eight);
                const __m256 larger = _mm256_cmp_ps(y, most, _CMP_GT_OQ);
                most = _mm256_blendv_ps(most, y, larger);
                where = _mm256_blendv_epi8(where, at, _mm256_castps_si256(larger));
                nan = _mm256_or_ps(nan, _mm256_cmp_ps(y, y, _CMP_UNORD_Q));
            }
            if (_mm256_movemask_ps(nan)) {
                i = 0; /* rare: the scan below from the start stops at the first NaN */
            } else {
                float lane_most[8];
                int32_t lane_where[8];
                _mm256_storeu_ps(lane_most, most);
                _mm256_storeu_si256((__m256i *)lane_where, where);
                top = lane_most[0], best = lane_where[0];
                for (int l = 1; l < 8; l++)
                    if (lane_most[l] > top || (lane_most[l] == top && lane_where[l] < best))
                        top = lane_most[l], best = lane_where[l];
            }
        }
        for (; i < size; i++) { /* the last partial vector, a short row, or a row with a NaN */
            if (v[i] != v[i]) {
                best = i;
                break;
            }
            if (v[i] > top) top = v[i], best = i;
        }
        out[r] = best;
    }
}

/* Structured outputs: in row rows[i] of logits, every token whose bit in row i of the bitmask is
   clear becomes -inf (bit b of word w stands for token 32 w + b). Words of all ones, the common
   case of a loose constraint, are skipped whole. */
void apply_token_bitmask(float *logits, int64_t stride, const int64_t *rows, int64_t count,
                         const int32_t *bitmask, int64_t words, int64_t vocab, int threads)
{
#pragma omp parallel for num_threads(threads) if (count * vocab >= PARALLEL_MIN)
    for (int64_t i = 0; i < count; i++) {
        float *l = logits + rows[i] * stride;
        const uint32_t *m = (const uint32_t *)(bitmask + i * words);
        for (int64_t w = 0; w < words && w * 32 < vocab; w++) {
            const uint32_t bits = m[w];
            if (bits == 0xffffffffu) continue;
            const int64_t base = w * 32;
            const int64_t n = vocab - base < 32 ? vocab - base : 32;
            for (int64_t b = 0; b < n; b++)
                if (!((bits >> b) & 1u)) l[base + b] = -INFINITY;
        }
    }
}

/* Multi-LoRA side path: y[t] += (x[t] A^T) B^T with token t's slot's factors, for every token
   whose slot is >= 0 and whose slot's adapter has a rank here. A is [parts][slots][max_rank][in]
   and B^T [slots][max_rank][out], part p writing columns starts[p] .. starts[p + 1]. A token's
   update is summed apart, then added to y: its bits depend on its own slot and x alone. */
void lora_add(const float *x, int64_t x_stride, float *y, int64_t y_stride,
              const int32_t *token_slots, int64_t tokens, const float *a, const float *bt,
              const int32_t *ranks, int64_t slots, int64_t max_rank, const int64_t *starts,
              int64_t parts, int64_t in, int64_t out, int threads)
{
    enum { BLOCK = 64 };
#pragma omp parallel for num_threads(threads) if (tokens * in * max_rank * parts >= PARALLEL_MIN)
    for (int64_t t = 0; t < tokens; t++) {
        const int32_t s = token_slots[t];
        if (s < 0 || ranks[s] == 0) continue;
        const int64_t rank = ranks[s];
        const float *xt = x + t * x_stride;
        float *yt = y + t * y_stride;
        const float *b = bt + (int64_t)s * max_rank * out;
        float h[rank];
        for (int64_t p = 0; p < parts; p++) {
            const float *ap = a + (p * slots + s) * max_rank * in;
            int64_t j = 0;
            /* Four rows at a time: four independent sums hide the adds' latency. */
            for (; j + 4 <= rank; j += 4) {
                const float *r0 = ap + j * in, *r1 = r0 + in, *r2 = r1 + in, *r3 = r2 + in;
                float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
                for (int64_t i = 0; i < in; i++) {
                    s0 += r0[i] * xt[i];
                    s1 += r1[i] * xt[i];
                    s2 += r2[i] * xt[i];
                    s3 += r3[i] * xt[i];
                }
                h[j] = s0, h[j + 1] = s1, h[j + 2] = s2, h[j + 3] = s3;
            }
            for (; j < rank; j++) {
                const float *row = ap + j * in;
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int64_t i = 0; i < in; i++) acc += row[i] * xt[i];
                h[j] = acc;
            }
            for (int64_t c0 = starts[p]; c0 < starts[p + 1]; c0 += BLOCK) {
                const int64_t n = starts[p + 1] - c0 < BLOCK ? starts[p + 1] - c0 : BLOCK;
                float u[BLOCK] = {0};
                for (int64_t j = 0; j < rank; j++) {
                    const float hj = h[j], *bj = b + j * out + c0;
#pragma omp simd
                    for (int64_t c = 0; c < n; c++) u[c] += hj * bj[c];
                }
#pragma omp simd
                for (int64_t c = 0; c < n; c++) yt[c0 + c] += u[c];
            }
        }
    }
}
