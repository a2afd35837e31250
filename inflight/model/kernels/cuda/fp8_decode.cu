// Decode attention over a float8 (e4m3) paged KV cache on the tensor cores (fp8_decode.py).
//
// The cache is the Triton backend's: [blocks, 16 tokens, KV heads, 128] bytes for keys and for
// values alike. A program takes one (row, KV head, part of the row's blocks); its 4 warps take
// the part's blocks in turn, 16 tokens at a time, and merge at the end. Each thread takes its
// `mma.sync` m16n8k16 operand fragments in 128-bit words and widens the bytes in registers:
// Triton moves them through 16-bit tensor-core operands at ~2.5 TB/s of float8 bytes on an
// H200, where this reads ~3.2 (bench/RESULTS.md, session 15). The words come
// - on Hopper and later (`fp8_decode_tma`), from shared memory that the tensor memory
//   accelerator fills: each warp keeps its next kStages blocks in flight, a block's 16 key rows
//   and 16 value rows of its KV head two 2D copies (16 x 128 bytes, 128-byte swizzled) on one
//   mbarrier, so that the loads in flight cost no registers (bench/RESULTS.md, session 33);
// - before Hopper, or over a cache whose blocks are not 16 evenly spaced rows
//   (`fp8_decode_ldg`), straight from the cache, one block a warp at a time.
// Both give the same bits (bench/gpu_check.py "fp8 decode"). The products:
// - scores S^T = K Q^T: the block's 16 keys are A's rows, the group's query heads B's 8 columns
//   (those past the group zero). A thread's A fragments are 32 bytes of each of two keys, the
//   dot's dimensions taken in the order the bytes lie (the query's fragments in the same order).
//   Row r of the tile is token 4 (r / 2) + r % 2 (+ 2 from row 8 on), so that thread (g, c)
//   (lane 4 g + c) holds heads 2 c and 2 c + 1's scores of tokens 4 (g / 2) + g % 2 and + 2.
//   (With the heads as A's rows instead, padded from at most 8 to 16, half of each product and
//   the padding's zero registers were wasted: the TMA loop 321 -> 285 instructions.)
// - output O^T = V^T P^T: the probabilities are B, their two 8 x 8 tiles transposed in registers
//   (`movmatrix`) so that thread (g, c) holds head g's of tokens 4 c .. 4 c + 3; the values are
//   A, the product's k index running over the same tokens. Output tile t's rows g and g + 8 are
//   dimensions 16 g + t and 16 g + 8 + t, its columns 2 c and 2 c + 1 the heads whose maxima
//   the thread holds, so a thread's A fragments of all 8 tiles are bytes 16 g .. 16 g + 15 of
//   its 4 tokens' values: four 128-bit loads, their bytes paired token by token with byte
//   permutes.
// Products in float16, sums in float32, the softmax in base 2.

#include <cuda.h>
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
// How far (log2 units) a block's maximum may pass the running one before the state is rescaled.
constexpr float kSlack = 8.f;

// Two e4m3 values as a float16 pair.
__device__ __forceinline__ uint32_t widen2(uint16_t pair) {
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)pair, __NV_E4M3);
    return *reinterpret_cast<uint32_t*>(&h);
}

// A word's two 16-bit halves, split as registers' halves rather than shifted: the widening then
// reads the high half in place (on sm_90 its conversion takes the register's upper half, where
// a shift cost one more instruction for every other pair: the TMA loop 354 -> 322 instructions,
// as fast on an H100, whose HBM bounds it; bench/RESULTS.md, session 35).
__device__ __forceinline__ void halves(uint32_t word, uint16_t& lo, uint16_t& hi) {
    asm("mov.b32 {%0, %1}, %2;" : "=h"(lo), "=h"(hi) : "r"(word));
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
// and high byte.
__device__ __forceinline__ void pair_up(const uint4& a, const uint4& b, uint16_t pairs[16]) {
    const uint32_t wa[4] = {a.x, a.y, a.z, a.w}, wb[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        halves(permute(wa[j], wb[j], 0x5140), pairs[4 * j], pairs[4 * j + 1]);
        halves(permute(wa[j], wb[j], 0x7362), pairs[4 * j + 2], pairs[4 * j + 3]);
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

// A program's row, KV head and part of the row's blocks [first, end).
struct Work {
    int row, kvh, split, len, first, end;
};

__device__ __forceinline__ Work work_of(const Args& a) {
    Work w;
    w.row = a.order ? (int)a.order[blockIdx.y] : (int)blockIdx.y;
    w.kvh = blockIdx.x;
    w.split = blockIdx.z;
    w.len = a.lens[w.row];
    const int blocks = (w.len + kBlockSize - 1) / kBlockSize;
    const int per = (blocks + a.splits - 1) / a.splits;
    w.first = w.split * per;
    w.end = min(blocks, w.first + per);
    return w;
}

// The query as B fragments (scaled into log2 units): head g, dims 32 c + 4 j + {0, 1} and
// {2, 3}. A thread's 32 dims are 64 contiguous bytes, read as four 16-byte words (`serves`
// requires the alignment): as 32 two-byte loads they cost as many L1 wavefronts as a program's
// key and value reads, and the kernel grew slower with the group (bench/RESULTS.md, session 35).
template <int G>
__device__ __forceinline__ void load_query(const Args& a, const Work& w, int g, int c, uint32_t qb[8][2]) {
    uint4 words[4];
#pragma unroll
    for (int k = 0; k < 4; k++) words[k] = make_uint4(0u, 0u, 0u, 0u);
    if (g < G) {
        const uint4* p = reinterpret_cast<const uint4*>(
            a.q + (int64_t)w.row * a.sqt + (w.kvh * G + g) * a.sqh + 32 * c);
#pragma unroll
        for (int k = 0; k < 4; k++) words[k] = __ldg(p + k);
    }
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const uint4& word = words[j / 2];
        const uint32_t lo = j % 2 ? word.z : word.x, hi = j % 2 ? word.w : word.y;
        // A bfloat16's bits are a float32's upper half.
        const float x[4] = {__uint_as_float(lo << 16), __uint_as_float(lo & 0xffff0000u),
                            __uint_as_float(hi << 16), __uint_as_float(hi & 0xffff0000u)};
        qb[j][0] = half2_of(x[0] * a.scale_log2, x[1] * a.scale_log2);
        qb[j][1] = half2_of(x[2] * a.scale_log2, x[3] * a.scale_log2);
    }
}

// A warp's running state over its blocks: heads 2 c and 2 c + 1's max and (this lane's part of
// the) sum, and the O^T tiles (dims 16 g + t and 16 g + 8 + t, the same heads).
struct Running {
    float m[2], l[2];
    float o[8][4];
};

// An 8 x 8 matrix of 16-bit values, a lane's word being row lane / 4, columns 2 (lane % 4) and
// + 1 (an mma fragment's layout), transposed.
__device__ __forceinline__ uint32_t transpose(uint32_t x) {
    uint32_t y;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
    return y;
}

// One block of 16 tokens into the running state. ka, kc: bytes 32 c .. 32 c + 31 of token
// 4 (g / 2) + g % 2's key; kd, ke: the same of the token 2 on. vt[i]: bytes 16 g .. 16 g + 15 of
// token 4 c + i's value. `base`: the block's first token index; `tail`: whether the block may hold
// tokens past the row's end, masked.
template <bool tail>
__device__ __forceinline__ void attend_block(const uint32_t qb[8][2], const uint4& ka,
                                             const uint4& kc, const uint4& kd, const uint4& ke,
                                             uint4 vt[4], int base, int len, int g, int c,
                                             Running& r) {
    // Values past the row's end as 0 (their probabilities are 0, but the bytes there may be a
    // NaN's).
    if (tail) {
#pragma unroll
        for (int i = 0; i < 4; i++)
            if (base + 4 * c + i >= len) vt[i] = make_uint4(0u, 0u, 0u, 0u);
    }
    const uint32_t k0[8] = {ka.x, ka.y, ka.z, ka.w, kc.x, kc.y, kc.z, kc.w};
    const uint32_t k1[8] = {kd.x, kd.y, kd.z, kd.w, ke.x, ke.y, ke.z, ke.w};
    // s: heads 2 c, 2 c + 1 of the first token, then of the second.
    float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 8; j++) {
        uint16_t a0, a1, b0, b1;
        halves(k0[j], a0, a1);
        halves(k1[j], b0, b1);
        mma(s, widen2(a0), widen2(b0), widen2(a1), widen2(b1), qb[j][0], qb[j][1]);
    }
    if (tail) {
        const int token = base + 4 * (g >> 1) + (g & 1);
        if (token >= len) s[0] = s[1] = -CUDART_INF_F;
        if (token + 2 >= len) s[2] = s[3] = -CUDART_INF_F;
    }
    // Each head's maximum over the block: its column is the 8 lanes of one c.
    float top0 = fmaxf(s[0], s[2]), top1 = fmaxf(s[1], s[3]);
#pragma unroll
    for (int x = 4; x < 32; x *= 2) {
        top0 = fmaxf(top0, __shfl_xor_sync(0xffffffff, top0, x));
        top1 = fmaxf(top1, __shfl_xor_sync(0xffffffff, top1, x));
    }
    // The running maxima move only where a block's passes one by more than kSlack, as in
    // FlashAttention-3: until then the probabilities are taken against the old maximum (at most
    // 2^kSlack, far inside float16's range) and the outputs are not rescaled, which most blocks
    // past a row's first need not be. A branch the warp takes together.
    if (__any_sync(0xffffffff, top0 > r.m[0] + kSlack || top1 > r.m[1] + kSlack)) {
        const float m0 = fmaxf(r.m[0], top0), m1 = fmaxf(r.m[1], top1);
        const float alpha0 = exp2f(r.m[0] - m0), alpha1 = exp2f(r.m[1] - m1);
        r.l[0] *= alpha0;
        r.l[1] *= alpha1;
#pragma unroll
        for (int t = 0; t < 8; t++) {
            r.o[t][0] *= alpha0; r.o[t][1] *= alpha1; r.o[t][2] *= alpha0; r.o[t][3] *= alpha1;
        }
        r.m[0] = m0;
        r.m[1] = m1;
    }
    const float p[4] = {exp2f(s[0] - r.m[0]), exp2f(s[1] - r.m[1]), exp2f(s[2] - r.m[0]),
                        exp2f(s[3] - r.m[1])};
    r.l[0] += p[0] + p[2];
    r.l[1] += p[1] + p[3];
    // P^T's B fragments: the probabilities' two tiles (tokens by heads) transposed, which gives
    // thread (g, c) head g's probabilities of tokens 4 c .. 4 c + 3.
    const uint32_t pb0 = transpose(half2_of(p[0], p[1])), pb1 = transpose(half2_of(p[2], p[3]));
    uint16_t v01[16], v23[16];
    pair_up(vt[0], vt[1], v01);
    pair_up(vt[2], vt[3], v23);
#pragma unroll
    for (int t = 0; t < 8; t++)
        mma(r.o[t], widen2(v01[t]), widen2(v01[8 + t]), widen2(v23[t]), widen2(v23[8 + t]),
            pb0, pb1);
}

// A block through the masked math only where it is the row's last: the masks cost every block
// ~20 instructions of the TMA loop's ~250, a branch the warp takes together costs two.
__device__ __forceinline__ void attend(const uint32_t qb[8][2], const uint4& ka, const uint4& kc,
                                       const uint4& kd, const uint4& ke, uint4 vt[4], int base,
                                       int len, int g, int c, Running& r) {
    if (base + kBlockSize > len)
        attend_block<true>(qb, ka, kc, kd, ke, vt, base, len, g, c, r);
    else
        attend_block<false>(qb, ka, kc, kd, ke, vt, base, len, g, c, r);
}

__device__ __forceinline__ void start(Running& r) {
    r.m[0] = r.m[1] = -CUDART_INF_F;
    r.l[0] = r.l[1] = 0.f;
#pragma unroll
    for (int t = 0; t < 8; t++) r.o[t][0] = r.o[t][1] = r.o[t][2] = r.o[t][3] = 0.f;
}

// A warp's output tiles in shared memory for the merge: head h's dimension d at
// tile_at(h, d). The gaps (one float every 16 dims, 8 a head) put the 8 dims 16 g + t that a
// warp's lanes write at once, for two heads, in 16 different banks: unpadded, G = 4 wrote with
// 8-way bank conflicts.
constexpr int kTileStride = kHeadDim + 8;

__device__ __forceinline__ int tile_at(int h, int d) { return h * kTileStride + d + (d >> 4); }

// The warps' states merged into the program's output: each warp's tiles into wo (warp w's
// G x kTileStride floats at wo + w * wo_stride), then every output element summed over the
// warps.
template <int G>
__device__ __forceinline__ void finish(const Args& a, const Work& w, Running& r, float* wo,
                                       int wo_stride, float (*wm)[8], float (*wl)[8]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int x = 4; x < 32; x *= 2) {
        r.l[0] += __shfl_xor_sync(0xffffffff, r.l[0], x);
        r.l[1] += __shfl_xor_sync(0xffffffff, r.l[1], x);
    }
    if (g == 0) {
        for (int i = 0; i < 2; i++)
            if (2 * c + i < G) {
                wm[warp][2 * c + i] = r.m[i];
                wl[warp][2 * c + i] = r.l[i];
            }
    }
    float* mine = wo + warp * wo_stride;
#pragma unroll
    for (int t = 0; t < 8; t++) {
        if (2 * c < G) {
            mine[tile_at(2 * c, 16 * g + t)] = r.o[t][0];
            mine[tile_at(2 * c, 16 * g + 8 + t)] = r.o[t][2];
        }
        if (2 * c + 1 < G) {
            mine[tile_at(2 * c + 1, 16 * g + t)] = r.o[t][1];
            mine[tile_at(2 * c + 1, 16 * g + 8 + t)] = r.o[t][3];
        }
    }
    __syncthreads();
    // A thread a dimension, of every head.
    static_assert(kWarps * 32 == kHeadDim, "the merge takes a thread a dimension");
    const int d = threadIdx.x;
#pragma unroll
    for (int h = 0; h < G; h++) {
        const int head = w.kvh * G + h;
        float top = -CUDART_INF_F, num = 0.f, den = 0.f;
        for (int v = 0; v < kWarps; v++) top = fmaxf(top, wm[v][h]);
        for (int v = 0; v < kWarps; v++) {
            const float weight = wm[v][h] == -CUDART_INF_F ? 0.f : exp2f(wm[v][h] - top);
            num += weight * wo[v * wo_stride + tile_at(h, d)];
            den += weight * wl[v][h];
        }
        if (a.splits == 1) {
            const float x = den > 0.f ? num / den : 0.f;  // a row of no keys: 0
            a.out[(int64_t)w.row * a.sot + head * a.soh + d] = __float2bfloat16(x);
        } else {
            // The part unnormalized, as the Triton decode kernel leaves it for its merge
            // kernel: the max in natural-log units (an empty part's -inf weighs 0 there).
            const int64_t at = ((int64_t)w.row * a.heads + head) * a.splits + w.split;
            a.parts[at * kHeadDim + d] = num;
            if (d == 0) {
                a.stats[at * 2] = top * 0.69314718055994531f;
                a.stats[at * 2 + 1] = den;
            }
        }
    }
}

// grid (KV heads, rows, splits), 4 warps. G: query heads a KV head (at most 8). A row's KV heads
// are neighbours in the launch order, so the programs reading a block's 16 tokens of every head
// run together: on an H200 8-20 % faster than rows first over blocks scattered through the cache,
// 1-2 % in the FP8 workload, whose rows hold mostly adjacent blocks (bench/RESULTS.md).
template <int G>
__global__ void __launch_bounds__(kWarps * 32, 4) fp8_decode_ldg(const Args a) {
    const Work w = work_of(a);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int* table = a.tables + (int64_t)w.row * a.sbt;
    uint32_t qb[8][2];
    load_query<G>(a, w, g, c, qb);
    const int tok0 = 4 * (g >> 1) + (g & 1);
    const int64_t key0 = (int64_t)tok0 * a.sks + (int64_t)w.kvh * a.skh + 32 * c;
    const int64_t key1 = key0 + 2 * a.sks;
    const int64_t val0 = (int64_t)(4 * c) * a.svs + (int64_t)w.kvh * a.svh + 16 * g;
    Running r;
    start(r);
    // Each block's cache index is read one iteration ahead, off the loads' critical path.
    int next = w.first + warp < w.end ? table[w.first + warp] : 0;
    for (int blk = w.first + warp; blk < w.end; blk += kWarps) {
        const int64_t at = (int64_t)next;
        if (blk + kWarps < w.end) next = table[blk + kWarps];
        const uint8_t* kb = a.k + at * a.skb;
        const uint8_t* vb = a.v + at * a.svb + val0;
        const uint4 ka = __ldg(reinterpret_cast<const uint4*>(kb + key0));
        const uint4 kc = __ldg(reinterpret_cast<const uint4*>(kb + key0 + 16));
        const uint4 kd = __ldg(reinterpret_cast<const uint4*>(kb + key1));
        const uint4 ke = __ldg(reinterpret_cast<const uint4*>(kb + key1 + 16));
        // Loaded whatever the row's length, which keeps the loads unpredicated: 2-3 % faster on
        // an H200.
        uint4 vt[4];
#pragma unroll
        for (int i = 0; i < 4; i++) vt[i] = __ldg(reinterpret_cast<const uint4*>(vb + i * a.svs));
        attend(qb, ka, kc, kd, ke, vt, blk * kBlockSize, w.len, g, c, r);
    }
    __shared__ float wm[kWarps][8], wl[kWarps][8], wo[kWarps * G * kTileStride];
    finish<G>(a, w, r, wo, G * kTileStride, wm, wl);
}

// Hopper's copy engine and barriers, and the kernel that uses them: compiled where the library
// is built for compute capability 9.0 or later (`fp8_decode.py` builds it for the one GPU it
// runs on, so the host's and the device's passes agree).
#if defined(__CUDA_ARCH_LIST__) && __CUDA_ARCH_LIST__ >= 900
#define INFLIGHT_TMA 1

// Blocks a warp keeps in flight on the TMA path: 2 beat 3 and 4 on an H100 (bench/RESULTS.md,
// session 33).
constexpr int kStages = 2;
constexpr int kStageBytes = 2 * kBlockSize * kHeadDim;  // a block's keys, then its values
// The dynamic shared memory of a TMA program: its warps' stages, 1024-byte aligned (the
// swizzle's period).
constexpr int kTmaShared = kWarps * kStages * kStageBytes + 1024;

__device__ __forceinline__ uint32_t shared_address(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void barrier_init(uint64_t* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(bar)));
}

__device__ __forceinline__ void barrier_expect(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)),
                 "r"(bytes) : "memory");
}

__device__ __forceinline__ void barrier_wait(uint64_t* bar, uint32_t parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" ::"r"(shared_address(bar)), "r"(parity) : "memory");
}

// 16 rows x 128 bytes at (x bytes, row y) of the tensor `map` describes, into `dst`.
__device__ __forceinline__ void copy_box(void* dst, const CUtensorMap* map, int x, int y, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(shared_address(dst)), "l"(map), "r"(x), "r"(y), "r"(shared_address(bar)) : "memory");
}

// Byte offset of 16-byte word q of row r in a 128-byte-swizzled box of 128-byte rows.
__device__ __forceinline__ int swizzled(int r, int q) { return r * 128 + ((q ^ (r & 7)) << 4); }

// As fp8_decode_ldg, the blocks through shared memory. `keys`, `values`: the caches as 2D
// tensors of 128-byte rows (a token's KV heads side by side, the blocks' tokens one after
// another), boxes of 16 x 128 bytes.
template <int G>
__global__ void __launch_bounds__(kWarps * 32, 4)
    fp8_decode_tma(const Args a, const __grid_constant__ CUtensorMap keys,
                   const __grid_constant__ CUtensorMap values) {
    extern __shared__ uint8_t shared[];
    __shared__ __align__(8) uint64_t bars[kWarps][kStages];
    __shared__ float wm[kWarps][8], wl[kWarps][8];
    const Work w = work_of(a);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    // Aligned by an offset from `shared`, not through an integer: so the compiler still knows
    // every pointer below as shared memory and reads it with LDS (through a uintptr_t it read
    // the stages with generic 64-bit loads).
    const uint32_t base = shared_address(shared);
    uint8_t* aligned = shared + (((base + 1023u) & ~1023u) - base);
    uint8_t* stages = aligned + warp * kStages * kStageBytes;
    uint64_t* bar = bars[warp];
    if (lane == 0) {
#pragma unroll
        for (int s = 0; s < kStages; s++) barrier_init(&bar[s]);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncwarp();
    const int* table = a.tables + (int64_t)w.row * a.sbt;
    auto fill = [&](int s, int at) {
        if (lane == 0) {
            barrier_expect(&bar[s], kStageBytes);
            copy_box(stages + s * kStageBytes, &keys, w.kvh * kHeadDim, at * kBlockSize, &bar[s]);
            copy_box(stages + s * kStageBytes + kStageBytes / 2, &values, w.kvh * kHeadDim,
                     at * kBlockSize, &bar[s]);
        }
    };
    {
        int at[kStages];
#pragma unroll
        for (int s = 0; s < kStages; s++) {
            const int blk = w.first + warp + s * kWarps;
            at[s] = blk < w.end ? table[blk] : 0;
        }
#pragma unroll
        for (int s = 0; s < kStages; s++)
            if (w.first + warp + s * kWarps < w.end) fill(s, at[s]);
    }
    uint32_t qb[8][2];
    load_query<G>(a, w, g, c, qb);
    const int tok0 = 4 * (g >> 1) + (g & 1);
    // Where a thread's words lie in a stage, as two offsets: tok0 % 8 is 0, 1, 4 or 5, so row
    // tok0 + 2 swizzles with word index bit 1 flipped; 4 c % 8 is 0 or 4, so row 4 c + i with
    // bits i. Key words 2 c, 2 c + 1 of rows tok0, tok0 + 2 are `key` with 16, 32, 48 flipped
    // (+ 256 for the row), value word g of row 4 c + i `value` with 16 i flipped (+ 128 i): eight
    // offsets held apart spilled registers once the stages were read as shared memory.
    const int key = swizzled(tok0, 2 * c), value = swizzled(4 * c, g);
    Running r;
    start(r);
    // The cache index of the block a stage is refilled with, read an iteration ahead.
    const int ahead = w.first + warp + kStages * kWarps;
    int refill_at = ahead < w.end ? table[ahead] : 0;
    int s = 0;
    uint32_t parity = 0;
    for (int blk = w.first + warp; blk < w.end; blk += kWarps) {
        barrier_wait(&bar[s], parity);
        const uint8_t* kb = stages + s * kStageBytes;
        const uint8_t* vb = kb + kStageBytes / 2;
        const uint4 ka = *reinterpret_cast<const uint4*>(kb + key);
        const uint4 kc = *reinterpret_cast<const uint4*>(kb + (key ^ 16));
        const uint4 kd = *reinterpret_cast<const uint4*>(kb + (key ^ 32) + 256);
        const uint4 ke = *reinterpret_cast<const uint4*>(kb + (key ^ 48) + 256);
        uint4 vt[4];
#pragma unroll
        for (int i = 0; i < 4; i++)
            vt[i] = *reinterpret_cast<const uint4*>(vb + (value ^ (16 * i)) + 128 * i);
        // The stage's words are in registers: once every lane is past its reads, the copy engine
        // may write the block kStages on into it while the warp computes on this one (on an H200
        // 1-3 % faster than refilling after the math; within 1 % on an H100: bench/RESULTS.md).
        __syncwarp();
        const int refill = blk + kStages * kWarps;
        if (refill < w.end) {
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            fill(s, refill_at);
            if (refill + kWarps < w.end) refill_at = table[refill + kWarps];
        }
        attend(qb, ka, kc, kd, ke, vt, blk * kBlockSize, w.len, g, c, r);
        if (++s == kStages) {
            s = 0;
            parity ^= 1;
        }
    }
    // Each warp's tiles over its own stages, drained by now.
    finish<G>(a, w, r, reinterpret_cast<float*>(aligned), kStages * kStageBytes / 4, wm, wl);
}

// cuTensorMapEncodeTiled, from the driver the runtime has loaded (no link to libcuda).
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                 const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                 const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiled encode_tiled() {
    static EncodeTiled encode = [] {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                             &found) != cudaSuccess)
            fn = nullptr;
#else
        if (cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found) != cudaSuccess)
            fn = nullptr;
#endif
        return found == cudaDriverEntryPointSuccess ? reinterpret_cast<EncodeTiled>(fn) : nullptr;
    }();
    return encode;
}

// A cache [blocks, 16, KV heads, 128] whose token rows are `row_stride` bytes apart as `map`:
// rows of KV heads x 128 bytes, boxes of a block's 16 rows of one head. False where the driver
// refuses it.
bool cache_map(CUtensorMap* map, const void* cache, int kv_heads, int blocks, int64_t row_stride) {
    const EncodeTiled encode = encode_tiled();
    if (!encode) return false;
    const cuuint64_t dims[2] = {(cuuint64_t)kv_heads * kHeadDim, (cuuint64_t)blocks * kBlockSize};
    const cuuint64_t strides[1] = {(cuuint64_t)row_stride};
    const cuuint32_t box[2] = {kHeadDim, kBlockSize};
    const cuuint32_t steps[2] = {1, 1};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(cache), dims, strides,
                  box, steps, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}
#endif  // INFLIGHT_TMA

// The TMA kernel where it is built and `tma` asks for it (the boxes need a block's 16 token rows
// evenly spaced and a head's 128 bytes in a row, and the driver must describe both caches), else
// the direct loads.
template <int G>
void launch(const Args& a, dim3 grid, cudaStream_t stream, bool tma, int kv_heads, int blocks) {
#ifdef INFLIGHT_TMA
    CUtensorMap keys, values;
    if (tma && a.skb == kBlockSize * a.sks && a.svb == kBlockSize * a.svs && a.skh == kHeadDim &&
        a.svh == kHeadDim && cache_map(&keys, a.k, kv_heads, blocks, a.sks) &&
        cache_map(&values, a.v, kv_heads, blocks, a.svs)) {
        fp8_decode_tma<G><<<grid, kWarps * 32, kTmaShared, stream>>>(a, keys, values);
        return;
    }
#endif
    fp8_decode_ldg<G><<<grid, kWarps * 32, 0, stream>>>(a);
}

}  // namespace

// Launch on `stream` (a cudaStream_t) over `rows` rows of a cache of `blocks` blocks; `tma`: the
// TMA kernel where the library has it and the cache allows it. Returns the launch's cudaError_t.
extern "C" int fp8_decode_attention(
    const void* q, const void* k, const void* v, void* out, void* parts, void* stats,
    const void* tables, const void* lens, const void* order, int rows, int kv_heads, int group,
    int splits, float scale, int64_t sqt, int64_t sqh, int64_t skb, int64_t sks, int64_t skh,
    int64_t svb, int64_t svs, int64_t svh, int64_t sbt, int64_t sot, int64_t soh, int blocks,
    int tma, void* stream) {
    const Args a{(const __nv_bfloat16*)q, (const uint8_t*)k, (const uint8_t*)v,
                 (__nv_bfloat16*)out, (float*)parts, (float*)stats, (const int*)tables,
                 (const int*)lens, (const int64_t*)order, scale * 1.4426950408889634f,
                 sqt, sqh, skb, sks, skh, svb, svs, svh, sbt, sot, soh, group * kv_heads, splits};
    const dim3 grid(kv_heads, rows, splits);
    cudaStream_t s = (cudaStream_t)stream;
    const bool t = tma != 0;
    switch (group) {
        case 1: launch<1>(a, grid, s, t, kv_heads, blocks); break;
        case 2: launch<2>(a, grid, s, t, kv_heads, blocks); break;
        case 4: launch<4>(a, grid, s, t, kv_heads, blocks); break;
        case 8: launch<8>(a, grid, s, t, kv_heads, blocks); break;
        default: return (int)cudaErrorInvalidValue;
    }
    return (int)cudaGetLastError();
}
