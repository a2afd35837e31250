"""The multi-LoRA side path for CUDA steps of up to a few thousand tokens: one kernel per linear.

Program (s, n, b) serves the tokens of slot s among block b of the step's tokens, on block n of
the output columns: (x A_s^T) for the part of the output the columns lie in, then that times
B_s^T, both on tensor cores, added to its tokens' rows of y in float32 and rounded once. The
block's other tokens are masked out (zero rows, not stored), so each row of y is written by one
program per column block whatever the mix of slots, and a block holding no token of s returns at
once. Shapes are static and the slots are read from the device, so a captured CUDA graph
replays it with any mix of adapters.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Measured on an H200 over Qwen3-0.6B's shapes at rank 16 (bench/lora_matmul.py --cuda).
BLOCK_N = 256
BLOCK_K = 256
NUM_WARPS = 4


def _block_t(tokens: int) -> int:
    return 16 if tokens <= 64 else 32


@triton.jit
def _lora_kernel(
    X, Y, SLOTS, A, BT, stride_x, stride_y, tokens, in_features, out_features, num_slots,
    max_rank, start1, start2,
    PARTS: tl.constexpr, RANK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    slot = tl.program_id(0)
    rows = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    mine = tl.load(SLOTS + rows, mask=rows < tokens, other=-1) == slot
    if tl.sum(mine.to(tl.int32), axis=0) > 0:
        ranks = tl.arange(0, RANK)
        rank_ok = ranks < max_rank
        col_lo = tl.program_id(1) * BLOCK_N
        col_hi = tl.minimum(col_lo + BLOCK_N, out_features)
        cols = col_lo + tl.arange(0, BLOCK_N)
        col_ok = cols < out_features
        # Each column's part: 0 before start1, 1 before start2, else 2.
        part = (cols >= start1).to(tl.int32) + (cols >= start2).to(tl.int32)
        bt = tl.load(
            BT + (slot * max_rank + ranks[:, None]) * out_features + cols[None, :],
            mask=rank_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for p in tl.static_range(PARTS):
            if p == 0:
                lo = 0
                hi = start1
            elif p == 1:
                lo = start1
                hi = start2
            else:
                lo = start2
                hi = out_features
            if (lo < col_hi) & (hi > col_lo):
                a_rows = A + ((p * num_slots + slot) * max_rank + ranks) * in_features
                h = tl.zeros([BLOCK_T, RANK], dtype=tl.float32)
                for k0 in range(0, in_features, BLOCK_K):
                    ks = k0 + tl.arange(0, BLOCK_K)
                    k_ok = ks < in_features
                    x = tl.load(
                        X + rows[:, None] * stride_x + ks[None, :],
                        mask=mine[:, None] & k_ok[None, :],
                        other=0.0,
                    )
                    at = tl.load(
                        a_rows[None, :] + ks[:, None],
                        mask=k_ok[:, None] & rank_ok[None, :],
                        other=0.0,
                    )
                    h = tl.dot(x, at, h)
                update = tl.dot(h.to(bt.dtype), bt)
                acc += tl.where((part == p)[None, :], update, 0.0)
        at_rows = Y + rows[:, None] * stride_y + cols[None, :]
        written = mine[:, None] & col_ok[None, :]
        y = tl.load(at_rows, mask=written, other=0.0)
        tl.store(at_rows, (y.to(tl.float32) + acc).to(y.dtype), mask=written)


def lora_add(
    y: torch.Tensor,
    x: torch.Tensor,
    token_slots: torch.Tensor,
    a: torch.Tensor,
    bt: torch.Tensor,
    starts: tuple[int, ...],
) -> None:
    """In place: y [T, out] += (x[t] A^T) B^T with token t's slot's factors, for each token of
    int32 token_slots [T] >= 0; a [parts, slots, max_rank, in], bt [slots, max_rank, out], part
    p's columns starts[p] .. starts[p + 1] (see `layers/lora.py`)."""
    parts, slots, max_rank, in_features = a.shape
    tokens, out_features = y.shape
    if not tokens:
        return
    assert parts <= 3 and y.stride(1) == 1 and x.stride(1) == 1
    # Part p's columns: [0, start1), [start1, start2), [start2, out); unused parts end at out.
    bounds = [*starts[1:-1], out_features, out_features][:2]
    block_t = _block_t(tokens)
    grid = (slots, triton.cdiv(out_features, BLOCK_N), triton.cdiv(tokens, block_t))
    _lora_kernel[grid](
        x, y, token_slots, a, bt, x.stride(0), y.stride(0), tokens, in_features, out_features,
        slots, max_rank, bounds[0], bounds[1],
        PARTS=parts, RANK=max(16, triton.next_power_of_2(max_rank)), BLOCK_T=block_t,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS,
    )  # fmt: skip
