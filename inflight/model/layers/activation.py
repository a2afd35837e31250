"""SiLU(gate) * up, the gated activation of SwiGLU MLPs: one kernel on CUDA (Triton) and on the
CPU float32 path (kernels/cpu/ops.py), torch's ops elsewhere."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from inflight.model.kernels.cpu import ops as cpu_ops
from inflight.model.layers.platform import Platform


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


class SiluAndMul(nn.Module):
    """silu(gate) * up of x [T, 2 * size] holding gate then up -> [T, size]."""

    def __init__(self, platform: Platform) -> None:
        super().__init__()
        self.kernel = select_silu_mul(platform)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernel(gate_up)
