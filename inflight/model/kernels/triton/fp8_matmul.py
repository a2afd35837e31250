"""FP8 linear layers at a few rows: the weights streamed at bandwidth.

A decode step of a few rows reads every weight once and multiplies it by a handful of rows, so
its time is the weights' bytes over the memory's bandwidth, if the kernel keeps enough loads in
flight. `torch._scaled_mm` (cuBLASLt) at 1-128 rows does not (1.2-3.0 TB/s on Llama-3.1-8B's
layers, `bench/fp8_linear.py`): a step of <= 8 rows took as long with FP8 weights as with bf16.
Here the product is computed transposed, weight rows on the tensor cores' long side and the
few activation rows on the short one, each program walking its part of K for its weight rows
with several loads in flight (`Fp8Tiles.stages`). Where a layer has too few weight tiles to
keep every multiprocessor busy (Llama-3.1-8B's down and o: 64 tiles of 64 rows, 132
multiprocessors), K is cut into parts whose float32 sums a second kernel adds in a fixed order.

The arithmetic is `Fp8LinearMethod`'s: activations quantized per row to e4m3, products of e4m3
values summed in float32, then the row's and the channel's scales. Hopper's FP8 tensor-core
instructions add into a narrower accumulator; like cuBLASLt without fast accumulation, the sums
move into float32 every `PROMOTE` of K.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from inflight.model.kernels.triton.plan import multiprocessors

# Rows a call may have. Past 64 rows the kernel only beats cuBLASLt on layers of few weight
# tiles (`takes`); at 192 and 256 rows Triton's best tiles lost or tied on Llama-3.1-8B's layers
# (`bench/fp8_gemm_tiles.py`), and 129-191 rows were not tried.
MAX_ROWS = 128
# K a float8 tensor-core sum may run before it is added into the float32 accumulator.
PROMOTE = 128
# The most parts K is cut into.
MAX_SPLIT = 4


@dataclass(frozen=True)
class Fp8Tiles:
    """A launch shape: `block_n` weight rows a program, `block_k` of K a step (a multiple of
    PROMOTE), `stages` steps' loads in flight; `block_m` activation rows a program and `split`
    parts of K, where not 0, instead of `plan`'s."""

    block_n: int = 64
    block_k: int = 128
    warps: int = 4
    stages: int = 6
    block_m: int = 0
    split: int = 0


def row_tile(rows: int) -> int:
    """The rows a call's activations are padded to: the tensor cores' short side, 16 to 128."""
    return max(16, triton.next_power_of_2(rows))


def takes(rows: int, n: int, multiprocessors: int, tiles: Fp8Tiles = Fp8Tiles()) -> bool:
    """Whether a call of `rows` rows into `n` outputs should take this kernel rather than
    cuBLASLt: up to 64 rows always; up to MAX_ROWS where its weight tiles number at most the
    multiprocessors (on an H200, Llama-3.1-8B's qkv, o and down at 96-128 rows 1.04-1.31x
    cuBLASLt, gate_up with 448 tiles 0.7x: `bench/RESULTS.md`)."""
    return rows <= 64 or (rows <= MAX_ROWS and triton.cdiv(n, tiles.block_n) <= multiprocessors)


def plan(rows: int, n: int, k: int, tiles: Fp8Tiles, multiprocessors: int) -> tuple[int, int]:
    """(block_m, split) for a call: the rows in tiles of up to 64 (one tile up to 64 rows, so
    each weight is read once; past 64 the tiles of one weight tile run side by side). Then K is
    cut in 2 or 4 while the programs number fewer than the multiprocessors, each part keeping
    at least 8 steps."""
    block_m = tiles.block_m or min(row_tile(rows), 64)
    if tiles.split:
        return block_m, tiles.split
    programs = triton.cdiv(rows, block_m) * triton.cdiv(n, tiles.block_n)
    steps, split = triton.cdiv(k, tiles.block_k), 1
    while programs * split < multiprocessors and split < MAX_SPLIT and steps >= 16 * split:
        split *= 2
    return block_m, split


@triton.jit(do_not_specialize=["M"])
def _fp8_few_rows_kernel(
    X, XS, W, WS, Y, BIAS, M, N, K, k_part, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PROMOTE: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    # Activation-row tiles on the fastest axis: the programs of one weight tile run together,
    # so all but the first read it from L2.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    part = tl.program_id(2)
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for step in range(0, k_part, BLOCK_K):
        start = part * k_part + step  # the last part may run past K: masked
        inside = start + k < K
        w = tl.load(
            W + cols[:, None].to(tl.int64) * stride_wn + (start + k)[None, :],
            mask=(cols[:, None] < N) & inside[None, :],
            other=0.0,
        )
        x = tl.load(
            X + rows[None, :] * stride_xm + (start + k)[:, None],
            mask=(rows[None, :] < M) & inside[:, None],
            other=0.0,
        )
        acc = tl.dot(w, x, acc, max_num_imprecise_acc=PROMOTE)
    inside = (rows[None, :] < M) & (cols[:, None] < N)
    if SPLIT > 1:  # the part's sum, unscaled, for _fp8_parts_kernel
        tl.store(Y + (part * M + rows[None, :]) * N + cols[:, None], acc, mask=inside)
    else:
        acc = acc * tl.load(WS + cols, mask=cols < N, other=0.0)[:, None]
        acc = acc * tl.load(XS + rows, mask=rows < M, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(BIAS + cols, mask=cols < N, other=0.0).to(tl.float32)[:, None]
        out = Y + rows[None, :] * stride_ym + cols[:, None]
        tl.store(out, acc.to(Y.dtype.element_ty), mask=inside)


@triton.jit(do_not_specialize=["M"])
def _fp8_parts_kernel(
    P, XS, WS, Y, BIAS, M, N, stride_ym,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Y = the sum of K's parts P [SPLIT, M, N] in order, scaled (+ bias)."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < N
    acc = tl.load(P + row * N + cols, mask=inside, other=0.0)
    for part in tl.static_range(1, SPLIT):
        acc += tl.load(P + (part * M + row) * N + cols, mask=inside, other=0.0)
    acc = acc * tl.load(WS + cols, mask=inside, other=0.0) * tl.load(XS + row)
    if HAS_BIAS:
        acc += tl.load(BIAS + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_ym + cols, acc.to(Y.dtype.element_ty), mask=inside)


def fp8_few_rows_linear(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    tiles: Fp8Tiles = Fp8Tiles(),
) -> torch.Tensor:
    """(xq * x_scale) @ (weight * weight_scale)^T (+ bias) for xq [M <= MAX_ROWS, K] and
    weight [N, K] in float8 e4m3, x_scale [M, 1] and weight_scale [N, 1] in float32: [M, N]
    of `out_dtype`."""
    m, k = xq.shape
    n = weight.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"{m} rows: the few-rows FP8 kernel takes at most {MAX_ROWS}")
    y = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if not m:
        return y
    block_m, split = plan(m, n, k, tiles, multiprocessors(xq.device))
    k_part = triton.cdiv(triton.cdiv(k, tiles.block_k), split) * tiles.block_k
    parts = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=xq.device)
    _fp8_few_rows_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, tiles.block_n), split)](
        xq, x_scale, weight, weight_scale, parts, y if bias is None else bias, m, n, k, k_part,
        xq.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, PROMOTE=PROMOTE, SPLIT=split,
        num_warps=tiles.warps, num_stages=tiles.stages,
    )  # fmt: skip
    if split > 1:
        block = 1024
        _fp8_parts_kernel[(m, triton.cdiv(n, block))](
            parts, x_scale, weight_scale, y, y if bias is None else bias, m, n, y.stride(0),
            HAS_BIAS=bias is not None, SPLIT=split, BLOCK=block,
        )  # fmt: skip
    return y
