"""FP8 linear layers at a few rows: the weights streamed at bandwidth.

A decode step of a few rows reads every weight once and multiplies it by a handful of rows, so
its time is the weights' bytes over the memory's bandwidth, if the kernel keeps enough loads in
flight. `torch._scaled_mm` (cuBLASLt) at 1-64 rows does not (1.2-2.8 TB/s on Llama-3.1-8B's
layers, `bench/fp8_linear.py`): a step of <= 8 rows took as long with FP8 weights as with bf16.
Here the product is computed transposed, weight rows on the tensor cores' long side and the
few activation rows on the short one, each program walking all of K for its weight rows with
several loads in flight (`Fp8Tiles.stages`).

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

# Rows a call may have; more go to cuBLASLt (at 128 rows it streams Llama-3.1-8B's gate_up at
# 3.1 TB/s; this kernel was measured up to 64).
MAX_ROWS = 64
# K a float8 tensor-core sum may run before it is added into the float32 accumulator.
PROMOTE = 128


@dataclass(frozen=True)
class Fp8Tiles:
    """A launch shape: `block_n` weight rows a program, `block_k` of K a step (a multiple of
    PROMOTE), `stages` steps' loads in flight."""

    block_n: int = 64
    block_k: int = 128
    warps: int = 4
    stages: int = 6


def row_tile(rows: int) -> int:
    """The rows a call's activations are padded to: the tensor cores' short side, 16 to 64."""
    return max(16, triton.next_power_of_2(rows))


@triton.jit(do_not_specialize=["M"])
def _fp8_few_rows_kernel(
    X, XS, W, WS, Y, BIAS, M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PROMOTE: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for start in range(0, K, BLOCK_K):
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
    acc = acc * tl.load(WS + cols, mask=cols < N, other=0.0)[:, None]
    acc = acc * tl.load(XS + rows, mask=rows < M, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + cols, mask=cols < N, other=0.0).to(tl.float32)[:, None]
    tl.store(
        Y + rows[None, :] * stride_ym + cols[:, None],
        acc.to(Y.dtype.element_ty),
        mask=(rows[None, :] < M) & (cols[:, None] < N),
    )


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
    if m:
        _fp8_few_rows_kernel[(triton.cdiv(n, tiles.block_n),)](
            xq, x_scale, weight, weight_scale, y, y if bias is None else bias, m, n, k,
            xq.stride(0), weight.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=row_tile(m),
            BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, PROMOTE=PROMOTE,
            num_warps=tiles.warps, num_stages=tiles.stages,
        )  # fmt: skip
    return y
