"""A batch-invariant matmul: x @ weight^T (+ bias) with one tile shape whatever the row count.

cuBLAS picks its kernel (tile shape, split of K) by the problem's size, so a row's dot products
are summed in another order when the step holds another number of rows, and its bits change.
Here every output element is one program's walk over K in BLOCK_K steps, each a tensor-core dot
of the same shape, with no split of K: a row's result is the same alone or beside any others.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 64, 128, 64
GROUP_M = 8  # programs of GROUP_M row tiles walk a column of weight tiles together (L2 reuse)


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    X, W, Y, BIAS, M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % (GROUP_M * tiles_n)) % group_rows
    tile_n = (pid % (GROUP_M * tiles_n)) // group_rows
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, K, BLOCK_K):
        inside = start + k < K
        x = tl.load(
            X + rows[:, None].to(tl.int64) * stride_xm + (start + k)[None, :],
            mask=(rows[:, None] < M) & inside[None, :],
            other=0.0,
        )
        w = tl.load(
            W + cols[None, :].to(tl.int64) * stride_wn + (start + k)[:, None],
            mask=(cols[None, :] < N) & inside[:, None],
            other=0.0,
        )
        acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(BIAS + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        Y + rows[:, None].to(tl.int64) * stride_ym + cols[None, :],
        acc.to(Y.dtype.element_ty),
        mask=(rows[:, None] < M) & (cols[None, :] < N),
    )


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) in x's dtype, each row's bits independent of
    the others'."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, k = rows.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N),)
        _matmul_kernel[grid](
            rows, weight, y, y if bias is None else bias, m, n, k,
            rows.stride(0), weight.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            GROUP_M=GROUP_M, num_warps=4, num_stages=4,
        )  # fmt: skip
    return y.reshape(*x.shape[:-1], n)
