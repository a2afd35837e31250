"""`EncoderCache`: encoder outputs kept by content key, so a repeated image is encoded once.

Least recently used entries go first once the cache holds more than `capacity_bytes`; an
output larger than the whole capacity is not kept. A resident holds its own references to the
outputs it reads, so eviction never takes an embedding from under a prefill.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class EncoderMetrics:
    runs: int = 0  # items encoded
    hits: int = 0  # items found in the cache (not encoded)


class EncoderCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.metrics = EncoderMetrics()

    def get(self, key: bytes) -> torch.Tensor | None:
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
            self.metrics.hits += 1
        return found

    def put(self, key: bytes, output: torch.Tensor) -> None:
        """Keep the output of an item just encoded (counted as an encoder run)."""
        self.metrics.runs += 1
        size = _bytes(output)
        if key in self._entries or size > self.capacity_bytes:
            return
        if output._base is not None:
            # A view of a step's whole encoder output would keep all of it alive (and uncounted).
            output = output.clone()
        while self.used_bytes + size > self.capacity_bytes:
            _, old = self._entries.popitem(last=False)
            self.used_bytes -= _bytes(old)
        self._entries[key] = output
        self.used_bytes += size

    def snapshot(self) -> dict[str, float]:
        return {
            "encoder_runs": self.metrics.runs,
            "encoder_cache_hits": self.metrics.hits,
            "encoder_cache_items": len(self._entries),
            "encoder_cache_bytes": self.used_bytes,
        }


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
