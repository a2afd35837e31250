"""`AdapterRegistry`: the LoRA adapters a runtime serves, and the model slots they run in
(torch-free: it is handed what reads an adapter and what writes a slot).

Adapters are registered by name (read and validated at once: a bad one is refused with its
reason and changes nothing). A request names its adapter; when it is seated the adapter gets a
slot: its own if loaded, else a free one, else the least recently used one no resident runs
with. When every slot runs an adapter some resident uses, the request waits (NO_CAPACITY). Slots
are written only by `acquire`, on the thread that steps the model, never during a forward pass.
As a per-row feature it checks a request's adapter, reserves its slot at admission, and gives
each of its residents that slot.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inflight.protocol.request import GenerationRequest, RequestFieldError
from inflight.runtime.host.features import RowFeature
from inflight.runtime.host.residents import Resident


@dataclass
class _Adapter:
    name: str
    path: str
    weights: Any  # as the loader read it
    slot: int | None = None
    users: int = 0  # residents running with it
    last_used: int = 0


class AdapterRegistry(RowFeature):
    def __init__(
        self,
        max_loras: int,
        read: Callable[[str], Any],
        write_slot: Callable[[int, Any], None],
    ) -> None:
        self.max_loras = max_loras
        self._read = read
        self._write_slot = write_slot
        self._adapters: dict[str, _Adapter] = {}
        self._slots: list[_Adapter | None] = [None] * max_loras
        self._clock = 0
        self._lock = threading.Lock()

    def register(self, name: str, path: str) -> None:
        """Serve the adapter at `path` as `name`; ValueError naming what is wrong with it."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a LoRA adapter needs a non-empty name, got {name!r}")
        weights = self._read(str(path))
        with self._lock:
            if name in self._adapters:
                raise ValueError(f"a LoRA adapter named {name!r} is already served")
            self._adapters[name] = _Adapter(name, str(path), weights)

    def unregister(self, name: str) -> None:
        """Stop serving an adapter; residents running with it finish with it."""
        with self._lock:
            if self._adapters.pop(name, None) is None:
                raise KeyError(name)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._adapters)

    def known(self, name: str) -> bool:
        with self._lock:
            return name in self._adapters

    def acquire(self, name: str, users: int = 1) -> int | None:
        """The slot `users` new residents of adapter `name` run in (loading it there if
        needed), or None when every slot runs an adapter in use (nothing changed)."""
        with self._lock:
            adapter = self._adapters.get(name)
            if adapter is None:
                raise KeyError(name)
            self._clock += 1
            if adapter.slot is None:
                slot = self._free_slot()
                if slot is None:
                    return None
                evicted = self._slots[slot]
                if evicted is not None:
                    evicted.slot = None
                self._write_slot(slot, adapter.weights)
                self._slots[slot] = adapter
                adapter.slot = slot
            adapter.users += users
            adapter.last_used = self._clock
            return adapter.slot

    def release(self, slot: int) -> None:
        """A resident that ran in `slot` is done."""
        with self._lock:
            adapter = self._slots[slot]
            assert adapter is not None and adapter.users > 0
            adapter.users -= 1

    def _free_slot(self) -> int | None:
        empty = next((i for i, a in enumerate(self._slots) if a is None), None)
        if empty is not None:
            return empty
        # Unregistered adapters no one uses any more go first, then the least recently used.
        idle = [
            (a.name in self._adapters, a.last_used, i)
            for i, a in enumerate(self._slots)
            if a and not a.users
        ]
        return min(idle)[2] if idle else None

    # -- as a per-row feature ------------------------------------------------------------------

    def check(self, request: GenerationRequest) -> None:
        name = request.lora_name
        if name is not None and not self.known(name):
            raise RequestFieldError(
                f"unknown LoRA adapter {name!r}; served: {self.names()}", "lora_name"
            )

    def reserve(self, request: GenerationRequest, sequences: int) -> int | None:
        """The slot the request's residents run in (-1: the base model)."""
        name = request.lora_name
        if name is None:
            return -1
        try:
            return self.acquire(name, users=sequences)
        except KeyError as exc:  # unregistered since it was checked
            raise ValueError(f"LoRA adapter {exc} is no longer served") from exc

    def unreserve(self, request: GenerationRequest, sequences: int, held: object) -> None:
        assert isinstance(held, int)
        if held >= 0:
            for _ in range(sequences):
                self.release(held)

    def seat(self, resident: Resident, held: object) -> None:
        assert isinstance(held, int)
        resident.features.adapter = held

    def evict(self, resident: Resident) -> None:
        if resident.features.adapter >= 0:
            self.release(resident.features.adapter)
