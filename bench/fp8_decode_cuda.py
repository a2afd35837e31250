"""A candidate FP8-cache decode kernel in CUDA on the tensor cores, beside the shipped Triton one.

Triton reads a float8 KV cache at ~2.5 TB/s on an H200 where it reads a bf16 one at ~3.9
(bench/RESULTS.md, session 15): its code moves the 8-bit loads into 16-bit tensor-core operands.
This kernel loads each thread's `mma.sync` m16n8k16 fragments straight from the cache and widens
them in registers (`__nv_cvt_fp8x2_to_halfraw2`), float16 products summed in float32:

- scores S = Q K^T a block of 16 tokens at a time: the group's query heads are the A operand's
  rows (padded to 16); a thread's B fragments are 32 bytes of one key (the dot's dimensions
  taken in the order the bytes lie, the query's fragments in the same order), so the keys stay
  in the shipped token-major layout;
- output O^T = V^T P^T: the probabilities are the B operand straight from the scores' C
  fragments, the values the A operand, read from a block layout of their own, per KV head
  [dims % 8][tokens / 4][dims / 16][(dims / 8) % 2][tokens % 4], so that a thread's 16 value
  fragments are 64 contiguous bytes (`values_layout` builds it from the shipped cache);
- a program per (row, KV head), 4 warps taking the row's blocks in turn, merged at the end.

Not used by the runtime: taking it in needs a CUDA build at first use, the values' layout in the
FP8 cache's writes and the prefill kernel, and key splits for few rows. Needs nvcc and ninja
(`torch.utils.cpp_extension`). Prints us a layer and TB/s of the cache's bytes beside Triton's;
writes JSON to $OUT (or bench/out).

    python3 bench/fp8_decode_cuda.py [--shapes qwen3-0.6b llama-3.1-8b] [--rows 256 128 64 16]
"""

from __future__ import annotations

import argparse
import itertools

import torch
from decode_attention import Case, contexts, tbs
from torch.utils.cpp_extension import load_inline
from triton.testing import do_bench

from inflight.bench.report import report_path, write_report

SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

// Two e4m3 values (the low 16 bits) as a float16 pair.
__device__ __forceinline__ uint32_t widen2(uint32_t pair) {
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(pair & 0xffff), __NV_E4M3);
    return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ uint32_t half2_of(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ void mma(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                    uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// grid (rows, KV heads), 4 warps; lane = 4 g + c. G: query heads a KV head.
template <int G>
__global__ void __launch_bounds__(128, 4) fp8_decode(
    const __nv_bfloat16* __restrict__ q, const uint8_t* __restrict__ k,
    const uint8_t* __restrict__ v, __nv_bfloat16* __restrict__ out,
    const int* __restrict__ tables, const int* __restrict__ lens, const int64_t* __restrict__ order,
    float scale_log2, int sqt, int sqh, int64_t skb, int sks, int skh, int64_t svb, int svh,
    int sbt, int sot, int soh) {
    const int row = (int)order[blockIdx.x], kvh = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int len = lens[row], blocks = (len + 15) >> 4;
    const int* table = tables + (int64_t)row * sbt;
    // Query fragments (scaled into log2 units): head g, dims 32 c + 4 j + {0, 1} and {2, 3}.
    uint32_t qa[8][2];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        qa[j][0] = qa[j][1] = 0u;
        if (g < G) {
            const __nv_bfloat16* p = q + (int64_t)row * sqt + (kvh * G + g) * sqh + 32 * c + 4 * j;
            float x[4];
            for (int e = 0; e < 4; e++) x[e] = __bfloat162float(p[e]) * scale_log2;
            qa[j][0] = half2_of(x[0], x[1]);
            qa[j][1] = half2_of(x[2], x[3]);
        }
    }
    // The keys of scores column g in the block's two 8-token tiles: tokens 4 (g / 2) + g % 2 and
    // 2 more, so that a thread's 4 scores (and probabilities) are tokens 4 c .. 4 c + 3.
    const int tok0 = 4 * (g >> 1) + (g & 1);
    const int64_t key0 = (int64_t)tok0 * sks + (int64_t)kvh * skh + 32 * c;
    const int64_t key1 = key0 + 2 * (int64_t)sks;
    const int64_t val = (int64_t)kvh * svh + (g * 4 + c) * 64;
    float o[8][4];  // O^T tiles: dims 16 t + g (+ 8), heads 2 c and 2 c + 1
#pragma unroll
    for (int t = 0; t < 8; t++) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f;
    float m = -INFINITY, l = 0.f;  // head g's running max and (this lane's part of the) sum
    for (int blk = warp; blk < blocks; blk += 4) {
        const int64_t at = (int64_t)table[blk];
        const uint8_t* kb = k + at * skb;
        const uint4* vb = reinterpret_cast<const uint4*>(v + at * svb + val);
        const uint4 ka = __ldg(reinterpret_cast<const uint4*>(kb + key0));
        const uint4 kc = __ldg(reinterpret_cast<const uint4*>(kb + key0 + 16));
        const uint4 kd = __ldg(reinterpret_cast<const uint4*>(kb + key1));
        const uint4 ke = __ldg(reinterpret_cast<const uint4*>(kb + key1 + 16));
        const uint4 v0 = __ldg(vb), v1 = __ldg(vb + 1), v2 = __ldg(vb + 2), v3 = __ldg(vb + 3);
        const uint32_t k0[8] = {ka.x, ka.y, ka.z, ka.w, kc.x, kc.y, kc.z, kc.w};
        const uint32_t k1[8] = {kd.x, kd.y, kd.z, kd.w, ke.x, ke.y, ke.z, ke.w};
        float s0[4] = {0.f, 0.f, 0.f, 0.f}, s1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < 8; j++) {
            mma(s0, qa[j][0], 0u, qa[j][1], 0u, widen2(k0[j]), widen2(k0[j] >> 16));
            mma(s1, qa[j][0], 0u, qa[j][1], 0u, widen2(k1[j]), widen2(k1[j] >> 16));
        }
        float s[4] = {s0[0], s0[1], s1[0], s1[1]};
        const int first = blk * 16 + 4 * c;
        uint32_t keep = 0xffffffffu;  // the value bytes of tokens past the row's end read as 0
#pragma unroll
        for (int b = 0; b < 4; b++)
            if (first + b >= len) {
                s[b] = -INFINITY;
                keep &= ~(0xffu << (8 * b));
            }
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
        const uint32_t vw[16] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w,
                                 v2.x, v2.y, v2.z, v2.w, v3.x, v3.y, v3.z, v3.w};
#pragma unroll
        for (int t = 0; t < 8; t++) {
            o[t][0] *= alpha_lo; o[t][1] *= alpha_hi; o[t][2] *= alpha_lo; o[t][3] *= alpha_hi;
            const uint32_t w0 = vw[2 * t] & keep, w1 = vw[2 * t + 1] & keep;
            mma(o[t], widen2(w0), widen2(w1), widen2(w0 >> 16), widen2(w1 >> 16), pb0, pb1);
        }
    }
    l += __shfl_xor_sync(0xffffffff, l, 1);
    l += __shfl_xor_sync(0xffffffff, l, 2);
    __shared__ float wm[4][8], wl[4][8], wo[4][G][128];
    if (c == 0 && g < G) {
        wm[warp][g] = m;
        wl[warp][g] = l;
    }
#pragma unroll
    for (int t = 0; t < 8; t++) {
        if (2 * c < G) {
            wo[warp][2 * c][16 * t + g] = o[t][0];
            wo[warp][2 * c][16 * t + g + 8] = o[t][2];
        }
        if (2 * c + 1 < G) {
            wo[warp][2 * c + 1][16 * t + g] = o[t][1];
            wo[warp][2 * c + 1][16 * t + g + 8] = o[t][3];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * 128; i += 128) {
        const int h = i / 128, d = i % 128;
        float top = -INFINITY, num = 0.f, den = 0.f;
        for (int w = 0; w < 4; w++) top = fmaxf(top, wm[w][h]);
        for (int w = 0; w < 4; w++) {
            const float weight = wm[w][h] == -INFINITY ? 0.f : exp2f(wm[w][h] - top);
            num += weight * wo[w][h][d];
            den += weight * wl[w][h];
        }
        const float o_hd = den > 0.f ? num / den : 0.f;  // a row of no keys: 0
        out[(int64_t)row * sot + (kvh * G + h) * soh + d] = __float2bfloat16(o_hd);
    }
}

void decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out,
            torch::Tensor tables, torch::Tensor lens, torch::Tensor order, double scale) {
    const int rows = order.size(0), kv_heads = k.size(2), group = q.size(1) / kv_heads;
    TORCH_CHECK(k.size(1) == 16 && k.size(3) == 128, "blocks of 16 tokens, heads of 128");
    const dim3 grid(rows, kv_heads);
    const auto stream = at::cuda::getCurrentCUDAStream();
#define LAUNCH(G) fp8_decode<G><<<grid, 128, 0, stream>>>(                                        \
        (const __nv_bfloat16*)q.data_ptr(), k.data_ptr<uint8_t>(), v.data_ptr<uint8_t>(),         \
        (__nv_bfloat16*)out.data_ptr(), tables.data_ptr<int>(), lens.data_ptr<int>(),             \
        order.data_ptr<int64_t>(), (float)(scale * 1.4426950408889634), q.stride(0), q.stride(1), \
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), tables.stride(0),        \
        out.stride(0), out.stride(1))
    if (group == 2) LAUNCH(2);
    else if (group == 4) LAUNCH(4);
    else TORCH_CHECK(false, "built for 2 or 4 query heads a KV head, not ", group);
}
"""

DECLARATION = (
    "void decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out, "
    "torch::Tensor tables, torch::Tensor lens, torch::Tensor order, double scale);"
)


def values_layout(v: torch.Tensor) -> torch.Tensor:
    """The shipped cache's values [blocks, 16 tokens, KV heads, 128] as the kernel reads them:
    [blocks, KV heads, 2,048 bytes], a block's bytes per head ordered [dims % 8][tokens / 4]
    [dims / 16][(dims / 8) % 2][tokens % 4]."""
    blocks, _, heads, _ = v.shape
    x = v.view(torch.uint8).view(blocks, 4, 4, heads, 8, 2, 8)  # tokens (4, 4), dims (8, 2, 8)
    return x.permute(0, 3, 6, 1, 4, 5, 2).contiguous().view(blocks, heads, 2048)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    parser.add_argument("--rows", nargs="+", type=int, default=[256, 128, 64, 16])
    args = parser.parse_args()
    kernel = load_inline(
        "inflight_fp8_decode_bench",
        cpp_sources=DECLARATION,
        cuda_sources=SOURCE,
        functions=["decode"],
        extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90", "--use_fast_math"],
    )
    results = []
    for shape, rows in itertools.product(args.shapes, args.rows):
        case = Case(shape, contexts(rows), torch.float8_e4m3fn, False)
        want = case.run(order=case.order).clone()
        triton_ms = do_bench(lambda case=case: case.run(order=case.order))
        keys, values = case.k.view(torch.uint8), values_layout(case.v)
        out = torch.empty_like(case.out)

        def cuda(case=case, keys=keys, values=values, out=out) -> None:
            kernel.decode(
                case.q, keys, values, out, case.block_tables, case.seq_lens, case.order,
                case.q.shape[-1] ** -0.5,
            )  # fmt: skip

        cuda()
        diff = ((out.float() - want.float()).norm() / want.float().norm()).item()
        cuda_ms = do_bench(cuda)
        entry = {
            "shape": shape, "rows": rows, "bytes": case.bytes, "triton_us": triton_ms * 1e3,
            "cuda_us": cuda_ms * 1e3, "triton_tbs": tbs(case, triton_ms),
            "cuda_tbs": tbs(case, cuda_ms), "rel_diff": diff,
        }  # fmt: skip
        print(
            f"{shape} rows {rows}: Triton {entry['triton_us']:.1f} us "
            f"({entry['triton_tbs']:.2f} TB/s), CUDA {entry['cuda_us']:.1f} us "
            f"({entry['cuda_tbs']:.2f} TB/s), output {diff:.1e} from Triton's",
            flush=True,
        )
        results.append(entry)
        del case
    path = report_path("fp8_decode_cuda.json")
    write_report(path, cases=results)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
