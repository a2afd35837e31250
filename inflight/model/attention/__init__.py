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
BACKENDS = ("torch", "cpu", "triton")


def select_backend(
    name: str | None, device: torch.device, dtype: torch.dtype, head_dim: int
) -> AttentionBackend:
    """The named backend, or by default: triton on CUDA, cpu (its native decode kernel) for
    float32 on the CPU where it builds, else torch. A named backend that cannot run here is a
    ValueError; a default one that fails to build falls back to torch with a warning."""
    if name not in (None, *BACKENDS):
        raise ValueError(f"attention_backend must be torch, cpu or triton, got {name!r}")
    native_cpu = device.type == "cpu" and dtype == torch.float32 and head_dim % 8 == 0
    chosen = name or ("triton" if device.type == "cuda" else "cpu" if native_cpu else "torch")
    if chosen == "torch":
        return TorchAttentionBackend()
    if chosen == "cpu":
        if not native_cpu:
            raise ValueError(
                "the cpu attention backend runs float32 on the CPU with a head_dim multiple "
                f"of 8 only, got {dtype} on {device} with head_dim {head_dim}"
            )
        from inflight.model.attention.cpu import CpuAttentionBackend
        from inflight.model.kernels.cpu.native import NativeBuildError

        try:
            return CpuAttentionBackend()
        except NativeBuildError as exc:
            if name is not None:
                raise ValueError(f"the cpu attention backend is unavailable: {exc}") from exc
            return TorchAttentionBackend()
    if device.type != "cuda":
        raise ValueError("the triton attention backend needs a CUDA device")
    from inflight.model.attention.triton import TritonAttentionBackend

    return TritonAttentionBackend()
