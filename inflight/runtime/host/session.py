"""`GenerationSession`: the runtime's `SteppedExecution`, a thin facade over the step's parts.

A step is planned by the `Scheduler`, run on the device by the `Executor` and taken in by the
`OutputProcessor`; the session orders those calls. With `overlap`, a step is completed one call
later: `step()` launches step N+1 on the device, then completes step N on the host while the
device computes. Step N+1 reads the tokens step N sampled from the device; a resident that step
N finishes has one wasted row in step N+1 (its KV reservation covers it), and its outcome is
reported by the second call. A step with rows under a structured-outputs constraint or with
penalties is sampled only after step N is taken in (while its forward pass runs): their masks
and penalties for step N+1 depend on the tokens of step N. With speculative decoding, prompt
lookup drafts past step N (see `speculative.py`); a draft model cannot, and there step N is
taken in before step N+1 is planned when a row is ready to draft or when step N verifies drafts;
step N+1 is still completed by the next call, the device computing it while the caller does its
own work. A row the executor cannot run (its media failed to encode) fails its request at once,
in the step that launched it; the rest of the step goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Protocol

from inflight.protocol.outputs import FinishReason
from inflight.protocol.request import AdmissionIntent, GenerationRequest
from inflight.protocol.stepped import Admission, AdmissionAnswer, ResidentRef, StepResult
from inflight.runtime.host.output_processor import OutputProcessor
from inflight.runtime.host.residents import Resident
from inflight.runtime.host.rows import SampledRow, ScheduledStep, reads_tokens
from inflight.runtime.host.scheduler import Reservation, Scheduler


class LaunchedStep(Protocol):
    """A step the executor has queued on the device."""

    step: ScheduledStep
    scores: dict[int, list[SampledRow]]  # row index -> the prompt scores of that row's chunk
    failed: dict[Resident, str]  # residents whose rows it could not run, and why


class StepExecutor(Protocol):
    """The device half of a step, as the session drives it (`device/executor.py`)."""

    @property
    def fault(self) -> str | None: ...

    def launch(self, step: ScheduledStep) -> LaunchedStep: ...

    def sample(self, launched: LaunchedStep) -> None: ...

    def fetch(self, launched: LaunchedStep) -> list[SampledRow]: ...


class SpokenSide(Protocol):
    """The talker's part of a step (`speech/replies.py`): after each step taken in, it
    advances the voices of the replies asking for audio."""

    def step(
        self,
        result: StepResult,
        finish: Callable[[Resident, FinishReason, str | int | None, str], None],
        busy: bool = False,
    ) -> None: ...


class GenerationSession:
    """Residents of one batch, stepped by one driver thread.

    Admission runs in three stages: `build_admission_intent` validates (a failure is REJECTED;
    a request its runtime has checked already carries its intent), `reserve_admission` takes a
    slot and every KV block the request can need (a shortfall is NO_CAPACITY, having taken
    nothing), and `seat` makes it a resident per sequence, whose prompt is prefilled in place by
    the following steps.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        executor: StepExecutor,
        outputs: OutputProcessor,
        *,
        overlap: bool,
        on_finish: Callable[[], None],
        voices: SpokenSide | None = None,
    ) -> None:
        self._scheduler = scheduler
        self._executor = executor
        self._outputs = outputs
        self._overlap = overlap
        self._on_finish = on_finish
        self._voices = voices
        self._inflight: LaunchedStep | None = None
        self._step_id = 0
        self._finished = False

    # -- SteppedExecution -----------------------------------------------------------------------

    def residents(self) -> list[ResidentRef]:
        return list(self._scheduler.residents)

    def admit(self, request: GenerationRequest) -> Admission:
        self._check_open()
        try:
            intent = self.build_admission_intent(request)
            # A ValueError here: its adapter stopped being served since it was checked.
            reservation = self.reserve_admission(request, intent)
        except ValueError as exc:
            return Admission(AdmissionAnswer.REJECTED, reason=str(exc))
        if reservation is None:
            return Admission(
                AdmissionAnswer.NO_CAPACITY,
                reason=f"needs {request.params.n} resident slot(s) and "
                f"{intent.blocks_needed} free KV blocks",
            )
        return Admission(AdmissionAnswer.ADMITTED, refs=self.seat(reservation))

    def step(self, cancelled: Collection[ResidentRef] = ()) -> StepResult:
        self._check_open()
        result = StepResult(0)
        for ref in cancelled:
            self._scheduler.slots.check(ref)
            self._outputs.finish(
                self._scheduler.residents[ref], FinishReason.CANCELLED, None, result
            )
        inflight, taken_in = self._inflight, False
        if inflight is not None and self._scheduler.decoding.waits(
            inflight.step, self._scheduler.residents.values()
        ):
            self._inflight, taken_in = None, True
            self._complete(inflight, result)
        launched = self._launch(result)
        if not taken_in:
            result.step_id = self._step_id
        # A constrained row's mask, a penalized row's counts need the token of the step before:
        # with overlap, that step is taken in first (while the device runs this one's forward).
        deferred = self._overlap and launched is not None and reads_tokens(launched.step)
        if launched is not None and not deferred:
            self._executor.sample(launched)
        completed = launched
        if self._overlap:
            completed, self._inflight = self._inflight, launched
        if completed is not None:
            self._complete(completed, result)
        if deferred:
            self._executor.sample(launched)
        if self._voices is not None:
            self._voices.step(
                result,
                lambda r, reason, stop, error: self._outputs.finish(r, reason, stop, result, error),
                busy=launched is not None,
            )
        return result

    def finish(self) -> None:
        if self._scheduler.residents:
            raise RuntimeError(
                f"finish() with {len(self._scheduler.residents)} residents still live"
            )
        self._settle()
        if self._executor.fault is not None:  # the engine must not found another batch
            raise RuntimeError(f"the runtime cannot serve on: {self._executor.fault}")
        if not self._finished:
            self._finished = True
            self._on_finish()

    def abort(self) -> list[ResidentRef]:
        self._settle()
        refs = self.residents()
        discarded = StepResult(0)
        for ref in refs:
            if ref in self._scheduler.residents:  # not evicted with a sibling
                resident = self._scheduler.residents[ref]
                self._outputs.finish(resident, FinishReason.ERROR, None, discarded)
        return refs

    # -- admission stages -----------------------------------------------------------------------

    def build_admission_intent(self, request: GenerationRequest) -> AdmissionIntent:
        return self._scheduler.intent(request)

    def reserve_admission(
        self, request: GenerationRequest, intent: AdmissionIntent
    ) -> Reservation | None:
        return self._scheduler.reserve(request, intent)

    def seat(self, reservation: Reservation) -> tuple[ResidentRef, ...]:
        residents = self._scheduler.seat(reservation)
        for resident in residents:
            self._outputs.track(resident)
        return tuple(r.ref for r in residents)

    # -- internals ------------------------------------------------------------------------------

    def _launch(self, result: StepResult) -> LaunchedStep | None:
        """Plan and launch the next step; residents whose rows it could not run fail here."""
        planned = self._scheduler.schedule(self._step_id + 1)
        if planned is None:
            return None
        self._step_id += 1
        launched = self._executor.launch(planned)
        for resident, error in launched.failed.items():
            if self._scheduler.is_live(resident):
                self._outputs.finish(resident, FinishReason.ERROR, None, result, error)
        return launched

    def _complete(self, launched: LaunchedStep, result: StepResult) -> None:
        """Take a launched step's sampled tokens in (waits for the device)."""
        result.step_id = launched.step.step_id
        picks = self._executor.fetch(launched)
        self._outputs.complete(launched.step, picks, launched.scores, result)

    def _settle(self) -> None:
        """Wait for a launched step nobody will complete (its residents are all gone)."""
        if self._inflight is not None:
            self._executor.fetch(self._inflight)
        self._inflight = None

    def _check_open(self) -> None:
        if self._finished:
            raise RuntimeError("this generation session has finished")
