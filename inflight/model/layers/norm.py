"""RMSNorm, with the residual add that precedes it fused in: one kernel per norm on CUDA (Triton)
and on the CPU float32 path (kernels/cpu/ops.py), torch's ops elsewhere. A norm feeding an FP8
linear layer can also quantize its rows for it (on CUDA in the same kernel)."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch
from torch import nn

from inflight.model.kernels.cpu import ops as cpu_ops
from inflight.model.layers.linear import Fp8Rows
from inflight.model.layers.platform import Platform
from inflight.model.layers.quantization import FP8_MAX, fp8_rows

# (x, weight, eps, residual or None) -> (the norm of x (+ residual), the sum or None).
RMSNormKernel = Callable[
    [torch.Tensor, torch.Tensor, float, torch.Tensor | None],
    tuple[torch.Tensor, torch.Tensor | None],
]
# (x, weight, eps, residual or None) -> (the norm's rows in float8, their scales, the sum or None).
RMSNormFp8Kernel = Callable[
    [torch.Tensor, torch.Tensor, float, torch.Tensor | None],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
]


def torch_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if residual is not None:
        summed = x + residual
        return torch_rms_norm(summed, weight, eps)[0], summed
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype), None


class TorchRMSNorm(nn.Module):
    """RMSNorm in torch's ops alone (`torch_rms_norm`), for the small models beside a decoder
    that run no fused kernels (a code predictor, a codec decoder)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch_rms_norm(x, self.weight, self.eps)[0]


def _native_rms_norm(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    # The kernel takes rows [rows, size] with unit inner stride; anything else (the per-head
    # q/k norms' [T, H, D] views) goes through torch.
    if x.dim() == 2 and x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1):
        return cpu_ops.rms_norm(lib, x, weight, eps, residual)
    if residual is None:
        return torch_rms_norm(x, weight, eps)
    summed = x + residual
    return _native_rms_norm(lib, summed, weight, eps)[0], summed


def select_rms_norm(platform: Platform) -> RMSNormKernel:
    if platform.device.type == "cuda":
        # Imported here: CPU machines need not have Triton.
        from inflight.model.kernels.triton import ops as triton_ops

        return triton_ops.rms_norm
    if platform.cpu_ops is not None:
        return functools.partial(_native_rms_norm, platform.cpu_ops)
    return torch_rms_norm


def _rms_norm_then_fp8(
    kernel: RMSNormKernel,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    normed, summed = kernel(x, weight, eps, residual)
    return *fp8_rows(normed.reshape(-1, normed.shape[-1])), summed


def select_rms_norm_fp8(platform: Platform) -> RMSNormFp8Kernel:
    if platform.device.type == "cuda":
        from inflight.model.kernels.triton import ops as triton_ops

        return functools.partial(triton_ops.rms_norm_fp8, fp8_max=FP8_MAX)
    return functools.partial(_rms_norm_then_fp8, select_rms_norm(platform))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, platform: Platform) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.kernel = select_rms_norm(platform)
        self.fp8_kernel = select_rms_norm_fp8(platform)

    def forward(self, x: torch.Tensor, fp8: bool = False) -> torch.Tensor | Fp8Rows:
        """The norm of x; `fp8`: its rows quantized for the FP8 linear layer they feed."""
        return self.add_forward(x, None, fp8)[0]

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, fp8: bool = False
    ) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor | None]:
        """The norm of `x + residual` (of x, without one), and that sum (the next residual);
        `fp8`: the norm's rows quantized for the FP8 linear layer they feed."""
        if not fp8:
            return self.kernel(x, self.weight, self.eps, residual)
        values, scales, summed = self.fp8_kernel(x, self.weight, self.eps, residual)
        return Fp8Rows(values, scales, x.dtype), summed
