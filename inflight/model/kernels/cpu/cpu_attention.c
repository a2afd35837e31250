/* Paged attention for the CPU, float32 (AVX2 + FMA): a step's decode rows and prefill chunks in
   one call.

   The key and value caches are head-major, [kv_heads, slots, head_dim], and a row's tokens live
   in the slots its block table names. A row's Q query tokens are the last Q of its seq_len: its
   token i attends over the first seq_len - Q + i + 1 keys, or with a window W over the last W
   of them (blocks before those are never read: they may have been given back). Every token is
   computed as a decode
   row over those keys would be, in the same operations and order, whatever its row's Q, the
   tokens it is tiled with, the rows beside it or the thread that runs it. So a token gets the
   same bits whether its prompt is prefilled whole, in chunks of any size, after a prefix read
   from the context cache, or decoded token by token: a request's result cannot depend on
   how its prompt was split, nor on what shares its steps.

   One task per (tile, kv head), a tile being up to TILE_MAX consecutive tokens of a row; its
   query vectors, the query heads of the GQA group for each of its tokens, read every key and
   value once from memory (again from L1 for the others). A vector's scores over its whole
   context are kept, then exponentiated, then used to sum the values; the sum of the
   exponentials divides at the end.

   A score is q . k as 8 lanes of partial sums over head_dim, reduced by hsum8's fixed tree,
   then scaled; keys go 8 at a time for one vector, or 4 at a time for two (fewer loads per
   fma), in the same operations per score. A value column sums one fma per key, in key order,
   then takes the inverse sum: keys go in chunks that stay in L1 while the tile's vectors read
   them, two vectors sharing each load. head_dim must be a multiple of 8. (Accumulating in
   double instead was measured on an earlier kernel: ~1.6x slower at short contexts, and the
   logits of SmolLM2 came no closer to a float64 reference, whose distance is dominated by the
   float32 matmuls.) */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd_math.h"

#define INLINE static inline __attribute__((always_inline))

/* offsets[t - lo]: where token t in [lo, end) of a row lives in a head-major cache, in floats
   from the head's start, block by block (no division per token). */
static void token_offsets(const int32_t *table, int64_t lo, int64_t end, int64_t block_size,
                          int64_t head_dim, int64_t *offsets) {
    for (int64_t t = lo; t < end;) {
        const int64_t base = (int64_t)table[t / block_size] * block_size;
        for (int64_t o = t % block_size; o < block_size && t < end; o++, t++)
            offsets[t - lo] = (base + o) * head_dim;
    }
}

/* A tile's query vectors are its tokens' query heads of one GQA group, token-major: vector u is
   head u % group of token u / group, which sees the first first_len + u / group keys of its
   row, or with a window the last `window` of them. Keys are counted from the tile's first key,
   `lo` (its first vector's first), so that vector u sees keys [vector_start, vector_end). */
typedef struct {
    int64_t first_len, group, window, lo;
} TileKeys;

INLINE int64_t vector_end(const TileKeys *k, int64_t u) {
    return k->first_len + u / k->group - k->lo;
}

INLINE int64_t vector_start(const TileKeys *k, int64_t u) {
    if (k->window <= 0) return 0;
    const int64_t first = k->first_len + u / k->group - k->window; /* its first key in the row */
    return (first > 0 ? first : 0) - k->lo;
}

/* Lane j of the result: q . k[j] (j < 8) for one query vector, its 8-lane partial sums over
   head_dim then hsum8's fixed tree. */
static inline __m256 dots_1x8(const float *q, const float *const k[8], int64_t head_dim) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j] + d), acc[j]);
    }
    return hsum8(acc);
}

/* The same dots for two query vectors and 4 keys: lanes 0-3 qa . k[j], lanes 4-7 qb . k[j],
   each in exactly dots_1x8's operations (hsum8 sums every lane alike), for 6 loads per 8 fmas
   instead of 9. */
static inline __m256 dots_2x4(const float *qa, const float *qb, const float *const k[4],
                              int64_t head_dim) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
        const __m256 a = _mm256_loadu_ps(qa + d), b = _mm256_loadu_ps(qb + d);
        for (int j = 0; j < 4; j++) {
            const __m256 kv = _mm256_loadu_ps(k[j] + d);
            acc[j] = _mm256_fmadd_ps(a, kv, acc[j]);
            acc[4 + j] = _mm256_fmadd_ps(b, kv, acc[4 + j]);
        }
    }
    return hsum8(acc);
}

/* scores[u][t] = scale * q_u . k_t for the tile's `vectors` query vectors (q_u at q + (u / group)
   * q_stride_t + (u % group) * q_stride_h) and the tile's keys up to each one's last. The lanes
   of a last partial chunk repeat the tile's last key; a vector's scores outside its own keys
   are never read. */
static void attend_keys(const float *q, int64_t q_stride_t, int64_t q_stride_h, int64_t vectors,
                        const TileKeys *tk, const float *keys, const float *values,
                        const int64_t *offsets, int64_t head_dim, float scale, float *scores,
                        int64_t scores_stride) {
    const int64_t group = tk->group;
    const __m256 vscale = _mm256_set1_ps(scale);
    const int64_t len = vector_end(tk, vectors - 1);
    /* Prefetches: a row's blocks are scattered pages, which the hardware prefetcher finds only
       late, and at decode batch sizes the caches are read from memory. The first two chunks'
       keys now; then, at each chunk, the keys two chunks ahead and the chunk's values (which
       attend_values reads once every score is known). About 10 % off a layer of 16 rows. All
       into L2 (T1): prefetches into L1 hold its few miss buffers, and with the keys' there a
       30-layer decode step's attention took 4.0-4.9 ms against 3.0-3.4 (16 rows, Zen 4, the
       caches read from memory). */
    for (int64_t t = 0; t < 16 && t < len; t++)
        for (int64_t d = 0; d < head_dim; d += 16)
            _mm_prefetch((const char *)(keys + offsets[t] + d), _MM_HINT_T1);
    for (int64_t t0 = 0; t0 < len; t0 += 8) {
        const float *k[8];
        for (int j = 0; j < 8; j++) k[j] = keys + offsets[t0 + j < len ? t0 + j : len - 1];
        for (int j = 0; j < 8; j++) {
            const int64_t ahead = t0 + 16 + j < len ? t0 + 16 + j : len - 1;
            const int64_t here = t0 + j < len ? t0 + j : len - 1;
            for (int64_t d = 0; d < head_dim; d += 16) {
                _mm_prefetch((const char *)(keys + offsets[ahead] + d), _MM_HINT_T1);
                _mm_prefetch((const char *)(values + offsets[here] + d), _MM_HINT_T1);
            }
        }
        int64_t u = 0;
        for (; u + 1 < vectors; u += 2) {
            if (t0 >= vector_end(tk, u + 1)) continue; /* both end before */
            const float *qa = q + (u / group) * q_stride_t + (u % group) * q_stride_h;
            const float *qb = q + ((u + 1) / group) * q_stride_t + ((u + 1) % group) * q_stride_h;
            float *sa = scores + u * scores_stride + t0, *sb = sa + scores_stride;
            for (int half = 0; half < 8; half += 4) {
                const __m256 both = _mm256_mul_ps(dots_2x4(qa, qb, k + half, head_dim), vscale);
                _mm_storeu_ps(sa + half, _mm256_castps256_ps128(both));
                _mm_storeu_ps(sb + half, _mm256_extractf128_ps(both, 1));
            }
        }
        if (u < vectors && t0 < vector_end(tk, u)) {
            const float *qa = q + (u / group) * q_stride_t + (u % group) * q_stride_h;
            _mm256_storeu_ps(scores + u * scores_stride + t0,
                             _mm256_mul_ps(dots_1x8(qa, k, head_dim), vscale));
        }
    }
}

/* s[t] = exp(s[t] - m) for t < len, zero in the padding up to the next multiple of 8, m the
   largest of the s[t] and `sink`; returns their sum plus exp(sink - m): a sink (-INFINITY: none)
   is one more score whose value is zero. */
static float exponentiate(float *s, int64_t len, float sink) {
    __m256 top = _mm256_set1_ps(-INFINITY);
    for (int64_t t = 0; t < len; t += 8) {
        const __m256 v = _mm256_loadu_ps(s + t);
        top = _mm256_max_ps(top, len - t >= 8 ? v
                                              : _mm256_blendv_ps(top, v, _mm256_castsi256_ps(
                                                                             lane_mask(len - t))));
    }
    const float most = hmax256(top);
    const float m = sink > most ? sink : most;
    const __m256 shift = _mm256_set1_ps(m);
    __m256 total = _mm256_setzero_ps();
    for (int64_t t = 0; t < len; t += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), shift));
        if (len - t < 8) e = _mm256_and_ps(e, _mm256_castsi256_ps(lane_mask(len - t)));
        _mm256_storeu_ps(s + t, e);
        total = _mm256_add_ps(total, e);
    }
    /* adding exp(-inf) = 0 leaves the sum's bits as they are without a sink */
    return hsum256(total) + expf(sink - m);
}

/* Keys per pass of attend_values: their values stay in L1 while every vector of the tile reads
   them. */
#define VALUE_CHUNK_FLOATS 4096

/* o[c] += p[t] * v_t[c] for keys t in [t0, e), one fma per key in key order, for columns
   [d, d + 8 n) of one vector (n <= 8, a constant once inlined, so the sums stay in
   registers). */
INLINE void values_1(int n, const float *p, const float *values, const int64_t *offsets,
                     int64_t t0, int64_t e, int64_t d, float *o) {
    __m256 acc[8];
    for (int i = 0; i < n; i++) acc[i] = _mm256_loadu_ps(o + d + 8 * i);
    for (int64_t t = t0; t < e; t++) {
        const float *v = values + offsets[t] + d;
        const __m256 pt = _mm256_broadcast_ss(p + t);
        for (int i = 0; i < n; i++) acc[i] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 8 * i), acc[i]);
    }
    for (int i = 0; i < n; i++) _mm256_storeu_ps(o + d + 8 * i, acc[i]);
}

/* The same for two vectors a and b (n <= 4) over keys [a0, a1) and [b0, b1), b's starting and
   ending no earlier than a's, sharing each value load: a's keys before b's, their keys in
   common, then b's rest, so that every column still takes its keys in order. */
INLINE void values_2(int n, const float *pa, const float *pb, const float *values,
                     const int64_t *offsets, int64_t a0, int64_t a1, int64_t b0, int64_t b1,
                     int64_t d, float *oa, float *ob) {
    __m256 a[4], b[4];
    for (int i = 0; i < n; i++) {
        a[i] = _mm256_loadu_ps(oa + d + 8 * i);
        b[i] = _mm256_loadu_ps(ob + d + 8 * i);
    }
    const int64_t alone = a1 < b0 ? a1 : b0;
    for (int64_t t = a0; t < alone; t++) {
        const float *v = values + offsets[t] + d;
        const __m256 at = _mm256_broadcast_ss(pa + t);
        for (int i = 0; i < n; i++) a[i] = _mm256_fmadd_ps(at, _mm256_loadu_ps(v + 8 * i), a[i]);
    }
    const int64_t common = a1 < b1 ? a1 : b1;
    for (int64_t t = a0 > b0 ? a0 : b0; t < common; t++) {
        const float *v = values + offsets[t] + d;
        const __m256 at = _mm256_broadcast_ss(pa + t), bt = _mm256_broadcast_ss(pb + t);
        for (int i = 0; i < n; i++) {
            const __m256 vi = _mm256_loadu_ps(v + 8 * i);
            a[i] = _mm256_fmadd_ps(at, vi, a[i]);
            b[i] = _mm256_fmadd_ps(bt, vi, b[i]);
        }
    }
    for (int64_t t = common > b0 ? common : b0; t < b1; t++) {
        const float *v = values + offsets[t] + d;
        const __m256 bt = _mm256_broadcast_ss(pb + t);
        for (int i = 0; i < n; i++) b[i] = _mm256_fmadd_ps(bt, _mm256_loadu_ps(v + 8 * i), b[i]);
    }
    for (int i = 0; i < n; i++) {
        _mm256_storeu_ps(oa + d + 8 * i, a[i]);
        _mm256_storeu_ps(ob + d + 8 * i, b[i]);
    }
}

/* out_u[c] = (sum_t p_u[t] v_t[c]) * inverse[u] for the tile's vectors u (p_u: row u of scores,
   exponentiated; out_u at out + (u / group) * out_stride_t + (u % group) * out_stride_h), over
   each one's keys. Every column sums one fma per key, in key order from zero, then scales:
   the same operations however the vectors are paired and the keys chunked (a sum left in out
   between chunks is a float32 round trip, exact). */
static void attend_values(const float *scores, int64_t scores_stride, int64_t vectors,
                          const TileKeys *tk, const float *values, const int64_t *offsets,
                          int64_t head_dim, const float *inverse, float *out,
                          int64_t out_stride_t, int64_t out_stride_h) {
    const int64_t group = tk->group;
#define OUT(u) (out + ((u) / group) * out_stride_t + ((u) % group) * out_stride_h)
    const int64_t len = vector_end(tk, vectors - 1);
    const int64_t chunk = VALUE_CHUNK_FLOATS / head_dim > 8 ? VALUE_CHUNK_FLOATS / head_dim : 8;
    for (int64_t u = 0; u < vectors; u++) memset(OUT(u), 0, sizeof(float) * head_dim);
    for (int64_t t0 = 0; t0 < len; t0 += chunk) {
        const int64_t t1 = t0 + chunk < len ? t0 + chunk : len;
        /* vector u's keys within [t0, t1) */
#define CLIP(x) ((x) < t0 ? t0 : (x) < t1 ? (x) : t1)
        int64_t u = 0;
        for (; u + 1 < vectors; u += 2) {
            const int64_t a0 = CLIP(vector_start(tk, u)), a1 = CLIP(vector_end(tk, u));
            const int64_t b0 = CLIP(vector_start(tk, u + 1)), b1 = CLIP(vector_end(tk, u + 1));
            if (b0 >= b1 && a0 >= a1) continue; /* neither has keys here */
            const float *pa = scores + u * scores_stride, *pb = pa + scores_stride;
            int64_t d = 0;
            for (; d + 32 <= head_dim; d += 32)
                values_2(4, pa, pb, values, offsets, a0, a1, b0, b1, d, OUT(u), OUT(u + 1));
            if (d < head_dim)
                values_2((int)(head_dim - d) / 8, pa, pb, values, offsets, a0, a1, b0, b1, d,
                         OUT(u), OUT(u + 1));
        }
        if (u < vectors) {
            const int64_t s = CLIP(vector_start(tk, u)), e = CLIP(vector_end(tk, u));
            const float *p = scores + u * scores_stride;
            int64_t d = 0;
            for (; s < e && d + 64 <= head_dim; d += 64)
                values_1(8, p, values, offsets, s, e, d, OUT(u));
            if (s < e && d < head_dim)
                values_1((int)(head_dim - d) / 8, p, values, offsets, s, e, d, OUT(u));
        }
#undef CLIP
    }
    for (int64_t u = 0; u < vectors; u++) {
        const __m256 scale = _mm256_set1_ps(inverse[u]);
        float *o = OUT(u);
        for (int64_t d = 0; d < head_dim; d += 8)
            _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), scale));
    }
#undef OUT
}

/* The scores of a tile take at most this much (its tokens' whole contexts, every head of the
   group), so that they stay in L2 between the passes over them. */
#define TILE_BYTES (256 * 1024)
#define TILE_MAX 16

/* Tokens [first, first + count) of a row's query tokens. */
typedef struct {
    int64_t row, first, count;
} Tile;

/* Attends every query token of the step's rows: row r's are q's tokens [query_start[r],
   query_start[r + 1]), the last of its seq_lens[r] keys; window > 0: each over the last
   `window` keys up to its own; sinks (NULL: none): a logit per query head that joins every
   softmax of the head's as one more score and adds nothing to the sum of values (gpt-oss). 0,
   or -1 for a head_dim the kernel cannot take, -2 when out of memory. */
int paged_attention(
    const float *q, int64_t q_stride_t, int64_t q_stride_h,
    const float *k_cache, const float *v_cache, int64_t kv_stride_h,
    const int32_t *block_tables, int64_t bt_stride, const int32_t *query_start,
    const int32_t *seq_lens, int64_t rows, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
    int64_t block_size, int64_t max_seq_len, int64_t window, float scale,
    float *out, int64_t out_stride_t, int64_t out_stride_h, int threads, const float *sinks)
{
    if (head_dim % 8) return -1;
    const int64_t group = q_heads / kv_heads;
    /* scores per query head, padded: a tile's keys (with a window, those of up to TILE_MAX
       tokens; a vector's exponentials, starting where its window does, then pad past them) */
    const int64_t span = window > 0 && window + TILE_MAX - 1 < max_seq_len
                             ? window + TILE_MAX - 1 : max_seq_len;
    const int64_t stride = (span + 7) / 8 * 8 + (window > 0 ? 8 : 0);
    int64_t tile = TILE_BYTES / ((int64_t)sizeof(float) * group * stride);
    tile = tile < 1 ? 1 : tile > TILE_MAX ? TILE_MAX : tile;
    int64_t count = 0;
    for (int64_t r = 0; r < rows; r++)
        count += (query_start[r + 1] - query_start[r] + tile - 1) / tile;
    Tile *tiles = malloc(sizeof(Tile) * (count > 0 ? count : 1));
    if (tiles == NULL) return -2;
    /* a row's last tiles read the most keys: first, so that the schedule ends on short tasks */
    int64_t n = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t qlen = query_start[r + 1] - query_start[r];
        for (int64_t first = (qlen - 1) / tile * tile; first >= 0; first -= tile)
            tiles[n++] = (Tile){r, first, qlen - first < tile ? qlen - first : tile};
    }
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        /* a tile's scores, then the inverse of each vector's sum of exponentials */
        float *scores = malloc(sizeof(float) * tile * group * (stride + 1));
        int64_t *offsets = malloc(sizeof(int64_t) * stride);
        if (scores == NULL || offsets == NULL) {
#pragma omp atomic write
            failed = -2;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < count * kv_heads; task++) {
            if (scores == NULL || offsets == NULL) continue;
            const Tile *t = &tiles[task / kv_heads];
            const int64_t h = task % kv_heads, vectors = t->count * group;
            const int64_t start = query_start[t->row] + t->first;
            const int64_t qlen = query_start[t->row + 1] - query_start[t->row];
            const int64_t first_len = seq_lens[t->row] - qlen + t->first + 1;
            const int64_t lo = window > 0 && first_len > window ? first_len - window : 0;
            const TileKeys tk = {first_len, group, window, lo};
            float *inverse = scores + tile * group * stride;
            token_offsets(block_tables + t->row * bt_stride, lo, first_len + t->count - 1,
                          block_size, head_dim, offsets);
            attend_keys(q + start * q_stride_t + h * group * q_stride_h, q_stride_t, q_stride_h,
                        vectors, &tk, k_cache + h * kv_stride_h, v_cache + h * kv_stride_h,
                        offsets, head_dim, scale, scores, stride);
            for (int64_t u = 0; u < vectors; u++) {
                const int64_t s = vector_start(&tk, u);
                const float sink = sinks ? sinks[h * group + u % group] : -INFINITY;
                inverse[u] =
                    1.0f / exponentiate(scores + u * stride + s, vector_end(&tk, u) - s, sink);
            }
            attend_values(scores, stride, vectors, &tk, v_cache + h * kv_stride_h, offsets,
                          head_dim, inverse,
                          out + start * out_stride_t + h * group * out_stride_h, out_stride_t,
                          out_stride_h);
        }
        free(scores);
        free(offsets);
    }
    free(tiles);
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
