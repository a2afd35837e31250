"""What a step's attention reads beside its tokens: the metadata of a ragged batch, and the
shapes of a layer's KV cache and q/k norms. Plain data that the attention backends, the
kernels and the layers share, so that none of them imports another for it.

A step packs the new tokens of every sequence into one flat run of T tokens. Decode rows (one
query token each) come first, then prefill chunks; `AttentionMetadata` says where each sequence's
queries start, how much of it is already in the KV cache, which KV blocks hold it and where each
new token's key and value go. A token's KV slot is block * block_size + offset; how a layer's
cache tensors are laid out is the attention backend's choice (`kv_cache_shape`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: (
        torch.Tensor
    )  # [B + 1] int32: offsets of each sequence's queries in the packed run
    seq_lens: torch.Tensor  # [B] int32: past + query length, the keys each sequence attends over
    block_tables: torch.Tensor  # [B, max_blocks] int32: the KV blocks of each sequence, in order
    slot_mapping: torch.Tensor  # [T] int64: the KV slot each packed token writes
    num_decodes: int  # the first rows have exactly one query token each
    block_size: int
    max_query_len: int
    max_seq_len: int
    # Host copies, so that a backend needing Python ints never waits on the device.
    query_lens_host: list[int]
    seq_lens_host: list[int]
    # Per sequence: the first KV slot when its blocks form one contiguous run, else None.
    contiguous_kv_host: list[int | None]
    # What the backend derived from the rest, once per step (see AttentionBackend.plan).
    plan: Any = None
    # Where the sliding layers' KV is in a pool of its own (a model whose layers only partly
    # slide): the same step over their block tables and slots, which those layers read.
    window: AttentionMetadata | None = None

    def for_window(self, window: int | None) -> AttentionMetadata:
        """The metadata a layer with attention window `window` (None: full) reads."""
        if window is None or self.window is None:
            return self
        self.window.plan = self.plan
        return self.window


KVCache = tuple[torch.Tensor, torch.Tensor]
# Per-head RMSNorm of queries and keys before RoPE (Qwen3): their weights [D] and epsilon.
QKNorms = tuple[torch.Tensor, torch.Tensor, float]
