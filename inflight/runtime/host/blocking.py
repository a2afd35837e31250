"""The blocking path: one request served alone in a generation session of its own
(torch-free)."""

from __future__ import annotations

from collections.abc import Collection, Iterator

from inflight.protocol.outputs import FinishedSnapshot, RequestOutput, StreamChunk, materialize
from inflight.protocol.request import GenerationRequest
from inflight.protocol.stepped import (
    Admission,
    AdmissionAnswer,
    ResidentRef,
    SteppedExecution,
    StepResult,
)


class BlockingRun:
    """At most one request (its n sequences) in a session of its own. The engine drives it as
    the `SteppedExecution` of a batch of one, so callers submit, stream, cancel and shut down
    exactly as under in-flight batching; `Runtime.handle_request` hands one out with its request
    admitted, for a caller's own thread: iterating yields its chunks step by step, `result()`
    runs it to the end. `output` is set once every sequence has finished (before the last chunk
    is yielded). Stopping early (closing the iterator, or `close()`) cancels the request and
    frees what it held."""

    def __init__(self, session: SteppedExecution) -> None:
        self._session = session
        self.refs: tuple[ResidentRef, ...] = ()
        self._live: set[ResidentRef] = set()
        self._snapshots: list[FinishedSnapshot] = []
        self.output: RequestOutput | None = None
        self._closed = False

    # -- SteppedExecution -----------------------------------------------------------------------

    def residents(self) -> list[ResidentRef]:
        """Its sequences still running."""
        return [ref for ref in self.refs if ref in self._live]

    def admit(self, request: GenerationRequest) -> Admission:
        if self.refs:
            return Admission(
                AdmissionAnswer.NO_CAPACITY, reason="the blocking path serves one request"
            )
        admission = self._session.admit(request)
        if admission.answer is AdmissionAnswer.ADMITTED:
            self.refs = admission.refs
            self._live = set(admission.refs)
        return admission

    def step(self, cancelled: Collection[ResidentRef] = ()) -> StepResult:
        """One step of the session; the output is set at the step that ends its last sequence."""
        if not self._live:
            return StepResult(0)
        result = self._session.step(cancelled)
        for ref, snapshot in result.finished.items():
            self._live.discard(ref)
            self._snapshots.append(snapshot)
        if not self._live and self.output is None:
            self.output = materialize(self._snapshots)
        return result

    def finish(self) -> None:
        if self._live:
            raise RuntimeError("finish() with its request still live")
        self.close()

    def abort(self) -> list[ResidentRef]:
        refs = self.residents()
        self.close()
        return refs

    # -- on a caller's thread -------------------------------------------------------------------

    def __iter__(self) -> Iterator[StreamChunk]:
        try:
            while self._live:
                result = self.step()
                yield from (result.deltas[ref] for ref in self.refs if ref in result.deltas)
        finally:
            self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._live:
            self._session.abort()
            self._live.clear()
        self._session.finish()

    def result(self) -> RequestOutput:
        for _ in self:
            pass
        assert self.output is not None
        return self.output
