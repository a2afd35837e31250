"""`RequestCoordinator`: the batch ledger, where a `StepResult` becomes fact."""

from __future__ import annotations

from dataclasses import dataclass

from inflight.engine.record import RequestRecord, TerminalStatus
from inflight.runtime.outputs import CompletionOutput, FinishReason
from inflight.runtime.stepped import ResidentRef, StaleResidentRef, SteppedExecution, StepResult


@dataclass(frozen=True)
class Outcome:
    record: RequestRecord
    status: TerminalStatus
    output: CompletionOutput | None = None
    error: str = ""


@dataclass(frozen=True)
class Commit:
    """What a committed step means for the requests: the record behind every delta (looked up
    before the finished ones left the ledger) and the outcomes of those that ended."""

    owners: dict[ResidentRef, RequestRecord]
    outcomes: list[Outcome]


class RequestCoordinator:
    """Resident slot -> (ref, record) for the running batch. Every lookup checks the epoch, so a
    stale ref fails loudly. It has no thread of its own: the actor calls it."""

    def __init__(self) -> None:
        self._table: dict[int, tuple[ResidentRef, RequestRecord]] = {}

    def __len__(self) -> int:
        return len(self._table)

    def add(self, ref: ResidentRef, record: RequestRecord) -> None:
        if ref.slot in self._table:
            raise StaleResidentRef(f"slot {ref.slot} already holds {self._table[ref.slot][0]}")
        self._table[ref.slot] = (ref, record)

    def owner(self, ref: ResidentRef) -> RequestRecord:
        entry = self._table.get(ref.slot)
        if entry is None or entry[0] != ref:
            raise StaleResidentRef(f"{ref} is not a resident of this batch")
        return entry[1]

    def residents(self) -> list[tuple[ResidentRef, RequestRecord]]:
        return list(self._table.values())

    def commit(self, result: StepResult, execution: SteppedExecution) -> Commit:
        """All or nothing: the first pass checks and materializes and may raise, leaving the
        ledger untouched; the second retires the finished and cannot raise."""
        owners = {ref: self.owner(ref) for ref in result.deltas}
        staged: list[tuple[ResidentRef, Outcome]] = []
        for ref, snapshot in result.finished.items():
            record = self.owner(ref)
            # Cancel wins, also over a sequence that finished on its own in the same step.
            if snapshot.finish_reason is FinishReason.CANCELLED or record.cancel_requested:
                outcome = Outcome(record, TerminalStatus.CANCELLED)
            elif snapshot.finish_reason is FinishReason.ERROR:
                outcome = Outcome(
                    record, TerminalStatus.FAILED, error="the sequence failed during generation"
                )
            else:
                outcome = Outcome(record, TerminalStatus.COMPLETED, execution.materialize(snapshot))
            staged.append((ref, outcome))
        for ref, _ in staged:
            del self._table[ref.slot]
        return Commit(owners, [outcome for _, outcome in staged])

    def retire_missing(self, live: list[ResidentRef]) -> list[RequestRecord]:
        """Records whose resident the execution no longer holds without having reported it."""
        alive = set(live)
        lost = [ref for ref, _ in self._table.values() if ref not in alive]
        return [self._table.pop(ref.slot)[1] for ref in lost]

    def take_all(self) -> list[RequestRecord]:
        records = [record for _, record in self._table.values()]
        self._table.clear()
        return records
