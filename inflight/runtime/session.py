"""`GenerationSession`: the runtime's `SteppedExecution` over residents that join and leave."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from inflight.runtime.batch_builder import RowInput, build_ragged_batch
from inflight.runtime.detokenizer import IncrementalDetokenizer
from inflight.runtime.request import GenerationRequest
from inflight.runtime.sampler import SampledRow, SamplingRow
from inflight.runtime.stepped import (
    Admission,
    AdmissionAnswer,
    CompletionOutput,
    FinishedSnapshot,
    FinishReason,
    LogprobEntry,
    ResidentRef,
    ScheduledSequence,
    StepResult,
    TokenDelta,
    TopLogprob,
)

if TYPE_CHECKING:
    from inflight.runtime.runtime import Runtime


@dataclass(frozen=True)
class AdmissionIntent:
    """A validated request and what it needs: its prompt, output budget and KV blocks."""

    request: GenerationRequest
    max_new_tokens: int
    blocks_needed: int


@dataclass(frozen=True)
class Reservation:
    intent: AdmissionIntent
    ref: ResidentRef
    blocks: list[int]


@dataclass
class Resident:
    ref: ResidentRef
    request: GenerationRequest
    blocks: list[int]
    max_new_tokens: int
    detokenizer: IncrementalDetokenizer
    output: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] | None = None
    computed: int = 0  # tokens (prompt, then output) whose KV is written

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt_token_ids

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt)


class GenerationSession:
    """Residents of one batch, stepped by one driver thread.

    Admission runs in three stages: `build_admission_intent` validates (a failure is REJECTED),
    `reserve_admission` takes a slot and every KV block the request can need, prompt plus
    max_tokens (a shortfall is NO_CAPACITY, having taken nothing), and `seat` makes it a resident,
    whose prompt is prefilled in place by the following steps.
    """

    def __init__(self, runtime: Runtime) -> None:
        self._rt = runtime
        self._residents: dict[ResidentRef, Resident] = {}
        self._step_id = 0
        self._finished = False

    # -- SteppedExecution -----------------------------------------------------------------------

    def residents(self) -> list[ResidentRef]:
        return list(self._residents)

    def admit(self, request: GenerationRequest) -> Admission:
        self._check_open()
        try:
            intent = self.build_admission_intent(request)
        except ValueError as exc:
            return Admission(AdmissionAnswer.REJECTED, reason=str(exc))
        reservation = self.reserve_admission(intent)
        if reservation is None:
            return Admission(
                AdmissionAnswer.NO_CAPACITY,
                reason=f"needs a resident slot and {intent.blocks_needed} free KV blocks",
            )
        return Admission(AdmissionAnswer.ADMITTED, ref=self.seat(reservation))

    def step(self, cancelled: Collection[ResidentRef] = ()) -> StepResult:
        self._check_open()
        self._step_id += 1
        result = StepResult(step_id=self._step_id)
        for ref in cancelled:
            self._rt.slots.check(ref)
            result.finished[ref] = self._evict(self._residents[ref], FinishReason.CANCELLED, None)
        rows, work = self._plan()
        if not rows:
            return result
        result.work = work
        batch = build_ragged_batch(rows, self._rt.blocks.block_size, self._rt.device)
        logits = self._rt.runner.execute(batch)
        sampling = [
            SamplingRow(self._residents[w.ref].request.params, len(self._residents[w.ref].output))
            for w in work
            if w.samples
        ]
        sampled = iter(self._rt.sampler(logits, sampling))
        for w in work:
            resident = self._residents[w.ref]
            resident.computed += w.query_len
            if w.samples:
                self._accept(resident, next(sampled), result)
        return result

    def materialize(self, snapshot: FinishedSnapshot) -> CompletionOutput:
        return CompletionOutput(
            text=snapshot.text,
            token_ids=tuple(snapshot.token_ids),
            finish_reason=snapshot.finish_reason.value,
            stop_reason=snapshot.stop_reason,
            logprobs=None if snapshot.logprobs is None else tuple(snapshot.logprobs),
            prompt_tokens=snapshot.prompt_tokens,
        )

    def finish(self) -> None:
        if self._residents:
            raise RuntimeError(f"finish() with {len(self._residents)} residents still live")
        if not self._finished:
            self._finished = True
            self._rt.session_closed(self)

    def abort(self) -> list[ResidentRef]:
        refs = list(self._residents)
        for ref in refs:
            self._evict(self._residents[ref], FinishReason.ERROR, None)
        return refs

    # -- admission stages -----------------------------------------------------------------------

    def build_admission_intent(self, request: GenerationRequest) -> AdmissionIntent:
        return self._rt.check_request(request)

    def reserve_admission(self, intent: AdmissionIntent) -> Reservation | None:
        if self._rt.blocks.num_free < intent.blocks_needed or not self._rt.slots.num_free:
            return None
        ref = self._rt.slots.acquire()
        blocks = self._rt.blocks.allocate(intent.blocks_needed)
        assert ref is not None and blocks is not None
        return Reservation(intent, ref, blocks)

    def seat(self, reservation: Reservation) -> ResidentRef:
        request = reservation.intent.request
        params = request.params
        self._residents[reservation.ref] = Resident(
            ref=reservation.ref,
            request=request,
            blocks=reservation.blocks,
            max_new_tokens=reservation.intent.max_new_tokens,
            detokenizer=IncrementalDetokenizer(
                self._rt.tokenizer,
                request.prompt_token_ids,
                params.skip_special_tokens,
                params.stop,
                params.include_stop_str_in_output,
            ),
            logprobs=None if params.logprobs is None else [],
        )
        return reservation.ref

    # -- stepping -------------------------------------------------------------------------------

    def _plan(self) -> tuple[list[RowInput], list[ScheduledSequence]]:
        """Decode rows for every prefilled resident, then prefill chunks within the token budget."""
        decodes = [r for r in self._residents.values() if not r.prefilling]
        budget = self._rt.max_num_tokens - len(decodes)
        rows: list[RowInput] = []
        work: list[ScheduledSequence] = []
        for r in decodes:
            rows.append(RowInput((r.output[-1],), r.computed, r.blocks, True))
            work.append(ScheduledSequence(r.ref, 1, r.computed, True))
        for r in self._residents.values():
            if budget <= 0:
                break
            if not r.prefilling:
                continue
            n = min(len(r.prompt) - r.computed, budget)
            budget -= n
            last = r.computed + n == len(r.prompt)
            rows.append(RowInput(r.prompt[r.computed : r.computed + n], r.computed, r.blocks, last))
            work.append(ScheduledSequence(r.ref, n, r.computed, last))
        return rows, work

    def _accept(self, r: Resident, sampled: SampledRow, result: StepResult) -> None:
        token = sampled.token_id
        params = r.request.params
        r.output.append(token)
        delta = result.deltas.setdefault(r.ref, TokenDelta())
        delta.token_ids.append(token)
        if r.logprobs is not None:
            entry = self._logprob_entry(sampled)
            r.logprobs.append(entry)
            delta.logprobs = [*(delta.logprobs or []), entry]
        reason, stop_reason = None, None
        if token in params.stop_token_ids:
            reason, stop_reason = FinishReason.STOP, token
        elif not params.ignore_eos and token in self._rt.tokenizer.eos_token_ids:
            reason = FinishReason.STOP
        else:
            text, matched = r.detokenizer.add(token)
            delta.text += text
            if matched is not None:
                reason, stop_reason = FinishReason.STOP, matched
        if reason is None and len(r.output) >= r.max_new_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:
            if stop_reason is None or isinstance(stop_reason, int):
                delta.text += r.detokenizer.flush()
            result.finished[r.ref] = self._evict(r, reason, stop_reason)

    def _logprob_entry(self, sampled: SampledRow) -> LogprobEntry:
        tok = self._rt.tokenizer

        def text(token_id: int) -> str:
            return tok.decode([token_id], skip_special_tokens=False)

        top = tuple(
            TopLogprob(t, lp, text(t), tok.token_bytes(t))
            for t, lp in zip(sampled.top_ids or [], sampled.top_logprobs or [], strict=True)
        )
        t = sampled.token_id
        return LogprobEntry(t, sampled.logprob, text(t), tok.token_bytes(t), top)

    def _evict(
        self, r: Resident, reason: FinishReason, stop_reason: str | int | None
    ) -> FinishedSnapshot:
        del self._residents[r.ref]
        self._rt.blocks.release(r.blocks)
        self._rt.slots.release(r.ref)
        return FinishedSnapshot(
            request=r.request,
            token_ids=list(r.output),
            text=r.detokenizer.text,
            finish_reason=reason,
            stop_reason=stop_reason,
            logprobs=r.logprobs,
            prompt_tokens=len(r.prompt),
        )

    def _check_open(self) -> None:
        if self._finished:
            raise RuntimeError("this generation session has finished")
