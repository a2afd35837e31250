/* A whole step of a Llama-family decoder in one call: every layer, through the same kernels the
   Python layers call one by one (reached here through function pointers, so this file holds no
   arithmetic of its own but a mixture of experts' weighted sums, which are torch's single float
   ops, and the results are the Python path's bit for bit), attention included: decode rows and
   prefill chunks alike in the CPU attention backend's kernel. A mixture of experts' router is
   the layer's own Python, called back (see Step's `route`).

   At short-chat batch sizes the Python around a layer's ten native calls cost about a third of
   the step; here each layer is ten plain C calls. The caller runs the embedding before and the
   final norm after; the last layer's output and the residual come back in `x` and `residual`. */

#include <stdint.h>
#include <string.h>

typedef int (*linear2_fn)(const float *x, int64_t m, int64_t k, const void *w0, const void *w1,
                          int64_t n, const float *bias, float *out, int threads);
typedef int (*linear3_fn)(const float *x, int64_t m, int64_t k, const void *w0, const void *w1,
                          const void *w2, int64_t n, const float *bias, float *out, int threads);
typedef void (*rms_norm_fn)(const float *x, int64_t x_stride, const float *residual,
                            int64_t r_stride, float *out, float *res_out, const float *w,
                            int64_t rows, int64_t size, float eps, int threads);
typedef void (*silu_mul_fn)(const float *gate_up, int64_t stride, float *out, int64_t rows,
                            int64_t size, int threads);
typedef void (*rope_fn)(const float *x, int64_t stride_t, int64_t stride_h, float *out,
                        const float *cos_, const float *sin_, int64_t tokens, int64_t heads,
                        int64_t dim, int threads);
typedef void (*store_kv_fn)(const float *k, int64_t k_stride_t, int64_t k_stride_h,
                            const float *v, int64_t v_stride_t, int64_t v_stride_h,
                            float *k_cache, float *v_cache, int64_t kv_stride_h,
                            const int64_t *slots, int64_t tokens, int64_t kv_heads,
                            int64_t head_dim);
typedef void (*lora_add_fn)(const float *x, int64_t x_stride, float *y, int64_t y_stride,
                            const int32_t *token_slots, int64_t tokens, const float *a,
                            const float *bt, const int32_t *ranks, int64_t slots,
                            int64_t max_rank, const int64_t *starts, int64_t parts, int64_t in,
                            int64_t out, int threads);
typedef int (*attention_fn)(const float *q, int64_t q_stride_t, int64_t q_stride_h,
                            const float *k_cache, const float *v_cache, int64_t kv_stride_h,
                            const int32_t *block_tables, int64_t bt_stride,
                            const int32_t *query_start, const int32_t *seq_lens, int64_t rows,
                            int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                            int64_t block_size, int64_t max_seq_len, int64_t window,
                            float scale, float *out, int64_t out_stride_t, int64_t out_stride_h,
                            int threads, const float *sinks);
/* Mixture-of-experts layer `layer`'s routing of the step's normed tokens (Step's h): each
   token's top_k expert weights [tokens, top_k] and indices (int64), and its shared expert's
   gate [tokens] (NULL: none), valid until the next call. Returns 0, or nonzero where it failed. */
typedef int (*route_fn)(int64_t layer, const float **weights, const int64_t **ids,
                        const float **gate);

/* One stretch of a linear layer's output rows run by one kernel (a fused layer whose parts are
   stored in types of different kernels has several). */
typedef struct {
    void *kernel;
    int64_t arity; /* weight tensors the kernel takes: 2 or 3 */
    const void *weights[3];
    const float *bias; /* NULL: none */
    int64_t out_features;
} Part;

#define MAX_PARTS 4

/* A linear layer's LoRA adapter slots (layers/lora.py's LoRASlots), or a = NULL: none. */
typedef struct {
    const float *a, *bt;
    const int32_t *ranks;
    const int64_t *starts;
    int64_t slots, max_rank, parts;
} Lora;

typedef struct {
    int64_t parts;
    Part part[MAX_PARTS];
    int64_t in_features, out_features;
    Lora lora;
} Linear;

/* A mixture-of-experts feed-forward (layers/moe.py's SparseMoeBlock): each token runs the
   top_k of its experts that the router picks, each expert a gate_up and a down linear layer. */
typedef struct {
    int64_t experts, top_k;
    const Linear *gate_up, *down; /* [experts] */
} Moe;

typedef struct {
    const float *input_norm, *post_norm;
    const float *q_norm, *k_norm; /* per-head RMSNorms of q and k (Qwen3), or NULL */
    /* gate_up and down: the dense MLP's, or beside experts their shared expert's (parts 0:
       none) */
    Linear qkv, o, gate_up, down;
    float *k_cache, *v_cache;
    int64_t kv_stride_h; /* of its caches (a sliding layer's pool may hold fewer blocks) */
    int64_t window; /* its attention window (0: full attention; else it reads the window_
                       slots and tables) */
    const Moe *moe; /* its experts, or NULL: a dense MLP */
} Layer;

typedef struct {
    void *rms_norm, *silu_mul, *rope, *store_kv, *attention, *lora_add;
    /* [tokens] each token's LoRA slot (-1: none), or NULL: no token has one */
    const int32_t *token_slots;
    int64_t layers, tokens, rows, hidden, heads, kv_heads, head_dim;
    float eps, scale;
    /* The caller's buffers. qk and attn, attention's input and output: q and k rotated
       (without q/k norms [tokens, heads + kv_heads, head_dim]; with them q [tokens, heads,
       head_dim], then k), and attention's output [tokens, heads, head_dim]. h [tokens, hidden]:
       a norm's output; big, act and scratch [tokens, wide] (wide: the widest input or output
       of a linear): the qkv projection and later gate_up, silu(gate) * up, and one part's
       columns of a linear. */
    float *qk, *attn, *h, *big, *act, *scratch;
    const float *cos_, *sin_; /* [tokens, head_dim] */
    const int64_t *slots;
    const int32_t *block_tables, *query_start, *seq_lens; /* of the step's `rows` rows */
    int64_t bt_stride, block_size, max_seq_len;
    /* The sliding layers' slots and tables (where their KV is in a pool of its own; else the
       same as slots and block_tables) */
    const int64_t *window_slots;
    const int32_t *window_block_tables;
    int64_t window_bt_stride;
    int64_t threads;
    /* Mixtures of experts (NULL without): the routers (a route_fn); expert_in and expert_out
       [tokens, hidden]: an expert's tokens gathered and its output; pair_tokens and
       pair_weights [tokens * top_k]: the step's (token, expert) pairs sorted by expert;
       expert_ends [experts]: where each expert's pairs end. */
    void *route;
    float *expert_in, *expert_out, *pair_weights;
    int64_t *pair_tokens, *expert_ends;
} Step;

static int run_part(const Part *p, const float *x, int64_t m, int64_t k, float *out,
                    int threads) {
    if (p->arity == 2)
        return ((linear2_fn)p->kernel)(x, m, k, p->weights[0], p->weights[1], p->out_features,
                                       p->bias, out, threads);
    return ((linear3_fn)p->kernel)(x, m, k, p->weights[0], p->weights[1], p->weights[2],
                                   p->out_features, p->bias, out, threads);
}

/* out [m, out_features] = x [m, in_features] @ W^T (+ bias); a part of several writes its
   columns through `scratch` [m, its out_features], as torch.cat of the parts would. */
static int run_matmul(const Linear *l, const float *x, int64_t m, float *out, float *scratch,
                      int threads) {
    if (l->parts == 1) return run_part(&l->part[0], x, m, l->in_features, out, threads);
    int64_t column = 0;
    for (int64_t i = 0; i < l->parts; i++) {
        const Part *p = &l->part[i];
        const int status = run_part(p, x, m, l->in_features, scratch, threads);
        if (status != 0) return status;
        for (int64_t r = 0; r < m; r++)
            memcpy(out + r * l->out_features + column, scratch + r * p->out_features,
                   sizeof(float) * p->out_features);
        column += p->out_features;
    }
    return 0;
}

/* The matmul, then each token's adapter update (the tokens of the step's slots). */
static int run_linear(const Step *s, const Linear *l, const float *x, float *out) {
    const int threads = (int)s->threads;
    const int status = run_matmul(l, x, s->tokens, out, s->scratch, threads);
    if (status == 0 && s->token_slots != NULL && l->lora.a != NULL)
        ((lora_add_fn)s->lora_add)(x, l->in_features, out, l->out_features, s->token_slots,
                                   s->tokens, l->lora.a, l->lora.bt, l->lora.ranks,
                                   l->lora.slots, l->lora.max_rank, l->lora.starts,
                                   l->lora.parts, l->in_features, l->out_features, threads);
    return status;
}

#define BAD_EXPERT (-100) /* a router's status: an expert index out of range */

/* The step's (token, expert) pairs sorted by expert, tokens ascending within one, as
   Experts.forward's stable argsort orders them: expert e's are those from e's predecessor's end
   to expert_ends[e]. */
static int sort_pairs(const Step *s, const Moe *moe, const float *weights, const int64_t *ids) {
    const int64_t pairs = s->tokens * moe->top_k;
    int64_t *ends = s->expert_ends;
    memset(ends, 0, sizeof(int64_t) * moe->experts);
    for (int64_t p = 0; p < pairs; p++) {
        if (ids[p] < 0 || ids[p] >= moe->experts) return BAD_EXPERT;
        ends[ids[p]]++;
    }
    int64_t start = 0;
    for (int64_t e = 0; e < moe->experts; e++) { /* each expert's start, then (filled) its end */
        const int64_t count = ends[e];
        ends[e] = start;
        start += count;
    }
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t at = ends[ids[p]]++;
        s->pair_tokens[at] = p / moe->top_k;
        s->pair_weights[at] = weights[p];
    }
    return 0;
}

/* The mixture of experts of layer `index` over the normed tokens h, into x: each expert with
   tokens runs them (its gate_up, silu(gate) * up, its down), and each token's outputs times
   their weights are added up in the order of the experts' indices, from zero (index_add_ over
   the sorted pairs); then the shared expert's output, times its gate, is added (as
   SparseMoeBlock.forward does). */
static int run_moe(const Step *s, int64_t index, const Layer *l, float *x) {
    const Moe *moe = l->moe;
    const int threads = (int)s->threads;
    const int64_t t = s->tokens, hidden = s->hidden;
    const silu_mul_fn silu_mul = (silu_mul_fn)s->silu_mul;
    const float *h = s->h, *weights, *gate;
    const int64_t *ids;
    int status = ((route_fn)s->route)(index, &weights, &ids, &gate);
    if (status || (status = sort_pairs(s, moe, weights, ids))) return status;
    memset(x, 0, sizeof(float) * t * hidden);
    for (int64_t e = 0; e < moe->experts; e++) {
        const int64_t start = e == 0 ? 0 : s->expert_ends[e - 1];
        const int64_t n = s->expert_ends[e] - start;
        if (n == 0) continue;
        const int64_t *tokens = s->pair_tokens + start;
        const float *in = h + tokens[0] * hidden;
        if (tokens[n - 1] - tokens[0] != n - 1) { /* not consecutive rows of h: gathered */
            for (int64_t i = 0; i < n; i++)
                memcpy(s->expert_in + i * hidden, h + tokens[i] * hidden, sizeof(float) * hidden);
            in = s->expert_in;
        }
        const Linear *gate_up = &moe->gate_up[e];
        const int64_t inter = gate_up->out_features / 2;
        if ((status = run_matmul(gate_up, in, n, s->big, s->scratch, threads))) return status;
        silu_mul(s->big, 2 * inter, s->act, n, inter, threads);
        if ((status = run_matmul(&moe->down[e], s->act, n, s->expert_out, s->scratch, threads)))
            return status;
        for (int64_t i = 0; i < n; i++) {
            const float w = s->pair_weights[start + i], *y = s->expert_out + i * hidden;
            float *out = x + tokens[i] * hidden;
            for (int64_t j = 0; j < hidden; j++) out[j] += y[j] * w;
        }
    }
    if (l->gate_up.parts == 0) return 0;
    const int64_t inter = l->gate_up.out_features / 2;
    if ((status = run_linear(s, &l->gate_up, h, s->big))) return status;
    silu_mul(s->big, 2 * inter, s->act, t, inter, threads);
    if ((status = run_linear(s, &l->down, s->act, s->expert_out))) return status;
    for (int64_t r = 0; r < t; r++) {
        const float *y = s->expert_out + r * hidden;
        float *out = x + r * hidden;
        if (gate == NULL) {
            for (int64_t j = 0; j < hidden; j++) out[j] += y[j];
        } else {
            for (int64_t j = 0; j < hidden; j++) out[j] += gate[r] * y[j];
        }
    }
    return 0;
}

/* x [tokens, hidden]: the embedded tokens in, the last layer's output out; residual: the residual
   stream the final norm adds x to. Returns 0, or the nonzero status of the kernel or router
   that failed. */
int decoder_step(const Step *s, const Layer *layers, float *x, float *residual) {
    const int threads = (int)s->threads;
    const int64_t t = s->tokens, hidden = s->hidden, d = s->head_dim;
    const int64_t q_size = s->heads * d, kv_size = s->kv_heads * d;
    const int64_t qk_heads = s->heads + s->kv_heads;
    float *qk = s->qk, *attn = s->attn, *h = s->h, *big = s->big, *act = s->act;
    int status = 0;
    const rms_norm_fn rms_norm = (rms_norm_fn)s->rms_norm;
    const rope_fn rope = (rope_fn)s->rope;
    for (int64_t i = 0; i < s->layers && status == 0; i++) {
        const Layer *l = &layers[i];
        if (i == 0) { /* the residual stream starts as the embeddings */
            rms_norm(x, hidden, NULL, 0, h, NULL, l->input_norm, t, hidden, s->eps, threads);
            memcpy(residual, x, sizeof(float) * t * hidden);
        } else {
            rms_norm(x, hidden, residual, hidden, h, residual, l->input_norm, t, hidden, s->eps,
                     threads);
        }
        float *qkv = big;
        const int64_t qkv_n = l->qkv.out_features;
        if ((status = run_linear(s, &l->qkv, h, qkv))) break;
        const float *q = qk, *k = qk + q_size;
        int64_t q_stride = qk_heads * d, k_stride = qk_heads * d;
        if (l->q_norm == NULL) {
            /* q's and k's heads side by side in the projection: one rotation, as the layer
               does */
            rope(qkv, qkv_n, d, qk, s->cos_, s->sin_, t, qk_heads, d, threads);
        } else {
            /* q's heads, then k's, as rows of d (copied out contiguous, as the layer's
               reshape does), normed, then rotated into q's place and k's */
            float *normed = attn, *rows = act;
            for (int64_t r = 0; r < t; r++)
                memcpy(rows + r * q_size, qkv + r * qkv_n, sizeof(float) * q_size);
            rms_norm(rows, d, NULL, 0, normed, NULL, l->q_norm, t * s->heads, d, s->eps,
                     threads);
            rope(normed, q_size, d, qk, s->cos_, s->sin_, t, s->heads, d, threads);
            for (int64_t r = 0; r < t; r++)
                memcpy(rows + r * kv_size, qkv + r * qkv_n + q_size, sizeof(float) * kv_size);
            rms_norm(rows, d, NULL, 0, normed, NULL, l->k_norm, t * s->kv_heads, d, s->eps,
                     threads);
            rope(normed, kv_size, d, qk + t * q_size, s->cos_, s->sin_, t, s->kv_heads, d,
                 threads);
            k = qk + t * q_size;
            q_stride = q_size;
            k_stride = kv_size;
        }
        const int sliding = l->window > 0;
        ((store_kv_fn)s->store_kv)(k, k_stride, d, qkv + q_size + kv_size, qkv_n, d, l->k_cache,
                                   l->v_cache, l->kv_stride_h,
                                   sliding ? s->window_slots : s->slots, t, s->kv_heads, d);
        status = ((attention_fn)s->attention)(
            q, q_stride, d, l->k_cache, l->v_cache, l->kv_stride_h,
            sliding ? s->window_block_tables : s->block_tables,
            sliding ? s->window_bt_stride : s->bt_stride, s->query_start, s->seq_lens, s->rows,
            s->heads, s->kv_heads, d, s->block_size, s->max_seq_len, l->window, s->scale, attn,
            q_size, d, threads, NULL);
        if (status) break;
        if ((status = run_linear(s, &l->o, attn, x))) break;
        rms_norm(x, hidden, residual, hidden, h, residual, l->post_norm, t, hidden, s->eps,
                 threads);
        if (l->moe != NULL) {
            status = run_moe(s, i, l, x);
            continue;
        }
        const int64_t inter = l->gate_up.out_features / 2;
        if ((status = run_linear(s, &l->gate_up, h, big))) break;
        ((silu_mul_fn)s->silu_mul)(big, 2 * inter, act, t, inter, threads);
        status = run_linear(s, &l->down, act, x);
    }
    return status;
}
