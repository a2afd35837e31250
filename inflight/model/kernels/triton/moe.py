"""Mixture-of-experts matmuls for CUDA: a step's (token, expert) pairs sorted by expert into
blocks of BLOCK_M pairs of one expert each, then one grouped matmul over the blocks, each
program multiplying its block's rows by its expert's weight.

Everything is sized by the step's token count alone (the blocks are padded, a block past the
last real one has expert -1 and returns at once), and nothing is read back to the host: a
step replays in a CUDA graph whatever its routing. A pair's row is one program's tile, its
reduction over K in one fixed order, so it does not depend on which pairs share its block.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

BLOCK_M = 16


def align(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, ...]:
    """The pairs of `ids` [T, k] (pair p = token p // k's choice p % k) sorted by expert and
    padded so each expert's pairs fill whole blocks of `block_m`: (pair of each slot
    [T * k + E * (block_m - 1)], T * k where padding; expert of each block, -1 past the last)."""
    flat = ids.flatten()
    pairs = flat.numel()
    slots = pairs + num_experts * (block_m - 1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = flat.argsort(stable=True)
    experts = flat[order]
    # A pair's rank among its expert's pairs: its sorted index less the pairs of lower experts.
    rank = torch.arange(pairs, device=ids.device) - (counts.cumsum(0) - counts)[experts]
    sorted_pairs = torch.full((slots,), pairs, dtype=torch.int32, device=ids.device)
    sorted_pairs[(ends - padded)[experts] + rank] = order.to(torch.int32)
    starts = torch.arange(0, slots, block_m, device=ids.device)
    block_expert = torch.searchsorted(ends, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


@triton.jit
def _grouped_kernel(
    A, B, C, SORTED, BLOCK_EXPERT, num_pairs, n, k, rows_per_pair,
    stride_am, stride_be, stride_bn, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    expert = tl.load(BLOCK_EXPERT + block)
    if expert < 0:
        return
    slots = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SORTED + slots)
    valid = pair < num_pairs
    row = pair // rows_per_pair  # A's row: the pair's token (or the pair itself)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        a = tl.load(
            A + row[:, None] * stride_am + ks[None, :],
            mask=valid[:, None] & (ks[None, :] < k),
            other=0.0,
        )
        b = tl.load(
            B + expert.to(tl.int64) * stride_be + cols[None, :] * stride_bn + ks[:, None],
            mask=(cols[None, :] < n) & (ks[:, None] < k),
            other=0.0,
        )
        if IEEE:  # float32 in float32, not TF32
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    tl.store(
        C + pair[:, None] * stride_cm + cols[None, :],
        acc.to(C.dtype.element_ty),
        mask=valid[:, None] & (cols[None, :] < n),
    )


def grouped_matmul(
    a: torch.Tensor,
    weight: torch.Tensor,
    sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor,
    num_pairs: int,
    rows_per_pair: int,
    block_m: int = BLOCK_M,
) -> torch.Tensor:
    """out [num_pairs, N]: pair p's row of `a` (row p // rows_per_pair) times its expert's
    `weight` [E, N, K] transposed, the pairs as `align` sorted them."""
    n, k = weight.shape[1], weight.shape[2]
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    block_n, block_k = 64, 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_kernel[grid](
        a, weight, out, sorted_pairs, block_expert, num_pairs, n, k, rows_per_pair,
        a.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=a.dtype == torch.float32,
    )  # fmt: skip
    return out


def fused_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    first: torch.Tensor,
    second: torch.Tensor,
    first_bias: torch.Tensor | None,
    second_bias: torch.Tensor | None,
    activate: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Σ over each token's k experts (`ids` [T, k], `weights` [T, k]) of weight x
    second_e(activate(first_e x + b)) + b, for tokens x [T, hidden]; `first` [E, 2I or I,
    hidden] and `second` [E, hidden, I] stacked, their biases [E, rows] or None."""
    tokens, k = ids.shape
    flat = ids.flatten()
    sorted_pairs, block_expert = align(ids, first.shape[0])
    h = grouped_matmul(x, first, sorted_pairs, block_expert, tokens * k, k)
    if first_bias is not None:
        h = h + first_bias[flat]
    y = grouped_matmul(activate(h), second, sorted_pairs, block_expert, tokens * k, 1)
    if second_bias is not None:
        y = y + second_bias[flat]
    y = y * weights.flatten().unsqueeze(1).to(y.dtype)
    return y.view(tokens, k, -1).sum(dim=1)
