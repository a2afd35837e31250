"""The paged KV cache: per-layer block tensors and the pool that hands their blocks out."""

from __future__ import annotations

import torch

from inflight.model.attention import AttentionBackend, KVCache
from inflight.model.config import ModelConfig


class BlockPool:
    """Free-list bookkeeping of KV blocks; a block belongs to at most one resident at a time.

    Allocation prefers one contiguous run of blocks (first fit), which lets the CPU attention
    backend read a sequence's KV in place; any free blocks do when no run is long enough.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: set[int] = set(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, count: int) -> list[int] | None:
        """`count` blocks, or None (and nothing taken) when fewer are free."""
        if count > len(self._free):
            return None
        free = sorted(self._free)
        blocks = next(
            (
                free[i : i + count]
                for i in range(len(free) - count + 1)
                if free[i + count - 1] - free[i] == count - 1
            ),
            free[:count],
        )
        self._free.difference_update(blocks)
        return blocks

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            if block in self._free or not 0 <= block < self.num_blocks:
                raise RuntimeError(f"KV block {block} released twice")
            self._free.add(block)


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
) -> list[KVCache]:
    shape = backend.kv_cache_shape(num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(config.num_layers)
    ]
