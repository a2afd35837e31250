"""The blocking path: one request served alone on the caller's thread (torch-free)."""

from __future__ import annotations

from collections.abc import Iterator

from inflight.runtime.outputs import CompletionOutput, FinishedSnapshot, StreamChunk, materialize
from inflight.runtime.request import GenerationRequest
from inflight.runtime.stepped import AdmissionAnswer, SteppedExecution


class BlockingRun:
    """Iterate for the request's chunks; `snapshot` and `output` are set before the last one is
    yielded.

    The request is admitted on construction, so a rejected one raises ValueError at once. Stopping
    early (closing the iterator, or `close()`) cancels the request and frees what it held.
    """

    def __init__(self, session: SteppedExecution, request: GenerationRequest) -> None:
        self._session = session
        admission = session.admit(request)
        if admission.answer is not AdmissionAnswer.ADMITTED:
            session.finish()
            raise ValueError(admission.reason)
        assert admission.ref is not None
        self._ref = admission.ref
        self.snapshot: FinishedSnapshot | None = None
        self.output: CompletionOutput | None = None
        self._closed = False

    def __iter__(self) -> Iterator[StreamChunk]:
        try:
            while self.snapshot is None:
                result = self._session.step()
                if self._ref in result.finished:
                    self.snapshot = result.finished[self._ref]
                    self.output = materialize(self.snapshot)
                if self._ref in result.deltas:
                    yield result.deltas[self._ref]
        finally:
            self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.snapshot is None:
            self._session.abort()
        self._session.finish()

    def result(self) -> CompletionOutput:
        for _ in self:
            pass
        assert self.output is not None
        return self.output
