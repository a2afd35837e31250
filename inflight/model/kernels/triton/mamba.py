"""The Mamba2 recurrent step of decode rows in one kernel (CUDA).

Torch computes it in some ten passes over the [rows, heads, head_dim, d_state] float32 state
(gather, decay, outer product, add, scatter, product with C, sum): at Bamba-9B's width that is
268 MB per pass and layer for 64 rows, the bulk of a decode step. Here each program reads a
block of one row's state for one head once, updates it in place in its slot and writes its
share of y: the formula of `layers/mamba.py: ssm_decode`, in the same order of operations (the
sum over d_state aside, which Triton orders its own way).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _ssm_decode_kernel(
    STATE, SLOTS, X, DT, A, B, C, D, Y,
    stride_state, stride_x, stride_dt, stride_bc, stride_y,
    heads_per_group,
    HEAD_DIM: tl.constexpr, D_STATE: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    head = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, D_STATE)
    keep = p < HEAD_DIM
    slot = tl.load(SLOTS + row)
    dt = tl.load(DT + row * stride_dt + head)
    decay = tl.exp(dt * tl.load(A + head))
    x = tl.load(X + row * stride_x + head * HEAD_DIM + p, mask=keep, other=0.0)
    group = head // heads_per_group
    b = tl.load(B + row * stride_bc + group * D_STATE + n)
    c = tl.load(C + row * stride_bc + group * D_STATE + n)
    cell = (
        STATE + slot * stride_state + head * HEAD_DIM * D_STATE + p[:, None] * D_STATE + n[None, :]
    )
    state = tl.load(cell, mask=keep[:, None], other=0.0)
    state = state * decay + (dt * x)[:, None] * b[None, :]
    tl.store(cell, state, mask=keep[:, None])
    y = tl.sum(state * c[None, :], axis=1) + tl.load(D + head) * x
    tl.store(Y + row * stride_y + head * HEAD_DIM + p, y, mask=keep)


def ssm_decode(
    state: torch.Tensor,
    slots: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
) -> torch.Tensor:
    """One step of each row's scan, its slot of `state` [slots, H, P, N] (float32, contiguous)
    updated in place: S = exp(dt a) S + dt outer(x, b); y = S c + D x. x [R, H, P], dt [R, H],
    a and d [H], b and c [R, G, N] (one per group of heads), all float32 -> y [R, H, P]."""
    rows, heads, head_dim = x.shape
    d_state = state.shape[-1]
    x, dt, b, c = x.contiguous(), dt.contiguous(), b.contiguous(), c.contiguous()
    y = torch.empty_like(x)
    block = min(triton.next_power_of_2(head_dim), max(16, 4096 // d_state))
    if rows:
        _ssm_decode_kernel[(rows, heads, triton.cdiv(head_dim, block))](
            state, slots, x, dt, a, b, c, d, y,
            state.stride(0), x.stride(0), dt.stride(0), b.stride(0), y.stride(0),
            heads // b.shape[1],
            HEAD_DIM=head_dim, D_STATE=d_state, BLOCK_P=block,
        )  # fmt: skip
    return y
