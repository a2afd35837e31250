"""`RequestCoordinator`: the batch ledger, where a `StepResult` becomes fact.

It decides what each request's stream and outcome get of a step: the chunks the step produced
(a sequence's terminal chunk stands only for a request that completes or runs on; a cancelled or
failed request's last chunks carry no end), and the outcome of each request whose last sequence
ended, materialized from the snapshots of all its sequences. It never calls the runtime."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from inflight.engine.record import RequestRecord, TerminalStatus
from inflight.protocol.outputs import (
    FinishedSnapshot,
    FinishReason,
    RequestOutput,
    StreamChunk,
    materialize,
)
from inflight.protocol.stepped import ResidentRef, StaleResidentRef, StepResult


@dataclass(frozen=True)
class Outcome:
    record: RequestRecord
    status: TerminalStatus
    output: RequestOutput | None = None
    error: str = ""


@dataclass(frozen=True)
class Commit:
    """What a committed step means for the requests: each request's chunks of the step (in
    the order of the step's deltas), and the outcomes of those that ended."""

    chunks: dict[int, tuple[RequestRecord, list[StreamChunk]]]  # by request id
    outcomes: list[Outcome]


class RequestCoordinator:
    """Resident slot -> (ref, record) for the running batch. Every lookup checks the epoch, so a
    stale ref fails loudly. It has no thread of its own: the actor calls it."""

    def __init__(self) -> None:
        self._table: dict[int, tuple[ResidentRef, RequestRecord]] = {}
        # Request id -> snapshots of its sequences that ended while others still run.
        self._waiting: dict[int, list[FinishedSnapshot]] = {}

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

    def commit(self, result: StepResult) -> Commit:
        """All or nothing: the first pass checks and materializes and may raise, leaving the
        ledger untouched; the second retires the finished and cannot raise.

        A request of n sequences has n residents; it ends at the step that evicts the last of
        them (the snapshots of the others wait here), and its outcome covers them all."""
        chunks: dict[int, tuple[RequestRecord, list[StreamChunk]]] = {}
        for ref, chunk in result.deltas.items():
            record = self.owner(ref)
            entry = chunks.get(record.id)
            if entry is None:
                chunks[record.id] = (record, [chunk])
            else:
                entry[1].append(chunk)
        ended: dict[int, tuple[RequestRecord, list[FinishedSnapshot]]] = {}
        for ref, snapshot in result.finished.items():
            record = self.owner(ref)
            ended.setdefault(record.id, (record, []))[1].append(snapshot)
        finished_slots = {ref.slot for ref in result.finished}
        # Residents each request keeps after this step: one still running makes it wait.
        running = (
            Counter(r.id for slot, (_, r) in self._table.items() if slot not in finished_slots)
            if ended
            else Counter()
        )
        outcomes: list[Outcome] = []
        waiting: list[tuple[RequestRecord, list[FinishedSnapshot]]] = []
        for record, snapshots in ended.values():
            if running[record.id]:
                waiting.append((record, snapshots))
                continue
            outcome = _outcome(record, self._waiting.get(record.id, []) + snapshots)
            outcomes.append(outcome)
            if outcome.status is not TerminalStatus.COMPLETED and record.id in chunks:
                # Its last chunks stand, but none ends a sequence: the request did not complete.
                chunks[record.id] = (record, [_unended(c) for c in chunks[record.id][1]])
        for slot in finished_slots:
            del self._table[slot]
        for record, snapshots in waiting:
            self._waiting.setdefault(record.id, []).extend(snapshots)
        for outcome in outcomes:
            self._waiting.pop(outcome.record.id, None)
        return Commit(chunks, outcomes)

    def retire_missing(self, live: list[ResidentRef]) -> list[RequestRecord]:
        """Records of which the execution no longer holds a resident without having reported
        it (each once, its other residents retired with it)."""
        alive = set(live)
        lost = {record.id: record for ref, record in self._table.values() if ref not in alive}
        return self._retire(lost)

    def take_all(self) -> list[RequestRecord]:
        return self._retire({record.id: record for _, record in self._table.values()})

    def _retire(self, records: dict[int, RequestRecord]) -> list[RequestRecord]:
        for slot in [s for s, (_, r) in self._table.items() if r.id in records]:
            del self._table[slot]
        for request_id in records:
            self._waiting.pop(request_id, None)
        return list(records.values())


def _outcome(record: RequestRecord, snapshots: list[FinishedSnapshot]) -> Outcome:
    """The outcome of a request whose every sequence ended: cancel wins, also over a sequence
    that finished on its own in the same step; then a failed sequence fails it."""
    reasons = {s.finish_reason for s in snapshots}
    if FinishReason.CANCELLED in reasons or record.cancel_requested:
        return Outcome(record, TerminalStatus.CANCELLED)
    failed = [s for s in snapshots if s.finish_reason is FinishReason.ERROR]
    if failed:
        error = next((s.error for s in failed if s.error), "a sequence failed during generation")
        return Outcome(record, TerminalStatus.FAILED, error=error)
    return Outcome(record, TerminalStatus.COMPLETED, materialize(snapshots))


def _unended(chunk: StreamChunk) -> StreamChunk:
    if not chunk.finished:
        return chunk
    return replace(chunk, finished=False, finish_reason=None)
