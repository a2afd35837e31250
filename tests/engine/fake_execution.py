"""A fake `SteppedExecution` for engine tests: one token per resident per step, no model.

A resident finishes after `params.max_tokens` tokens (default 3); a request of n sequences gets
n residents, sequence i running i tokens longer than the first. Behaviours are switched on per
factory to make it refuse, reject, throw, lose residents or ignore cancel flags.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from inflight.protocol.outputs import (
    FinishedSnapshot,
    FinishReason,
    StreamChunk,
)
from inflight.protocol.request import GenerationRequest
from inflight.protocol.stepped import (
    Admission,
    AdmissionAnswer,
    ExecutionCapabilities,
    ResidentRef,
    ScheduledSequence,
    StepResult,
)
from inflight.runtime.host.slots import ResidentSlots


@dataclass
class FakeFactory:
    max_batch_size: int = 8
    # max_tokens varies per request in these tests; everything else must match (as in V0).
    per_row_fields: frozenset[str] = frozenset({"params.max_tokens"})
    stepped: bool = True
    seated_admission: bool = True
    step_delay: float = 0.0
    no_capacity_answers: int = 0  # answer NO_CAPACITY to this many joiner admissions first
    reject_all: bool = False
    reject_if: Callable[[GenerationRequest], bool] | None = None
    raise_on_admit: bool = False
    fail_steps: int = 0  # the next N steps raise
    refuse_founding: bool = False  # new_session raises
    ignore_cancel: bool = False
    lose_joiners: bool = False  # joiners vanish after their first step without being reported
    residents_raise: bool = False  # residents() raises (an error outside the step)
    abort_raises: bool = False  # abort() raises (the runtime cannot recover from a failure)
    check_refuses: Callable[[GenerationRequest], bool] | None = None  # check() raises for these
    fault: str | None = None  # the runtime can serve no more
    on_step: Callable[[FakeExecution], None] | None = None
    sessions: int = 0
    admitted: list[GenerationRequest] = field(default_factory=list)
    steps: int = 0
    slots: ResidentSlots | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.slots = ResidentSlots(self.max_batch_size)

    @property
    def capabilities(self) -> ExecutionCapabilities:
        return ExecutionCapabilities(
            stepped=self.stepped,
            seated_admission=self.seated_admission,
            max_batch_size=self.max_batch_size,
            per_row_fields=self.per_row_fields,
        )

    def check(self, request: GenerationRequest) -> GenerationRequest:
        if self.check_refuses and self.check_refuses(request):
            raise ValueError("the fake's check refuses this request")
        return request

    def new_session(self) -> FakeExecution:
        if self.refuse_founding:
            raise RuntimeError("the fake refuses to found")
        self.sessions += 1
        return FakeExecution(self)


@dataclass
class _Resident:
    ref: ResidentRef
    request: GenerationRequest
    tokens: list[int] = field(default_factory=list)
    joiner: bool = False
    steps: int = 0
    index: int = 0


class FakeExecution:
    def __init__(self, factory: FakeFactory) -> None:
        self.factory = factory
        self.live: dict[ResidentRef, _Resident] = {}
        self.finished = False

    def residents(self) -> list[ResidentRef]:
        if self.factory.residents_raise:
            raise RuntimeError("the fake lost track of its residents")
        return list(self.live)

    def admit(self, request: GenerationRequest) -> Admission:
        f = self.factory
        if f.raise_on_admit:
            raise RuntimeError("admission blew up")
        if f.reject_all or (f.reject_if and f.reject_if(request)):
            return Admission(AdmissionAnswer.REJECTED, reason="the fake rejects this request")
        joiner = bool(self.live)
        if joiner and f.no_capacity_answers > 0:
            f.no_capacity_answers -= 1
            return Admission(AdmissionAnswer.NO_CAPACITY, reason="fake has no room yet")
        n = request.params.n
        if f.slots.num_free < n:
            return Admission(AdmissionAnswer.NO_CAPACITY, reason="no slot")
        refs = tuple(f.slots.acquire() for _ in range(n))
        for index, ref in enumerate(refs):
            self.live[ref] = _Resident(ref, request, joiner=joiner, index=index)
        f.admitted.append(request)
        return Admission(AdmissionAnswer.ADMITTED, refs=refs)

    def step(self, cancelled: Collection[ResidentRef] = ()) -> StepResult:
        f = self.factory
        if f.step_delay:
            time.sleep(f.step_delay)
        f.steps += 1
        if f.fail_steps > 0:
            f.fail_steps -= 1
            raise RuntimeError("the fake step failed")
        result = StepResult(step_id=f.steps)
        if not f.ignore_cancel:
            for ref in cancelled:
                f.slots.check(ref)
                result.finished[ref] = self._evict(self.live[ref], FinishReason.CANCELLED)
        if f.on_step is not None:
            f.on_step(self)
        for ref, r in list(self.live.items()):
            r.steps += 1
            if f.lose_joiners and r.joiner and r.steps > 1:
                del self.live[ref]
                f.slots.release(ref)
                continue
            result.work.append(ScheduledSequence(ref, 1, len(r.tokens), True))
            token = len(r.tokens) + 1
            r.tokens.append(token)
            result.deltas[ref] = StreamChunk(
                [token], f"<{token}>", prompt_tokens=len(r.request.prompt_token_ids), index=r.index
            )
            if len(r.tokens) >= (r.request.params.max_tokens or 3) + r.index:
                result.finished[ref] = self._evict(r, FinishReason.LENGTH)
                result.deltas[ref].finished = True
                result.deltas[ref].finish_reason = "length"
        return result

    def _evict(self, r: _Resident, reason: FinishReason) -> FinishedSnapshot:
        del self.live[r.ref]
        self.factory.slots.release(r.ref)
        return FinishedSnapshot(
            request=r.request,
            token_ids=list(r.tokens),
            text="".join(f"<{t}>" for t in r.tokens),
            finish_reason=reason,
            stop_reason=None,
            index=r.index,
        )

    def finish(self) -> None:
        assert not self.live, "finish() with residents"
        self.finished = True

    def abort(self) -> list[ResidentRef]:
        if self.factory.abort_raises:
            raise RuntimeError("the fake cannot abort")
        refs = list(self.live)
        for ref in refs:
            self._evict(self.live[ref], FinishReason.ERROR)
        return refs
