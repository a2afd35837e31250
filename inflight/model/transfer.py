"""Host-to-device copies that never make the host wait for the device."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(
    values: np.ndarray | Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`values` as a tensor on `device`.

    A copy from pageable host memory synchronizes the stream, which would hold the host behind
    the step the device is still computing; a copy from pinned memory is queued and returns at
    once. (The pinned block is not reused before its copy has run: PyTorch's host allocator
    records the copy's event.)
    """
    host = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def to_device_packed(
    arrays: Sequence[np.ndarray], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """Each array as a tensor of its shape on `device`, all through one host-to-device copy
    (each copy costs the host tens of microseconds, whatever its size)."""
    sizes = [a.size for a in arrays]
    flat = to_device(np.concatenate([a.ravel() for a in arrays]), dtype, device)
    return [part.view(a.shape) for part, a in zip(flat.split(sizes), arrays, strict=True)]
