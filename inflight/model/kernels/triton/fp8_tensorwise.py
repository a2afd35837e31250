"""FP8 linear layers through cuBLASLt's tensorwise GEMM, the row and channel scales applied by a
kernel after it.

`torch._scaled_mm` with a scale per row and per channel (rowwise) runs one CUTLASS kernel whose
tiles fit 128-row calls: on an H200 at 129-192 rows its time doubles (Llama-3.1-8B's gate_up
38 us at 128 rows, 79 at 144), and at every row count it is slower than the same product with a
single scale for each operand (tensorwise), which cuBLASLt serves with its own kernels (gate_up
at 144 rows 41 us with a float32 output; down, 4,096 x 14,336, at 256 rows 32.5 us against 39.8;
`bench/fp8_linear.py --library`). So those calls compute the unscaled product in float32 with
scales of 1, and a second kernel multiplies each element by its row's and its channel's scales
(and adds the bias) as it rounds to the output dtype: the arithmetic of the rowwise call (float32
sums of e4m3 products, scaled, rounded once), in two passes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows where the two passes beat the rowwise call on every Llama-3.1-8B layer (H200); past them
# only where K outgrows N (down: the extra pass reads little beside a long K).
FEW, MANY = 128, 192
MAX_ROWS = 256
# The scaling kernel's tile of the product.
_BLOCK_M, _BLOCK_N = 16, 256


def takes(rows: int, n: int, k: int) -> bool:
    """Whether a call of `rows` rows into `n` outputs over `k` inputs should take this path
    rather than the rowwise call."""
    return FEW < rows <= MANY or (MANY < rows <= MAX_ROWS and k > n)


def fp8_tensorwise_linear(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    one: torch.Tensor,
) -> torch.Tensor:
    """(xq * x_scale) @ (weight * weight_scale)^T + bias in `out_dtype`: `xq` [M, K] and
    `weight` [N, K] e4m3, `x_scale` [M, 1] and `weight_scale` [N, 1] float32; `one`: a float32
    scalar 1 on the device (made before any CUDA graph is captured)."""
    product = torch._scaled_mm(xq, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    return scale_product(product, x_scale, weight_scale, bias, out_dtype)


def scale_product(
    product: torch.Tensor,
    x_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """product [M, N] float32 times each row's and each column's scale, plus the bias, in
    `out_dtype`."""
    m, n = product.shape
    out = torch.empty((m, n), device=product.device, dtype=out_dtype)
    grid = (triton.cdiv(m, _BLOCK_M), triton.cdiv(n, _BLOCK_N))
    _scale_kernel[grid](
        product,
        x_scale,
        weight_scale,
        bias if bias is not None else product,
        out,
        m,
        n,
        HAS_BIAS=bias is not None,
        BLOCK_M=_BLOCK_M,
        BLOCK_N=_BLOCK_N,
    )
    return out


@triton.jit
def _scale_kernel(
    y_ptr,
    xs_ptr,
    ws_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows, in_cols = rows < M, cols < N
    mask = in_rows[:, None] & in_cols[None, :]
    at = rows[:, None].to(tl.int64) * N + cols[None, :]
    y = tl.load(y_ptr + at, mask=mask, other=0.0)
    xs = tl.load(xs_ptr + rows, mask=in_rows, other=0.0)
    ws = tl.load(ws_ptr + cols, mask=in_cols, other=0.0)
    out = y * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        out += tl.load(b_ptr + cols, mask=in_cols, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=mask)
