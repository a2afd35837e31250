"""A batch-invariant matmul: x @ weight^T (+ bias), each row's bits whatever the row count.

cuBLAS picks its kernel (tile shape, split of K) by the problem's size, so a row's dot products
are summed in another order when the step holds another number of rows, and its bits change.
Here every output element is one program's walk over K, in order, one k16 tensor-core step
after another into a float32 accumulator, with no split of K: a row's result is the same alone
or beside any others.

The tile shape only says which outputs a program computes, not how one is summed: on the H200
every shape `bench/invariant_matmul.py` tried (64 or 128 rows, 64 to 256 columns, 64 or 128 of
K an iteration, 4 or 8 warps) gave the same bits on every layer of two models. So prefill-sized
calls take a larger tile (a Llama-3.1-8B prefill step of 8,192 tokens: 277 -> 213 ms of
matmuls), decode-sized ones the shape that is fastest there; `bench/gpu_check.py`'s batch
invariance check crosses between them (a prompt alone, then in a chunk of 2,048 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Tiles:
    """A launch shape. GROUP_M: programs of `group_m` row tiles walk a column of weight tiles
    together (L2 reuse)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    warps: int = 4
    stages: int = 4


DECODE_TILES = Tiles()
PREFILL_TILES = Tiles(128, 128, 64, 8, 8, 3)
PREFILL_ROWS = 512  # calls of more rows than this take PREFILL_TILES


def tiles_for(rows: int) -> Tiles:
    return PREFILL_TILES if rows > PREFILL_ROWS else DECODE_TILES


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
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) in x's dtype, each row's bits independent of
    the others'. `tiles`: the launch shape, by default `tiles_for` the row count
    (`bench/invariant_matmul.py` passes others)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, k = rows.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        tiles = tiles or tiles_for(m)
        grid = (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n),)
        _matmul_kernel[grid](
            rows, weight, y, y if bias is None else bias, m, n, k,
            rows.stride(0), weight.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
            BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m, num_warps=tiles.warps,
            num_stages=tiles.stages,
        )  # fmt: skip
    return y.reshape(*x.shape[:-1], n)
