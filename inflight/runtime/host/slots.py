"""Resident slots: stable rows handed out as `ResidentRef(slot, epoch)`."""

from __future__ import annotations

from inflight.protocol.stepped import ResidentRef, StaleResidentRef


class ResidentSlots:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"resident slot capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._epochs = [0] * capacity
        self._live = [False] * capacity

    @property
    def num_free(self) -> int:
        return self._live.count(False)

    def acquire(self) -> ResidentRef | None:
        """The lowest free slot with its epoch bumped, or None when every slot is live."""
        for slot, live in enumerate(self._live):
            if not live:
                self._live[slot] = True
                self._epochs[slot] += 1
                return ResidentRef(slot, self._epochs[slot])
        return None

    def check(self, ref: ResidentRef) -> None:
        if not (0 <= ref.slot < self.capacity and self._live[ref.slot]) or (
            self._epochs[ref.slot] != ref.epoch
        ):
            raise StaleResidentRef(f"{ref} does not name a live resident")

    def release(self, ref: ResidentRef) -> None:
        self.check(ref)
        self._live[ref.slot] = False
