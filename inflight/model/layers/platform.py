"""What the layers choose their kernels by, once, when a model is built."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from inflight.model.kernels.cpu import ops as cpu_ops


@dataclass(frozen=True)
class Platform:
    """The device and dtype a model runs in, and the native kernels available there."""

    device: torch.device
    dtype: torch.dtype
    # Float matmuls run on weights prepacked for oneDNN: the CPU float32 path, which the native
    # quantized matmuls also need.
    onednn: bool = False
    # The fused CPU float32 ops of kernels/cpu/ops.py, where they built.
    cpu_ops: ctypes.CDLL | None = None
    # Kernels whose per-row results do not depend on the other rows of a step (the CPU float32
    # path's are so already; on CUDA the matmuls change kernel).
    batch_invariant: bool = False

    @classmethod
    def detect(
        cls, device: torch.device, dtype: torch.dtype, batch_invariant: bool = False
    ) -> Platform:
        """The platform of `device` and `dtype`; builds the fused CPU ops where they apply (a
        failed build warns once and leaves torch's ops to serve)."""
        cpu_float32 = device.type == "cpu" and dtype == torch.float32
        return cls(
            device,
            dtype,
            onednn=cpu_float32 and torch.backends.mkldnn.is_available(),
            cpu_ops=cpu_ops.library() if cpu_float32 else None,
            batch_invariant=batch_invariant,
        )
