"""Paged attention over a ragged batch (see `model/metadata.py`), behind a backend interface."""

from __future__ import annotations

from typing import Protocol

import torch

from inflight.model.metadata import AttentionMetadata, KVCache


class AttentionBackend(Protocol):
    # With takes_qkv, a backend also has `forward_qkv(qkv, num_heads, angles, norms, kv_cache,
    # meta, scale, window=None, sinks=None)`: `forward` from a layer's fused projection qkv
    # [T, (Hq + 2 Hkv) * D], its q and k normed (`norms`, QKNorms or None) and rotated (RoPE
    # over whole heads) on the way.
    takes_qkv: bool

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """The shape of one layer's key (and value) cache tensor."""
        ...

    def plan(self, meta: AttentionMetadata) -> None:
        """Derive, once per step, what every layer's `forward` needs (kept in `meta.plan`)."""
        ...

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
        """Store k, v [T, Hkv, D] at meta.slot_mapping, then attend q [T, Hq, D] -> [T, Hq, D];
        with a `window` (the layer's), a query at position p sees keys p - window + 1 .. p, and
        no block before the window of a row's first query is read (it may have been given
        back); with `sinks` [Hq] (float32, gpt-oss), each head's logit joins its softmaxes as
        one more score that weights no value."""
        ...
