"""The CPU attention backend: every row of a step in one native call per layer (kernels/cpu).

Per-row torch attention spends ~80 us per call in dispatch alone, which at batch 16 and 30
layers is 480 calls a step; the kernel attends every row in one call, reading each key and value
once per GQA group. It computes each prefill token as the decode row of that token would be
computed: torch's fused attention picks its blocking, masking and kernel by the chunk's shape, so
a token's bits there depend on how its prompt was split (a prefix read from the context cache
against the whole prompt prefilled), and a quantized model's per-token int8 activations turn a
last-bit difference into a different token. The cache layout is the reference backend's.
"""

from __future__ import annotations

import torch

from inflight.model.attention.reference import TorchAttentionBackend
from inflight.model.kernels.cpu.attention import library, paged_attention, store_kv
from inflight.model.metadata import AttentionMetadata, KVCache


class CpuAttentionBackend(TorchAttentionBackend):
    """float32 only; building the kernel happens at construction, so a failure shows there."""

    def __init__(self) -> None:
        self.library = library()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        store_kv(self.library, k, v, kv_cache, meta)
        out = torch.empty(q.shape, dtype=q.dtype)
        paged_attention(self.library, q, kv_cache, meta, scale, out, window, sinks)
        return out
