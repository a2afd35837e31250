"""The CUDA attention backend: Triton kernels (`kernels/triton/attention.py`) over the paged KV
cache.

Cache layout: [num_blocks, block_size, num_kv_heads, head_dim] per layer (a block holds every
head's keys for `block_size` consecutive positions). Decode rows go to a kernel with one program
per (row, KV head), the rows taken longest first; prefill chunks to one with a program per
(BLOCK_M queries, query head). Both are planned once per step (`kernels/triton/plan.py`).
`forward_qkv` takes a layer's fused projection instead of its rotated q and k: one kernel norms
and rotates them and stores k, v.
"""

from __future__ import annotations

import torch

from inflight.model.kernels.triton.attention import paged_attention
from inflight.model.kernels.triton.plan import plan_step
from inflight.model.kernels.triton.rope import cache_max, rope_store
from inflight.model.layers.rotary import Angles
from inflight.model.metadata import AttentionMetadata, KVCache, QKNorms


class TritonAttentionBackend:
    """Paged attention for CUDA devices (bf16 or fp16 caches, or float8 e4m3: kv_cache_dtype).
    `batch_invariant`: a decode row's keys are never split, so its reduction order is the same
    whatever else the step holds (the parts are otherwise chosen by the step's row count)."""

    takes_qkv = True

    def __init__(self, batch_invariant: bool = False) -> None:
        self.splits = 1 if batch_invariant else None

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def plan(self, meta: AttentionMetadata) -> None:
        meta.plan = plan_step(
            meta.query_lens_host, meta.num_decodes, meta.seq_lens, meta.slot_mapping.device
        )

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
        k_cache, v_cache = kv_cache
        _, _, num_kv_heads, head_dim = k_cache.shape
        for x, cache in ((k, k_cache), (v, v_cache)):
            bound = cache_max(cache.dtype)
            if bound:  # float8: clamped, and copied as bytes (index_copy_ has no float8 kernel)
                x = x.clamp(-bound, bound).to(cache.dtype).view(torch.uint8)
                cache = cache.view(torch.uint8)
            cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, x)
        return paged_attention(
            q, k_cache, v_cache, meta, scale, self.splits, window=window, sinks=sinks
        )

    def forward_qkv(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        angles: Angles,
        norms: QKNorms | None,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        q = rope_store(
            qkv, num_heads, k_cache.shape[2], angles, meta.slot_mapping, k_cache, v_cache, norms
        )
        return paged_attention(
            q, k_cache, v_cache, meta, scale, self.splits, window=window, sinks=sinks
        )
