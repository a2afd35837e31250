"""The blocking path on a caller's own thread: one request served alone in a generation
session of its own (torch-free). The engine's blocking path is the same thing driven by the
actor: batches of one request (`LLM` without in-flight batching)."""

from __future__ import annotations

from collections.abc import Collection, Iterator

from inflight.protocol.outputs import FinishedSnapshot, RequestOutput, StreamChunk, materialize
from inflight.protocol.request import GenerationRequest
from inflight.protocol.stepped import AdmissionAnswer, ResidentRef, SteppedExecution, StepResult


class BlockingRun:
    """A request alone in a session of its own: `step()` runs one step of it, iterating yields
    its chunks step by step; `output` is set once every sequence has finished (before the last
    chunk is yielded).

    The request is admitted on construction, so a rejected one raises ValueError at once.
    Stopping early (closing the iterator, or `close()`) cancels the request and frees what it
    held.
    """

    def __init__(self, session: SteppedExecution, request: GenerationRequest) -> None:
        self._session = session
        admission = session.admit(request)
        if admission.answer is not AdmissionAnswer.ADMITTED:
            session.finish()
            raise ValueError(admission.reason)
        self.refs = admission.refs
        self._live = set(self.refs)
        self._snapshots: list[FinishedSnapshot] = []
        self.output: RequestOutput | None = None
        self._closed = False

    @property
    def residents(self) -> list[ResidentRef]:
        """Its sequences still running."""
        return [ref for ref in self.refs if ref in self._live]

    def step(self, cancelled: Collection[ResidentRef] = ()) -> StepResult:
        """One step of the session; the output is set at the step that ends its last sequence."""
        result = self._session.step(cancelled)
        for ref, snapshot in result.finished.items():
            self._live.discard(ref)
            self._snapshots.append(snapshot)
        if not self._live and self.output is None:
            self.output = materialize(self._snapshots)
        return result

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
