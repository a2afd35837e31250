"""`EngineMetrics`: the engine's counters, each read on its own (not one atomic snapshot)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass
class EngineMetrics:
    submitted: int = 0  # accepted by submit()
    refused: int = 0  # refused with SubmitError (permanent refusals count in neither)
    stalls_incompatible: int = 0  # ticks on which the queue head could not join, by reason
    stalls_no_capacity: int = 0
    admitted_mid_flight: int = 0  # joiners (founders excluded)
    steps: int = 0  # ticks that ran a step of the execution
    completed: int = 0  # outcomes: exactly one per accepted request
    cancelled: int = 0
    failed: int = 0
    queue_latency_total_us: int = 0  # submit -> the actor starts serving it
    queue_latency_max_us: int = 0
    queue_latency_count: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + amount)

    def record_queue_latency(self, microseconds: int) -> None:
        with self._lock:
            self.queue_latency_total_us += microseconds
            self.queue_latency_count += 1
            self.queue_latency_max_us = max(self.queue_latency_max_us, microseconds)

    def snapshot(self) -> dict[str, int]:
        """Every counter, plus `queue_latency_avg_us` (integer microseconds, 0 without samples)."""
        with self._lock:
            values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "_lock"}
        count = values["queue_latency_count"]
        values["queue_latency_avg_us"] = values["queue_latency_total_us"] // count if count else 0
        return values
