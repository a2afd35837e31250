"""How a step's decode rows are planned and their picks taken in (torch-free): one token per
row here; with drafts in `speculative.py`. The scheduler, the output processor and the session
each ask the runtime's `Decoding` instead of branching on speculative decoding."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from inflight.runtime.host.residents import Resident
from inflight.runtime.host.rows import SampledRow, ScheduledRow, ScheduledStep, plain_decode_rows


class Decoding(Protocol):
    # Picks kept on the device per resident slot (a step's rows read their input token there).
    pick_width: int

    def plan(self, decodes: list[Resident], budget: int) -> tuple[list[ScheduledRow], int]:
        """The step's decode rows for residents whose prompt is computed, committed (rows of
        one query token first), and what they leave of the token budget."""
        ...

    def take(
        self, row: ScheduledRow, picks: Sequence[SampledRow]
    ) -> tuple[Sequence[SampledRow], int] | None:
        """A completed row's picks taken in (no longer pending on the device): the tokens it
        emits and how many of its query tokens' KV it gives back; None where the row no longer
        stands (planned on what turned out otherwise)."""
        ...

    def waits(self, inflight: ScheduledStep, residents: Iterable[Resident]) -> bool:
        """Whether the step in flight must be taken in before the next one is planned."""
        ...


class PlainDecoding:
    """One token per decode row; its pick is its token."""

    pick_width = 1

    def plan(self, decodes: list[Resident], budget: int) -> tuple[list[ScheduledRow], int]:
        return plain_decode_rows(decodes), budget

    def take(
        self, row: ScheduledRow, picks: Sequence[SampledRow]
    ) -> tuple[Sequence[SampledRow], int]:
        row.resident.pending -= len(picks)
        return picks, 0

    def waits(self, inflight: ScheduledStep, residents: Iterable[Resident]) -> bool:
        return False
