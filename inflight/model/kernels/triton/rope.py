"""A fused projection's q, k and v to attention's inputs in one kernel: the per-head RMSNorm of
q and k (Qwen3), RoPE on both, q written out and k, v stored at their KV slots.

In torch that is some fourteen small kernels per layer (two norms, for q and for k a negate, a
cat, two products and a sum, two index copies), which in a decode step cost more than the
layer's matmuls. Precision follows the torch modules where they round: the norm's output is
rounded to the activation dtype before RoPE; the rotation itself is computed in float32 and
rounded once, to the cache's dtype for keys (torch rounds each product and the sum: at most an
ulp apart).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _to_cache(x, CACHE, CACHE_MAX: tl.constexpr):
    """x in the cache's dtype; a float8 cache (CACHE_MAX > 0) takes it clamped to its range."""
    if CACHE_MAX > 0:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -CACHE_MAX), CACHE_MAX)
    return x.to(CACHE.dtype.element_ty)


# Tokens per program. One token a program (a head of 64 values for 128 threads) left a prefill
# of 8,192 tokens at ~200 us a layer, mostly in launching 270k programs. Fixed whatever the step's
# size, so that a token's norm sums its values in the same order in a prefill as in a decode.
BLOCK_T = 16


@triton.jit(do_not_specialize=["tokens"])
def _rope_store_kernel(
    QKV, Q, K_CACHE, V_CACHE, COS, SIN, SLOTS, Q_NORM, K_NORM, eps, tokens,
    stride_t, stride_cos, stride_qt, stride_slot,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    NORM: tl.constexpr, CACHE_MAX: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)  # q heads, then k heads, then v heads
    live = t < tokens
    inside = live[:, None]
    row = t[:, None].to(tl.int64)
    i = tl.arange(0, HALF)[None, :]
    src = QKV + row * stride_t + head * (2 * HALF) + i
    lo = tl.load(src, mask=inside, other=0.0)
    hi = tl.load(src + HALF, mask=inside, other=0.0)
    dtype = lo.dtype
    is_q = head < NUM_HEADS
    if head >= NUM_HEADS + NUM_KV_HEADS:
        slot = tl.load(SLOTS + t, mask=live, other=0).to(tl.int64)[:, None]
        dst = V_CACHE + slot * stride_slot + (head - NUM_HEADS - NUM_KV_HEADS) * (2 * HALF) + i
        tl.store(dst, _to_cache(lo, V_CACHE, CACHE_MAX), mask=inside)
        tl.store(dst + HALF, _to_cache(hi, V_CACHE, CACHE_MAX), mask=inside)
    else:
        x1 = lo.to(tl.float32)
        x2 = hi.to(tl.float32)
        if NORM:
            squares = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)
            rstd = (1.0 / tl.sqrt(squares / (2 * HALF) + eps))[:, None]
            if is_q:
                w1 = tl.load(Q_NORM + i).to(tl.float32)
                w2 = tl.load(Q_NORM + HALF + i).to(tl.float32)
            else:
                w1 = tl.load(K_NORM + i).to(tl.float32)
                w2 = tl.load(K_NORM + HALF + i).to(tl.float32)
            x1 = (w1 * (x1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            x2 = (w2 * (x2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        angles = row * stride_cos + i
        cos1 = tl.load(COS + angles, mask=inside, other=0.0).to(tl.float32)
        cos2 = tl.load(COS + angles + HALF, mask=inside, other=0.0).to(tl.float32)
        sin1 = tl.load(SIN + angles, mask=inside, other=0.0).to(tl.float32)
        sin2 = tl.load(SIN + angles + HALF, mask=inside, other=0.0).to(tl.float32)
        out1 = x1 * cos1 - x2 * sin1
        out2 = x2 * cos2 + x1 * sin2
        if is_q:
            q_dst = Q + row * stride_qt + head * (2 * HALF) + i
            tl.store(q_dst, out1.to(dtype), mask=inside)
            tl.store(q_dst + HALF, out2.to(dtype), mask=inside)
        else:
            slot = tl.load(SLOTS + t, mask=live, other=0).to(tl.int64)[:, None]
            k_dst = K_CACHE + slot * stride_slot + (head - NUM_HEADS) * (2 * HALF) + i
            tl.store(k_dst, _to_cache(out1, K_CACHE, CACHE_MAX), mask=inside)
            tl.store(k_dst + HALF, _to_cache(out2, K_CACHE, CACHE_MAX), mask=inside)


def cache_max(dtype: torch.dtype) -> float:
    """The magnitude a KV cache of `dtype` clamps values to (0: none, the activation dtype)."""
    return torch.finfo(dtype).max if dtype == torch.float8_e4m3fn else 0.0


def rope_store(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    angles: tuple[torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """The rotated queries [T, num_heads, D] of qkv [T, (num_heads + 2 kv heads) * D] (q's heads,
    then k's, then v's); the rotated keys and the values are stored in k_cache and v_cache
    ([blocks, block_size, kv heads, D], contiguous; float8 e4m3 caches take them clamped to
    +-448) at `slots` [T]. `angles`: cos and sin
    [T, 1, D] (`RotaryEmbedding.angles`, RoPE over whole heads); `norms`: q's and k's RMSNorm
    weights [D] and their epsilon, applied per head before RoPE."""
    tokens = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    cos, sin = angles
    q_norm, k_norm, eps = norms if norms is not None else (qkv, qkv, 0.0)
    if tokens:
        grid = (triton.cdiv(tokens, BLOCK_T), num_heads + 2 * num_kv_heads)
        _rope_store_kernel[grid](
            qkv, q, k_cache, v_cache, cos, sin, slots, q_norm, k_norm, eps, tokens,
            qkv.stride(0), cos.stride(0), q.stride(0), k_cache.stride(1),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2,
            NORM=norms is not None, CACHE_MAX=cache_max(k_cache.dtype), BLOCK_T=BLOCK_T,
        )  # fmt: skip
    return q
