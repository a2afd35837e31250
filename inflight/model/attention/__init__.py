"""Paged attention over a ragged batch: the metadata, the backend interface, and the one
function that picks a backend for a device (the backends themselves import lazily: a CPU
machine need not have Triton)."""

from __future__ import annotations

import logging

import torch

from inflight.model.attention.base import AttentionBackend
from inflight.model.attention.reference import TorchAttentionBackend

__all__ = ["AttentionBackend", "TorchAttentionBackend", "select_backend"]

log = logging.getLogger(__name__)


def select_backend(
    name: str | None,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    batch_invariant: bool = False,
) -> AttentionBackend:
    """The named backend, or by default: triton on CUDA, cpu (its native attention kernel) for
    float32 on the CPU where it builds, else torch. Where a named backend runs is the
    deployment plan's rule; `batch_invariant` asks triton for its batch-invariant mode (the cpu
    backend's attention is per row whatever the step). A named cpu backend whose kernel cannot
    be built is a ValueError, a default one falls back to torch."""
    native_cpu = device.type == "cpu" and dtype == torch.float32 and head_dim % 8 == 0
    chosen = name or ("triton" if device.type == "cuda" else "cpu" if native_cpu else "torch")
    if chosen == "torch":
        return TorchAttentionBackend()
    if chosen == "cpu":
        from inflight.model.attention.cpu import CpuAttentionBackend
        from inflight.model.kernels.cpu.native import NativeBuildError

        try:
            return CpuAttentionBackend()
        except NativeBuildError as exc:
            if name is not None:
                raise ValueError(f"the cpu attention backend is unavailable: {exc}") from exc
            return TorchAttentionBackend()
    from inflight.model.attention.triton import TritonAttentionBackend

    return TritonAttentionBackend(batch_invariant)
