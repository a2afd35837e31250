"""`BlockingPath`: the runtime's blocking path behind the engine's interface.

Every batch is one request, served whole by the runtime's `handle_request` and advanced one
chunk per tick, so callers submit, stream, cancel and shut down exactly as under in-flight
batching, and every invariant of the actor (one outcome per request, cancel within a tick,
drain on shutdown) holds for the blocking path too. No request option is refused for the sake of
in-flight batching: what the runtime does not serve, its own check refuses.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import Protocol

from inflight.runtime.blocking import BlockingRun
from inflight.runtime.outputs import (
    CompletionOutput,
    FinishedSnapshot,
    FinishReason,
    StreamChunk,
    materialize,
)
from inflight.runtime.request import GenerationRequest
from inflight.runtime.stepped import (
    Admission,
    AdmissionAnswer,
    ExecutionCapabilities,
    ResidentRef,
    StepResult,
)


class BlockingRuntime(Protocol):
    def handle_request(self, request: GenerationRequest) -> BlockingRun: ...


class BlockingPath:
    """An `ExecutionFactory` over a runtime's blocking path."""

    capabilities = ExecutionCapabilities(
        stepped=True, seated_admission=False, max_batch_size=1, blocking_path=True
    )

    def __init__(self, runtime: BlockingRuntime) -> None:
        self.runtime = runtime

    def new_session(self) -> OneRequest:
        return OneRequest(self.runtime)


class OneRequest:
    """A `SteppedExecution` holding at most one request: its blocking run."""

    def __init__(self, runtime: BlockingRuntime) -> None:
        self._runtime = runtime
        self._ref: ResidentRef | None = None
        self._run: BlockingRun | None = None
        self._chunks: Iterator[StreamChunk] = iter(())
        self._request: GenerationRequest | None = None
        self._produced: list[int] = []
        self._text = ""
        self._steps = 0

    def residents(self) -> list[ResidentRef]:
        return [] if self._ref is None else [self._ref]

    def admit(self, request: GenerationRequest) -> Admission:
        if self._run is not None:
            return Admission(
                AdmissionAnswer.NO_CAPACITY, reason="the blocking path serves one request"
            )
        try:
            self._run = self._runtime.handle_request(request)
        except ValueError as exc:
            return Admission(AdmissionAnswer.REJECTED, reason=str(exc))
        self._chunks = iter(self._run)
        self._request = request
        self._ref = ResidentRef(0, 1)
        return Admission(AdmissionAnswer.ADMITTED, ref=self._ref)

    def step(self, cancelled: Collection[ResidentRef] = ()) -> StepResult:
        self._steps += 1
        result = StepResult(step_id=self._steps)
        ref, run = self._ref, self._run
        if ref is None or run is None:
            return result
        if ref in cancelled:
            result.finished[ref] = self._evict(FinishReason.CANCELLED)
            return result
        chunk = next(self._chunks, None)
        if chunk is not None:
            self._produced += chunk.token_ids
            self._text += chunk.text
            result.deltas[ref] = chunk
        if run.snapshot is not None:
            result.finished[ref] = run.snapshot
            self._ref = None
        return result

    def materialize(self, snapshot: FinishedSnapshot) -> CompletionOutput:
        return materialize(snapshot)

    def finish(self) -> None:
        if self._ref is not None:
            raise RuntimeError("finish() with its request still live")
        if self._run is not None:
            self._run.close()

    def abort(self) -> list[ResidentRef]:
        if self._ref is None:
            return []
        ref = self._ref
        self._evict(FinishReason.ERROR)
        return [ref]

    def _evict(self, reason: FinishReason) -> FinishedSnapshot:
        """End the run early (its KV is freed at once) and take what it produced so far."""
        assert self._run is not None and self._request is not None
        self._run.close()
        self._ref = None
        return FinishedSnapshot(self._request, list(self._produced), self._text, reason, None)
