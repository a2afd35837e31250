"""`BlockingPath`: the runtime's blocking path behind the engine's interface.

Every batch is one request, served by the runtime's `handle_request` and advanced one step
per tick, so callers submit, stream, cancel and shut down exactly as under in-flight
batching, and every invariant of the actor (one outcome per request, cancel within a tick,
drain on shutdown) holds for the blocking path too. No request option is refused for the sake of
in-flight batching: what the runtime does not serve, its own check refuses.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

from inflight.protocol.outputs import FinishedSnapshot, RequestOutput, materialize
from inflight.protocol.request import GenerationRequest
from inflight.protocol.stepped import (
    Admission,
    AdmissionAnswer,
    ExecutionCapabilities,
    ResidentRef,
    StepResult,
)
from inflight.runtime.host.blocking import BlockingRun


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
    """A `SteppedExecution` holding at most one request: its blocking run, whose residents
    (one per sequence) it reports as its own."""

    def __init__(self, runtime: BlockingRuntime) -> None:
        self._runtime = runtime
        self._run: BlockingRun | None = None
        self._steps = 0

    def residents(self) -> list[ResidentRef]:
        return [] if self._run is None else self._run.residents

    def admit(self, request: GenerationRequest) -> Admission:
        if self._run is not None:
            return Admission(
                AdmissionAnswer.NO_CAPACITY, reason="the blocking path serves one request"
            )
        try:
            self._run = self._runtime.handle_request(request)
        except ValueError as exc:
            return Admission(AdmissionAnswer.REJECTED, reason=str(exc))
        return Admission(AdmissionAnswer.ADMITTED, refs=self._run.refs)

    def step(self, cancelled: Collection[ResidentRef] = ()) -> StepResult:
        self._steps += 1
        if self._run is None or not self._run.residents:
            return StepResult(step_id=self._steps)
        return self._run.step(cancelled)

    def materialize(self, snapshots: Sequence[FinishedSnapshot]) -> RequestOutput:
        return materialize(snapshots)

    def finish(self) -> None:
        if self._run is not None:
            if self._run.residents:
                raise RuntimeError("finish() with its request still live")
            self._run.close()

    def abort(self) -> list[ResidentRef]:
        if self._run is None:
            return []
        refs = self._run.residents
        self._run.close()
        return refs
