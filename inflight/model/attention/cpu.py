"""The CPU attention backend: decode rows in one native call per layer (kernels/cpu).

Per-row torch attention spends ~80 us per call in dispatch alone, which at batch 16 and 30
layers is 480 calls a step; the kernel attends every decode row in one call, reading each key
and value once per GQA group. Prefill chunks go through the reference path, where one call per
chunk is cheap against its compute. The cache layout is the reference backend's.
"""

from __future__ import annotations

import torch

from inflight.model.attention.reference import TorchAttentionBackend
from inflight.model.kernels.cpu.attention import decode_attention, library, store_kv
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
    ) -> torch.Tensor:
        store_kv(self.library, k, v, kv_cache, meta)
        out = torch.empty(q.shape, dtype=q.dtype)
        if meta.num_decodes:
            decode_attention(self.library, q, kv_cache, meta, scale, out)
        if meta.num_decodes < len(meta.query_lens_host):
            self.attend_rows(q, kv_cache, meta, scale, out, meta.num_decodes)
        return out
