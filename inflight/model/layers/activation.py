"""SiLU(gate) * up, the gated activation of SwiGLU MLPs: one kernel on CUDA (Triton) and on the
CPU float32 path (kernels/cpu/ops.py), torch's ops elsewhere. Before an FP8 linear layer it can
also quantize its rows for it (on CUDA in the same kernel)."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from inflight.model.kernels.cpu import ops as cpu_ops
from inflight.model.layers.linear import Fp8Rows
from inflight.model.layers.platform import Platform
from inflight.model.layers.quantization import FP8_MAX, fp8_rows


def torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def _native_silu_mul(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    # The kernel takes rows [rows, 2 * size] with unit inner stride.
    if gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        return cpu_ops.silu_mul(lib, gate_up)
    return torch_silu_mul(gate_up)


def select_silu_mul(platform: Platform) -> Callable[[torch.Tensor], torch.Tensor]:
    if platform.device.type == "cuda":
        # Imported here: CPU machines need not have Triton.
        from inflight.model.kernels.triton import ops as triton_ops

        return triton_ops.silu_mul
    if platform.cpu_ops is not None:
        return functools.partial(_native_silu_mul, platform.cpu_ops)
    return torch_silu_mul


def select_silu_mul_fp8(
    platform: Platform,
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """silu(gate) * up's rows in float8 and their scales (`fp8_rows`)."""
    if platform.device.type == "cuda":
        from inflight.model.kernels.triton import ops as triton_ops

        return functools.partial(triton_ops.silu_mul_fp8, fp8_max=FP8_MAX)
    kernel = select_silu_mul(platform)
    return lambda gate_up: fp8_rows(kernel(gate_up))


class SiluAndMul(nn.Module):
    """silu(gate) * up of x [T, 2 * size] holding gate then up -> [T, size]."""

    def __init__(self, platform: Platform) -> None:
        super().__init__()
        self.kernel = select_silu_mul(platform)
        self.fp8_kernel = select_silu_mul_fp8(platform)

    def forward(self, gate_up: torch.Tensor, fp8: bool = False) -> torch.Tensor | Fp8Rows:
        """`fp8`: the rows quantized for the FP8 linear layer they feed."""
        if not fp8:
            return self.kernel(gate_up)
        return Fp8Rows(*self.fp8_kernel(gate_up), gate_up.dtype)
