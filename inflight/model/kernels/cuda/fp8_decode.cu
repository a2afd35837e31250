// Decode attention over a float8 (e4m3) paged KV cache on the tensor cores (fp8_decode.py).
//
// The cache is the Triton backend's: [blocks, 16 tokens, KV heads, 128] bytes for keys and for
// values alike. A program takes one (row, KV head, part of the row's blocks); its 4 warps take
// the part's blocks in turn, 16 tokens at a time, and merge at the end. Each thread loads its
// `mma.sync` m16n8k16 operand fragments straight from the cache (128-bit loads) and widens the
// bytes in registers: Triton moves them through 16-bit tensor-core operands at ~2.5 TB/s of
// float8 bytes on an H200, where this reads ~3.2 (bench/RESULTS.md, session 15).
//
// - scores S = Q K^T: the group's query heads are A's rows (padded to 16); a thread's B
//   fragments are 32 bytes of one key, the dot's dimensions taken in the order the bytes lie
//   (the query's fragments in the same order). Column n of the block's two 8-token tiles is
//   token 4 (n / 2) + n % 2 (+ 2 in the second), so that thread (g, c) (lane 4 g + c) holds
//   head g's scores of tokens 4 c .. 4 c + 3.
// - output O^T = V^T P^T: those four probabilities are the B fragment as they lie; the values
//   are A, the product's k index running over the same tokens. Output tile t's rows g and
//   g + 8 are dimensions 16 g + t and 16 g + 8 + t, so a thread's A fragments of all 8 tiles
//   are bytes 16 g .. 16 g + 15 of its 4 tokens' values: four 128-bit loads, their bytes paired
//   token by token with byte permutes.
// Products in float16, sums in float32, the softmax in base 2.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <math_constants.h>
#include <stdint.h>

namespace {

constexpr int kWarps = 4;
constexpr int kBlockSize = 16;
constexpr int kHeadDim = 128;

// Two e4m3 values (the low 16 bits) as a float16 pair.
__device__ __forceinline__ uint32_t widen2(uint32_t pair) {
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(pair & 0xffff), __NV_E4M3);
    return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ uint32_t half2_of(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ uint32_t permute(uint32_t a, uint32_t b, uint32_t selector) {
    return __byte_perm(a, b, selector);
}

__device__ __forceinline__ void mma(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                    uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Dimension e (0..15) of two tokens' 16 value bytes (words a, b) as a pair: tokens in the low
// and high byte, the pair in the low 16 bits.
__device__ __forceinline__ void pair_up(const uint4& a, const uint4& b, uint32_t pairs[16]) {
    const uint32_t wa[4] = {a.x, a.y, a.z, a.w}, wb[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const uint32_t lo = permute(wa[j], wb[j], 0x5140), hi = permute(wa[j], wb[j], 0x7362);
        pairs[4 * j] = lo;
        pairs[4 * j + 1] = lo >> 16;
        pairs[4 * j + 2] = hi;
        pairs[4 * j + 3] = hi >> 16;
    }
}

struct Args {
    const __nv_bfloat16* q;
    const uint8_t* k;
    const uint8_t* v;
    __nv_bfloat16* out;
    float* parts;  // [rows, heads, splits, 128] unnormalized outputs where splits > 1
    float* stats;  // [rows, heads, splits, 2]: their running max (natural log) and sum
    const int* tables;
    const int* lens;
    const int64_t* order;  // the rows longest first, or null
    float scale_log2;
    int64_t sqt, sqh, skb, sks, skh, svb, svs, svh, sbt, sot, soh;
    int heads, splits;
};

// grid (KV heads, rows, splits), 4 warps. G: query heads a KV head (at most 8). A row's KV heads
// are neighbours in the launch order, so the programs reading a block's 16 tokens of every head
// run together: on an H200 8-20 % faster than rows first over blocks scattered through the cache,
// 1-2 % in the FP8 workload, whose rows hold mostly adjacent blocks (bench/RESULTS.md).
template <int G>
__global__ void __launch_bounds__(kWarps * 32, 4) fp8_decode(const Args a) {
    const int row = a.order ? (int)a.order[blockIdx.y] : (int)blockIdx.y;
    const int kvh = blockIdx.x, split = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int len = a.lens[row], blocks = (len + kBlockSize - 1) / kBlockSize;
    const int per = (blocks + a.splits - 1) / a.splits;
    const int first_block = split * per, end_block = min(blocks, first_block + per);
    const int* table = a.tables + (int64_t)row * a.sbt;
    // Query fragments (scaled into log2 units): head g, dims 32 c + 4 j + {0, 1} and {2, 3}.
    uint32_t qa[8][2];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        qa[j][0] = qa[j][1] = 0u;
        if (g < G) {
            const __nv_bfloat16* p = a.q + (int64_t)row * a.sqt + (kvh * G + g) * a.sqh + 32 * c + 4 * j;
            float x[4];
#pragma unroll
            for (int e = 0; e < 4; e++) x[e] = __bfloat162float(p[e]) * a.scale_log2;
            qa[j][0] = half2_of(x[0], x[1]);
            qa[j][1] = half2_of(x[2], x[3]);
        }
    }
    const int tok0 = 4 * (g >> 1) + (g & 1);
    const int64_t key0 = (int64_t)tok0 * a.sks + (int64_t)kvh * a.skh + 32 * c;
    const int64_t key1 = key0 + 2 * a.sks;
    const int64_t val0 = (int64_t)(4 * c) * a.svs + (int64_t)kvh * a.svh + 16 * g;
    float o[8][4];  // O^T tiles: dims 16 g + t and 16 g + 8 + t, heads 2 c and 2 c + 1
#pragma unroll
    for (int t = 0; t < 8; t++) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f;
    float m = -CUDART_INF_F, l = 0.f;  // head g's running max and (this lane's part of the) sum
    // Each block's cache index is read one iteration ahead, off the loads' critical path.
    int next = first_block + warp < end_block ? table[first_block + warp] : 0;
    for (int blk = first_block + warp; blk < end_block; blk += kWarps) {
        const int64_t at = (int64_t)next;
        if (blk + kWarps < end_block) next = table[blk + kWarps];
        const uint8_t* kb = a.k + at * a.skb;
        const uint8_t* vb = a.v + at * a.svb + val0;
        const uint4 ka = __ldg(reinterpret_cast<const uint4*>(kb + key0));
        const uint4 kc = __ldg(reinterpret_cast<const uint4*>(kb + key0 + 16));
        const uint4 kd = __ldg(reinterpret_cast<const uint4*>(kb + key1));
        const uint4 ke = __ldg(reinterpret_cast<const uint4*>(kb + key1 + 16));
        // This thread's 4 tokens' values (loaded whatever the row's length, which keeps the
        // loads unpredicated: 2-3 % faster on an H200); those past the row's end as 0 (their
        // probabilities are 0, but the bytes there may be a NaN's).
        const int first = blk * kBlockSize + 4 * c;
        uint4 vt[4];
#pragma unroll
        for (int i = 0; i < 4; i++) vt[i] = __ldg(reinterpret_cast<const uint4*>(vb + i * a.svs));
#pragma unroll
        for (int i = 0; i < 4; i++)
            if (first + i >= len) vt[i] = make_uint4(0u, 0u, 0u, 0u);
        const uint32_t k0[8] = {ka.x, ka.y, ka.z, ka.w, kc.x, kc.y, kc.z, kc.w};
        const uint32_t k1[8] = {kd.x, kd.y, kd.z, kd.w, ke.x, ke.y, ke.z, ke.w};
        float s0[4] = {0.f, 0.f, 0.f, 0.f}, s1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < 8; j++) {
            mma(s0, qa[j][0], 0u, qa[j][1], 0u, widen2(k0[j]), widen2(k0[j] >> 16));
            mma(s1, qa[j][0], 0u, qa[j][1], 0u, widen2(k1[j]), widen2(k1[j] >> 16));
        }
        float s[4] = {s0[0], s0[1], s1[0], s1[1]};
#pragma unroll
        for (int b = 0; b < 4; b++)
            if (first + b >= len) s[b] = -CUDART_INF_F;
        float top = fmaxf(fmaxf(s[0], s[1]), fmaxf(s[2], s[3]));
        top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, 1));
        top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, 2));
        const float m_new = fmaxf(m, top);
        const float alpha = exp2f(m - m_new);
        float p[4];
#pragma unroll
        for (int b = 0; b < 4; b++) p[b] = exp2f(s[b] - m_new);
        l = l * alpha + (p[0] + p[1] + p[2] + p[3]);
        m = m_new;
        const uint32_t pb0 = half2_of(p[0], p[1]), pb1 = half2_of(p[2], p[3]);
        const float alpha_lo = __shfl_sync(0xffffffff, alpha, 8 * c);
        const float alpha_hi = __shfl_sync(0xffffffff, alpha, 8 * c + 4);
        uint32_t v01[16], v23[16];
        pair_up(vt[0], vt[1], v01);
        pair_up(vt[2], vt[3], v23);
#pragma unroll
        for (int t = 0; t < 8; t++) {
            o[t][0] *= alpha_lo; o[t][1] *= alpha_hi; o[t][2] *= alpha_lo; o[t][3] *= alpha_hi;
            mma(o[t], widen2(v01[t]), widen2(v01[8 + t]), widen2(v23[t]), widen2(v23[8 + t]),
                pb0, pb1);
        }
    }
    l += __shfl_xor_sync(0xffffffff, l, 1);
    l += __shfl_xor_sync(0xffffffff, l, 2);
    __shared__ float wm[kWarps][8], wl[kWarps][8], wo[kWarps][G][kHeadDim];
    if (c == 0 && g < G) {
        wm[warp][g] = m;
        wl[warp][g] = l;
    }
#pragma unroll
    for (int t = 0; t < 8; t++) {
        if (2 * c < G) {
            wo[warp][2 * c][16 * g + t] = o[t][0];
            wo[warp][2 * c][16 * g + 8 + t] = o[t][2];
        }
        if (2 * c + 1 < G) {
            wo[warp][2 * c + 1][16 * g + t] = o[t][1];
            wo[warp][2 * c + 1][16 * g + 8 + t] = o[t][3];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * kHeadDim; i += kWarps * 32) {
        const int h = i / kHeadDim, d = i % kHeadDim, head = kvh * G + h;
        float top = -CUDART_INF_F, num = 0.f, den = 0.f;
        for (int w = 0; w < kWarps; w++) top = fmaxf(top, wm[w][h]);
        for (int w = 0; w < kWarps; w++) {
            const float weight = wm[w][h] == -CUDART_INF_F ? 0.f : exp2f(wm[w][h] - top);
            num += weight * wo[w][h][d];
            den += weight * wl[w][h];
        }
        if (a.splits == 1) {
            const float x = den > 0.f ? num / den : 0.f;  // a row of no keys: 0
            a.out[(int64_t)row * a.sot + head * a.soh + d] = __float2bfloat16(x);
        } else {
            // The part unnormalized, as the Triton decode kernel leaves it for its merge
            // kernel: the max in natural-log units (an empty part's -inf weighs 0 there).
            const int64_t at = ((int64_t)row * a.heads + head) * a.splits + split;
            a.parts[at * kHeadDim + d] = num;
            if (d == 0) {
                a.stats[at * 2] = top * 0.69314718055994531f;
                a.stats[at * 2 + 1] = den;
            }
        }
    }
}

}  // namespace

// Launch on `stream` (a cudaStream_t) over `rows` rows; returns the launch's cudaError_t.
extern "C" int fp8_decode_attention(
    const void* q, const void* k, const void* v, void* out, void* parts, void* stats,
    const void* tables, const void* lens, const void* order, int rows, int kv_heads, int group,
    int splits, float scale, int64_t sqt, int64_t sqh, int64_t skb, int64_t sks, int64_t skh,
    int64_t svb, int64_t svs, int64_t svh, int64_t sbt, int64_t sot, int64_t soh, void* stream) {
    const Args a{(const __nv_bfloat16*)q, (const uint8_t*)k, (const uint8_t*)v,
                 (__nv_bfloat16*)out, (float*)parts, (float*)stats, (const int*)tables,
                 (const int*)lens, (const int64_t*)order, scale * 1.4426950408889634f,
                 sqt, sqh, skb, sks, skh, svb, svs, svh, sbt, sot, soh, group * kv_heads, splits};
    const dim3 grid(kv_heads, rows, splits);
    cudaStream_t s = (cudaStream_t)stream;
    switch (group) {
        case 1: fp8_decode<1><<<grid, kWarps * 32, 0, s>>>(a); break;
        case 2: fp8_decode<2><<<grid, kWarps * 32, 0, s>>>(a); break;
        case 4: fp8_decode<4><<<grid, kWarps * 32, 0, s>>>(a); break;
        case 8: fp8_decode<8><<<grid, kWarps * 32, 0, s>>>(a); break;
        default: return (int)cudaErrorInvalidValue;
    }
    return (int)cudaGetLastError();
}
