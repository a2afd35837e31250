"""A bounded map whose least recently used entry goes first: the server's in-memory stores
(stored responses, conversations, message threads) each hold one."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

V = TypeVar("V")


class Lru(Generic[V]):
    """At most `capacity` entries; `get` and `put` make an entry the most recently used."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, V] = OrderedDict()

    def get(self, key: str) -> V | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: str, value: V) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def delete(self, key: str) -> bool:
        """Whether there was an entry `key` to delete."""
        return self._entries.pop(key, None) is not None
