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
    (each copy costs the host tens of microseconds, whatever its size).

    Every part starts 16-byte aligned: Triton compiles a kernel once per alignment case of its
    pointer arguments, so parts at offsets that vary with the step's sizes would each bring a
    compile (half a second) in the middle of serving."""
    align = max(1, 16 // torch.empty((), dtype=dtype).element_size())
    sizes = [a.size for a in arrays]
    spans = [-(-size // align) * align for size in sizes]
    pieces = []
    for a, size, span in zip(arrays, sizes, spans, strict=True):
        pieces += [a.ravel(), np.zeros(span - size, dtype=a.dtype)]
    flat = to_device(np.concatenate(pieces), dtype, device)
    return [
        part[:size].view(a.shape)
        for part, a, size in zip(flat.split(spans), arrays, sizes, strict=True)
    ]
