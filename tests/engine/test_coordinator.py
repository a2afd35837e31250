"""RequestCoordinator: two-pass all-or-nothing commits and stale-ref checks."""

import pytest

from inflight.engine import coordinator
from inflight.engine.channel import StreamChannel
from inflight.engine.coordinator import RequestCoordinator
from inflight.engine.record import RequestRecord, TerminalStatus
from inflight.protocol.outputs import FinishedSnapshot, FinishReason, StreamChunk, materialize
from inflight.protocol.request import GenerationRequest
from inflight.protocol.stepped import ResidentRef, StaleResidentRef, StepResult


class Materializer:
    """`outputs.materialize` as the coordinator calls it, watched (and failing on a token list)."""

    def __init__(self, fail_on=None):
        self.fail_on = fail_on
        self.calls = []

    def __call__(self, snapshots):
        self.calls.append([s.token_ids for s in snapshots])
        if any(s.token_ids == self.fail_on for s in snapshots):
            raise RuntimeError("materialize failed")
        return materialize(snapshots)


@pytest.fixture
def materializer(monkeypatch):
    def watch(fail_on=None):
        watching = Materializer(fail_on)
        monkeypatch.setattr(coordinator, "materialize", watching)
        return watching

    return watch


def _record(i):
    return RequestRecord(i, GenerationRequest([1]), StreamChannel())


def _snap(tokens, reason=FinishReason.LENGTH, index=0):
    return FinishedSnapshot(GenerationRequest([1]), tokens, "t", reason, None, index=index)


def _ledger():
    ledger = RequestCoordinator()
    refs = [ResidentRef(0, 1), ResidentRef(1, 1), ResidentRef(2, 1)]
    records = [_record(i + 1) for i in range(3)]
    for ref, record in zip(refs, records, strict=True):
        ledger.add(ref, record)
    return ledger, refs, records


def test_commit_retires_the_finished_and_keeps_survivors():
    ledger, refs, records = _ledger()
    outcomes = ledger.commit(StepResult(1, finished={refs[1]: _snap([5])})).outcomes
    assert [o.record for o in outcomes] == [records[1]]
    assert outcomes[0].status is TerminalStatus.COMPLETED and outcomes[0].output.token_ids == (5,)
    assert [r for _, r in ledger.residents()] == [records[0], records[2]]


def test_cancelled_and_errored_are_never_materialized(materializer):
    ledger, refs, records = _ledger()
    m = materializer()
    records[2].channel.cancel()  # a cancel that landed while the step finished it naturally
    outcomes = ledger.commit(
        StepResult(
            1,
            finished={
                refs[0]: _snap([1], FinishReason.CANCELLED),
                refs[1]: _snap([2], FinishReason.ERROR),
                refs[2]: _snap([3]),
            },
        ),
    ).outcomes
    assert [o.status for o in outcomes] == [
        TerminalStatus.CANCELLED,
        TerminalStatus.FAILED,
        TerminalStatus.CANCELLED,
    ]
    assert m.calls == []
    assert len(ledger) == 0


def test_commit_is_all_or_nothing_when_materialize_throws(materializer):
    ledger, refs, _ = _ledger()
    materializer(fail_on=[2])
    with pytest.raises(RuntimeError):
        ledger.commit(StepResult(1, finished={refs[0]: _snap([1]), refs[1]: _snap([2])}))
    assert len(ledger) == 3


def test_stale_epoch_ref_throws_without_touching_the_table():
    ledger, refs, _ = _ledger()
    with pytest.raises(StaleResidentRef):
        ledger.commit(StepResult(1, finished={ResidentRef(0, 2): _snap([1])}))
    with pytest.raises(StaleResidentRef):
        ledger.owner(ResidentRef(1, 0))
    assert len(ledger) == 3


def test_a_request_of_several_sequences_ends_with_its_last_one(materializer):
    """Its outcome waits for every sequence, covers them all, and leaves with the last."""
    ledger = RequestCoordinator()
    record, other = _record(1), _record(2)
    refs = [ResidentRef(0, 1), ResidentRef(1, 1), ResidentRef(2, 1)]
    ledger.add(refs[0], record)
    ledger.add(refs[1], record)
    ledger.add(refs[2], other)
    m = materializer()
    first = ledger.commit(StepResult(1, finished={refs[1]: _snap([7, 8], index=1)}))
    assert first.outcomes == [] and m.calls == [] and len(ledger) == 2
    last = ledger.commit(StepResult(2, finished={refs[0]: _snap([5])})).outcomes
    assert [o.record for o in last] == [record] and last[0].status is TerminalStatus.COMPLETED
    assert [s.token_ids for s in last[0].output.outputs] == [(5,), (7, 8)]
    assert [r for _, r in ledger.residents()] == [other]


def test_a_cancel_of_one_sequence_cancels_the_request():
    ledger = RequestCoordinator()
    record = _record(1)
    refs = [ResidentRef(0, 1), ResidentRef(1, 1)]
    for ref in refs:
        ledger.add(ref, record)
    assert ledger.commit(StepResult(1, finished={refs[0]: _snap([1])})).outcomes == []
    (outcome,) = ledger.commit(
        StepResult(2, finished={refs[1]: _snap([2], FinishReason.CANCELLED, 1)})
    ).outcomes
    assert outcome.status is TerminalStatus.CANCELLED and len(ledger) == 0


def test_lost_and_taken_records_count_once_however_many_sequences():
    ledger = RequestCoordinator()
    record = _record(1)
    for slot in range(3):
        ledger.add(ResidentRef(slot, 1), record)
    assert ledger.retire_missing([ResidentRef(0, 1)]) == [record] and len(ledger) == 0


def test_a_terminal_chunk_stands_only_for_a_request_that_completes():
    """Cancel wins over a sequence that ended on its own in the same step: the request's last
    chunk still reaches its stream, but without an end; a completed request's keeps its end."""
    ledger, refs, records = _ledger()
    records[0].channel.cancel()

    def ending(token):
        return StreamChunk([token], f"<{token}>", finished=True, finish_reason="stop")

    committed = ledger.commit(
        StepResult(
            1,
            deltas={refs[0]: ending(1), refs[1]: ending(2)},
            finished={refs[0]: _snap([1], FinishReason.STOP), refs[1]: _snap([2])},
        )
    )
    (cancelled,) = committed.chunks[records[0].id][1]
    (completed,) = committed.chunks[records[1].id][1]
    assert cancelled.token_ids == [1] and not cancelled.finished and cancelled.finish_reason is None
    assert completed.finished and completed.finish_reason == "stop"


def test_a_failed_sequence_names_why_in_its_requests_outcome():
    ledger, refs, records = _ledger()
    failed = FinishedSnapshot(
        GenerationRequest([1]), [], "", FinishReason.ERROR, None, error="its image broke"
    )
    (outcome,) = ledger.commit(StepResult(1, finished={refs[0]: failed})).outcomes
    assert outcome.status is TerminalStatus.FAILED and outcome.error == "its image broke"
