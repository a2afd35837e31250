"""Fused elementwise kernels for CUDA: each replaces a chain of small kernels per layer.

They compute what the torch reference modules compute, in the same precision at each stage
(statistics in float32, one rounding to the activation dtype where the reference rounds).
The `_fp8` variants also quantize their output rows as `fp8_rows` does, for the FP8 linear
layer they feed, so that no kernel of its own reads those rows again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    X, R, OUT, SCALE, RES_OUT, W, stride_x, stride_r, stride_o, stride_ro, size, eps,
    HAS_RESIDUAL: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """A row's norm; FP8_MAX > 0: quantized as `fp8_rows` quantizes, its scale to SCALE."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The residual sum is rounded to the activation dtype, as `x + residual` is.
        x = (x + tl.load(R + row * stride_r + cols, mask=mask, other=0.0)).to(x.dtype)
        tl.store(RES_OUT + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / size + eps)
    normed = (xf * rstd).to(x.dtype)
    w = tl.load(W + cols, mask=mask, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    if FP8_MAX > 0:
        # Rounded to the activation dtype, as the float path stores it, before it is quantized.
        y = y.to(x.dtype).to(tl.float32)
        scale = _fp8_scale(tl.max(tl.abs(y), axis=0), FP8_MAX)
        tl.store(SCALE + row, scale)
        _fp8_store(OUT + row * stride_o, cols, size, y, scale, FP8_MAX)
    else:
        tl.store(OUT + row * stride_o + cols, y, mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm over the last dim of x [..., size] (of `x + residual` when given); returns the
    normalized rows and the sum (None without a residual)."""
    out = torch.empty_like(x.reshape(-1, x.shape[-1]))
    summed = _launch_rms_norm(x, weight, eps, residual, out, out, 0.0)
    return out.view(x.shape), summed


def _launch_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    out: torch.Tensor,
    scale: torch.Tensor,
    fp8_max: float,
) -> torch.Tensor | None:
    """`_rms_norm_kernel` over x's rows into `out` (and, with fp8_max > 0, the rows' scales
    into `scale`); returns the sum x + residual (None without a residual)."""
    size = x.shape[-1]
    x2 = x.reshape(-1, size)
    res_out = torch.empty_like(x2) if residual is not None else x2
    r2 = residual.reshape(-1, size) if residual is not None else x2
    block = triton.next_power_of_2(size)
    if x2.shape[0]:
        # The warps depend on the row's length alone: they order the sum of squares, so the
        # float and the float8 norm of a row agree bit for bit (an H200 found 8 against 4 apart).
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, out, scale, res_out, weight, x2.stride(0), r2.stride(0), out.stride(0),
            res_out.stride(0), size, eps, HAS_RESIDUAL=residual is not None, FP8_MAX=fp8_max,
            BLOCK=block, num_warps=8 if block > 4096 else 4,
        )  # fmt: skip
    return res_out.view(x.shape) if residual is not None else None


@triton.jit
def _silu_mul_kernel(GU, OUT, stride_gu, stride_o, size, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0)
    up = tl.load(GU + row * stride_gu + size + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # silu(gate) is rounded to the activation dtype before the product, as F.silu(gate) * up is.
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(OUT + row * stride_o + cols, act.to(tl.float32) * up.to(tl.float32), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2 * size] holding gate then up."""
    tokens, size = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(tokens, size, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if tokens:
        _silu_mul_kernel[(tokens, triton.cdiv(size, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), size, BLOCK=block
        )
    return out


# The arithmetic of `fp8_rows`, bit for bit: the scale is the largest magnitude times the
# float32 reciprocal of FP8_MAX, and each value is multiplied by the scale's reciprocal, rounded
# to nearest once a row (`div_rn`: Triton's `/` on float32 is NVIDIA's approximate division, up
# to 2 ulp off, which put values of some rows across an e4m3 rounding boundary from `fp8_rows`;
# an H100, 2026-12-05).
@triton.jit
def _fp8_scale(top, FP8_MAX: tl.constexpr):
    """The scale of a row whose largest magnitude is `top` (an all-zero row: 1)."""
    return tl.where(top > 0, top * (1.0 / FP8_MAX), 1.0)


@triton.jit
def _fp8_store(OUT, cols, size, x, scale, FP8_MAX: tl.constexpr):
    inverse = tl.math.div_rn(1.0, scale)
    q = tl.minimum(tl.maximum(x * inverse, -FP8_MAX), FP8_MAX)
    # Stored in runs of 8 values, as the float norm stores its bf16 rows: left to itself, Triton
    # lays the whole kernel out for 16-byte stores of float8, 16 values a thread where the float
    # norm has 8, and the sum of squares then adds in another order (a bit apart on an H100).
    eights = (cols // 8) * 8 + cols % 8  # cols, seen as runs of 8
    tl.store(OUT + eights, q.to(tl.float8e4nv), mask=cols < size)


@triton.jit
def _fp8_rows_kernel(
    X, OUT, SCALE, stride_x, stride_o, size,
    FP8_MAX: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    X += row * stride_x
    OUT += row * stride_o
    if ONE_PASS:  # the row held in registers: read once
        cols = tl.arange(0, BLOCK)
        x = tl.load(X + cols, mask=cols < size, other=0.0).to(tl.float32)
        scale = _fp8_scale(tl.max(tl.abs(x), axis=0), FP8_MAX)
        tl.store(SCALE + row, scale)
        _fp8_store(OUT, cols, size, x, scale, FP8_MAX)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, size, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(X + cols, mask=cols < size, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        scale = _fp8_scale(tl.max(amax, axis=0), FP8_MAX)
        tl.store(SCALE + row, scale)
        for start in range(0, size, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(X + cols, mask=cols < size, other=0.0).to(tl.float32)
            _fp8_store(OUT, cols, size, x, scale, FP8_MAX)


# Rows up to this long are read once, held in registers (8 warps: 64 values a thread); longer
# ones twice, a block at a time (the largest magnitude first, then the quantized values).
ONE_PASS_MAX = 16384


def fp8_rows(x: torch.Tensor, fp8_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`layers.quantization.fp8_rows` in one kernel: each row of x [T, K] in float8 e4m3,
    scaled to its largest magnitude, and the float32 scales [T, 1]."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    size = x.shape[1]
    one_pass = size <= ONE_PASS_MAX
    block = triton.next_power_of_2(size) if one_pass else 1024
    if x.shape[0]:
        _fp8_rows_kernel[(x.shape[0],)](
            x, out, scale, x.stride(0), out.stride(0), size, FP8_MAX=fp8_max, BLOCK=block,
            ONE_PASS=one_pass, num_warps=8 if block > 4096 else 4,
        )  # fmt: skip
    return out, scale


def rms_norm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    fp8_max: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`rms_norm` with its output rows quantized as `fp8_rows` quantizes them, in one kernel
    (rows up to ONE_PASS_MAX long; longer ones run the two kernels): the float8 rows [T, size],
    their float32 scales [T, 1], and the sum (None without a residual)."""
    size = x.shape[-1]
    if size > ONE_PASS_MAX:
        normed, summed = rms_norm(x, weight, eps, residual)
        return *fp8_rows(normed.reshape(-1, size), fp8_max), summed
    tokens = x.numel() // size
    out = torch.empty(tokens, size, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(tokens, 1, dtype=torch.float32, device=x.device)
    summed = _launch_rms_norm(x, weight, eps, residual, out, scale, fp8_max)
    return out, scale, summed


@triton.jit
def _silu_mul_fp8_kernel(
    GU, OUT, SCALE, stride_gu, stride_o, size, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0)
    up = tl.load(GU + row * stride_gu + size + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    # Rounded to the activation dtype, as `silu_mul` stores it, before it is quantized.
    y = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype).to(tl.float32)
    scale = _fp8_scale(tl.max(tl.abs(y), axis=0), FP8_MAX)
    tl.store(SCALE + row, scale)
    _fp8_store(OUT + row * stride_o, cols, size, y, scale, FP8_MAX)


def silu_mul_fp8(gate_up: torch.Tensor, fp8_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`silu_mul` with its output rows quantized as `fp8_rows` quantizes them, in one kernel a
    row (rows up to ONE_PASS_MAX long; longer ones run the two kernels): the float8 rows
    [T, size] and their float32 scales [T, 1]."""
    tokens, size = gate_up.shape[0], gate_up.shape[1] // 2
    if size > ONE_PASS_MAX:
        return fp8_rows(silu_mul(gate_up), fp8_max)
    out = torch.empty(tokens, size, dtype=torch.float8_e4m3fn, device=gate_up.device)
    scale = torch.empty(tokens, 1, dtype=torch.float32, device=gate_up.device)
    block = triton.next_power_of_2(size)
    if tokens:
        # 16 warps past 8,192: a row's gate and up held in registers, 32 values of each a thread.
        _silu_mul_fp8_kernel[(tokens,)](
            gate_up, out, scale, gate_up.stride(0), out.stride(0), size, FP8_MAX=fp8_max,
            BLOCK=block, num_warps=16 if block > 8192 else (8 if block > 4096 else 4),
        )  # fmt: skip
    return out, scale
