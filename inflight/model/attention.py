"""Paged attention over a ragged batch, behind a backend interface.

A step packs the new tokens of every sequence into one flat run of T tokens. Decode rows (one
query token each) come first, then prefill chunks; `AttentionMetadata` says where each sequence's
queries start, how much of it is already in the KV cache, which KV blocks hold it and where each
new token's key and value go. The KV cache of one layer is a pair of tensors shaped
[num_blocks, block_size, num_kv_heads, head_dim]; a token's slot is block * block_size + offset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    query_start_loc: (
        torch.Tensor
    )  # [B + 1] int32: offsets of each sequence's queries in the packed run
    seq_lens: torch.Tensor  # [B] int32: past + query length, the keys each sequence attends over
    block_tables: torch.Tensor  # [B, max_blocks] int32: the KV blocks of each sequence, in order
    slot_mapping: torch.Tensor  # [T] int64: the KV slot each packed token writes
    num_decodes: int  # the first rows have exactly one query token each
    max_query_len: int
    max_seq_len: int
    # Host copies, so that a backend needing Python ints never waits on the device.
    query_lens_host: list[int]
    seq_lens_host: list[int]


KVCache = tuple[torch.Tensor, torch.Tensor]


class AttentionBackend(Protocol):
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Store k, v [T, Hkv, D] at meta.slot_mapping, then attend q [T, Hq, D] -> [T, Hq, D]."""
        ...


class TorchAttentionBackend:
    """The reference backend: plain torch ops, runs anywhere, used on CPU and as the test oracle."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale)
        start = nd
        for row in range(nd, len(meta.query_lens_host)):
            qlen, seq_len = meta.query_lens_host[row], meta.seq_lens_host[row]
            blocks = meta.block_tables[row, : -(-seq_len // block_size)]
            keys = k_cache[blocks].flatten(0, 1)[:seq_len]
            values = v_cache[blocks].flatten(0, 1)[:seq_len]
            out[start : start + qlen] = _attend(
                q[start : start + qlen], keys, values, seq_len - qlen, scale
            )
            start += qlen
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        # One padded SDPA call for all decode rows; keys past each row's length are masked out.
        nd = q.shape[0]
        block_size = k_cache.shape[1]
        max_len = max(meta.seq_lens_host[:nd])
        blocks = meta.block_tables[:nd, : -(-max_len // block_size)]
        keys = k_cache[blocks].flatten(1, 2).transpose(1, 2)  # [nd, Hkv, L, D]
        values = v_cache[blocks].flatten(1, 2).transpose(1, 2)
        length = keys.shape[2]
        mask = torch.arange(length, device=q.device) < meta.seq_lens[:nd, None].to(q.device)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [nd, Hq, 1, D]
            keys,
            values,
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(2)


def _attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, past: int, scale: float
) -> torch.Tensor:
    """Causal attention of q [Q, Hq, D] over keys/values [past + Q, Hkv, D]."""
    qlen, seq_len = q.shape[0], keys.shape[0]
    if past == 0:
        mask, causal = None, True
    else:
        rows = torch.arange(qlen, device=q.device)[:, None] + past
        mask, causal = torch.arange(seq_len, device=q.device)[None, :] <= rows, False
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        keys.transpose(0, 1),
        values.transpose(0, 1),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)
