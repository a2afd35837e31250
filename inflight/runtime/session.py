"""`GenerationSession`: the runtime's `SteppedExecution` over residents that join and leave."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from inflight.model.transfer import to_device
from inflight.runtime.batch_builder import RowInput, build_ragged_batch
from inflight.runtime.context_cache import chain_digest
from inflight.runtime.detokenizer import IncrementalDetokenizer
from inflight.runtime.request import GenerationRequest
from inflight.runtime.sampler import Sampled, SampledRow, SamplingRow
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

# Prompt positions scored per LM-head call: bounds the [positions, vocab] logits held at once.
_SCORE_SLICE = 128


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
    cached_blocks: int = 0  # leading blocks leased from the context cache
    digests: tuple[bytes, ...] = ()  # their chain digests


@dataclass
class LaunchedStep:
    """A step whose forward pass and sampling are queued on the device."""

    step_id: int
    work: list[ScheduledSequence]
    sampled: Sampled | None


@dataclass(slots=True)
class Resident:
    ref: ResidentRef
    request: GenerationRequest
    blocks: list[int]
    max_new_tokens: int
    detokenizer: IncrementalDetokenizer
    block_table: np.ndarray  # `blocks` as an array: never changes while the resident lives
    prompt_len: int
    output: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] | None = None
    prompt_logprobs: list[LogprobEntry | None] | None = None
    computed: int = 0  # tokens (prompt, then output) whose KV launched steps write
    committed: int = 0  # of those, the ones whose step has completed
    pending: int = 0  # tokens sampled on the device, not yet seen by the host
    cached_tokens: int = 0  # prompt tokens whose KV came from the context cache
    digests: list[bytes] = field(default_factory=list)  # chain digests of its full blocks

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt_token_ids

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_len


class GenerationSession:
    """Residents of one batch, stepped by one driver thread.

    Admission runs in three stages: `build_admission_intent` validates (a failure is REJECTED),
    `reserve_admission` takes a slot and every KV block the request can need, prompt plus
    max_tokens (a shortfall is NO_CAPACITY, having taken nothing), and `seat` makes it a resident,
    whose prompt is prefilled in place by the following steps.

    With `overlap`, a step is completed one call later: `step()` launches step N+1 on the
    device, then completes step N on the host while the device computes. Step N+1 reads the
    tokens step N sampled from the device; a resident that step N finishes has one wasted row
    in step N+1 (its KV reservation covers it), and its outcome is reported by the second call.
    """

    def __init__(self, runtime: Runtime) -> None:
        self._rt = runtime
        self._residents: dict[ResidentRef, Resident] = {}
        self._step_id = 0
        self._finished = False
        self._inflight: LaunchedStep | None = None

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
        finished = {}
        for ref in cancelled:
            self._rt.slots.check(ref)
            finished[ref] = self._evict(self._residents[ref], FinishReason.CANCELLED, None)
        launched = self._launch()
        if self._rt.overlap:
            launched, self._inflight = self._inflight, launched
        result = StepResult(step_id=launched.step_id if launched else self._step_id)
        result.finished.update(finished)
        if launched is not None:
            self._complete(launched, result)
        return result

    def _launch(self) -> LaunchedStep | None:
        """Plan the next step and queue its forward pass and sampling on the device."""
        rows, work, residents = self._plan()
        if not rows:
            return None
        self._step_id += 1
        device = self._rt.device
        batch = build_ragged_batch(rows, self._rt.blocks.block_size, device)
        # Decode rows whose last token is still on the device read it from there.
        pending = [(i, r.ref.slot) for i, r in enumerate(residents) if r.pending]
        if pending:
            positions, slots = zip(*pending, strict=True)
            batch.input_ids[to_device(positions, torch.int64, device)] = self._rt.last_tokens[
                to_device(slots, torch.int64, device)
            ]
        hidden = self._rt.runner.execute(batch)
        # Hidden rows come in work order: all of a scoring row's tokens, else a sampler's last.
        sample_rows, offset = [], 0
        for r, w in zip(residents, work, strict=True):
            kept = w.query_len if w.scores else int(w.samples)
            if w.scores:
                self._score(r, w, hidden[offset : offset + kept])
            if w.samples:
                sample_rows.append(offset + kept - 1)
            offset += kept
        sampled = None
        if sample_rows:
            samplers = [r for r, w in zip(residents, work, strict=True) if w.samples]
            if len(sample_rows) < hidden.shape[0]:  # some rows were kept for scoring
                hidden = hidden[to_device(sample_rows, torch.int64, device)]
            logits = self._rt.runner.logits(hidden)
            sampled = self._rt.sampler.sample(
                logits,
                [SamplingRow(r.request.params, len(r.output) + r.pending) for r in samplers],
            )
            slots = to_device([r.ref.slot for r in samplers], torch.int64, device)
            self._rt.last_tokens[slots] = sampled.tokens
            for r in samplers:
                r.pending += 1
        for r, w in zip(residents, work, strict=True):
            r.computed += w.query_len
        return LaunchedStep(self._step_id, work, sampled)

    def _complete(self, launched: LaunchedStep, result: StepResult) -> None:
        """Take a launched step's results in: new tokens, stops, evictions, published blocks."""
        result.work = launched.work
        picks = iter(self._rt.sampler.fetch(launched.sampled) if launched.sampled else ())
        for w in launched.work:
            pick = next(picks) if w.samples else None
            resident = self._residents.get(w.ref)
            if resident is None:
                continue  # evicted since this step was launched: its row was wasted work
            resident.committed += w.query_len
            if self._rt.context_cache is not None:
                self._publish(resident)
            if pick is not None:
                resident.pending -= 1
                self._accept(resident, pick, result)
            elif not resident.prefilling and resident.max_new_tokens == 0:
                # A scoring-only request (max_tokens=0) ends once its prompt is computed.
                result.finished[w.ref] = self._evict(resident, FinishReason.LENGTH, None)

    def materialize(self, snapshot: FinishedSnapshot) -> CompletionOutput:
        return CompletionOutput(
            text=snapshot.text,
            token_ids=tuple(snapshot.token_ids),
            finish_reason=snapshot.finish_reason.value,
            stop_reason=snapshot.stop_reason,
            logprobs=None if snapshot.logprobs is None else tuple(snapshot.logprobs),
            prompt_tokens=snapshot.prompt_tokens,
            prompt_logprobs=None
            if snapshot.prompt_logprobs is None
            else tuple(snapshot.prompt_logprobs),
            cached_tokens=snapshot.cached_tokens,
        )

    def finish(self) -> None:
        if self._residents:
            raise RuntimeError(f"finish() with {len(self._residents)} residents still live")
        self._settle()
        if not self._finished:
            self._finished = True
            self._rt.session_closed(self)

    def abort(self) -> list[ResidentRef]:
        self._settle()
        refs = list(self._residents)
        for ref in refs:
            self._evict(self._residents[ref], FinishReason.ERROR, None)
        return refs

    # -- admission stages -----------------------------------------------------------------------

    def build_admission_intent(self, request: GenerationRequest) -> AdmissionIntent:
        return self._rt.check_request(request)

    def reserve_admission(self, intent: AdmissionIntent) -> Reservation | None:
        """Take a slot and every KV block the request can need, leasing its cached prefix; or
        None, having changed nothing."""
        pool, cache = self._rt.blocks, self._rt.context_cache
        hits: list[int] = []
        digests: list[bytes] = []
        if cache is not None and intent.request.params.reuse_context:
            hits, digests = cache.match(intent.request.prompt_token_ids)
        fresh = intent.blocks_needed - len(hits)
        revived = sum(1 for block in hits if not pool.in_use(block))
        if pool.num_free - revived < fresh or not self._rt.slots.num_free:
            return None
        ref = self._rt.slots.acquire()
        for block in hits:
            pool.lease(block)
        blocks = pool.allocate(fresh)
        assert ref is not None and blocks is not None
        return Reservation(intent, ref, hits + blocks, len(hits), tuple(digests))

    def seat(self, reservation: Reservation) -> ResidentRef:
        request = reservation.intent.request
        params = request.params
        cached = reservation.cached_blocks * self._rt.blocks.block_size
        if self._rt.context_cache is not None and params.reuse_context:
            self._rt.context_cache.record_lookup(len(request.prompt_token_ids), cached)
        self._residents[reservation.ref] = Resident(
            ref=reservation.ref,
            request=request,
            blocks=reservation.blocks,
            max_new_tokens=reservation.intent.max_new_tokens,
            block_table=np.asarray(reservation.blocks, dtype=np.int64),
            prompt_len=len(request.prompt_token_ids),
            detokenizer=IncrementalDetokenizer(
                self._rt.tokenizer,
                request.prompt_token_ids,
                params.skip_special_tokens,
                params.stop,
                params.include_stop_str_in_output,
            ),
            logprobs=None if params.logprobs is None else [],
            prompt_logprobs=None if params.prompt_logprobs is None else [None],
            computed=cached,
            committed=cached,
            cached_tokens=cached,
            digests=list(reservation.digests),
        )
        return reservation.ref

    # -- stepping -------------------------------------------------------------------------------

    def _plan(self) -> tuple[list[RowInput], list[ScheduledSequence], list[Resident]]:
        """Decode rows for every prefilled resident, then prefill chunks within the token budget;
        with the resident of each row."""
        decodes = [r for r in self._residents.values() if r.computed >= r.prompt_len]
        budget = self._rt.max_num_tokens - len(decodes)
        rows: list[RowInput] = []
        work: list[ScheduledSequence] = []
        for r in decodes:
            token = 0 if r.pending else r.output[-1]  # a pending token is read on the device
            rows.append(RowInput((token,), r.computed, r.block_table, True))
            work.append(ScheduledSequence(r.ref, 1, r.computed, True))
        prefills = []
        for r in self._residents.values():
            if budget <= 0:
                break
            if r.computed >= r.prompt_len:
                continue
            n = min(r.prompt_len - r.computed, budget)
            budget -= n
            samples = r.computed + n == r.prompt_len and r.max_new_tokens > 0
            scores = r.prompt_logprobs is not None
            chunk = r.prompt[r.computed : r.computed + n]
            rows.append(RowInput(chunk, r.computed, r.block_table, samples, scores))
            work.append(ScheduledSequence(r.ref, n, r.computed, samples, scores))
            prefills.append(r)
        return rows, work, decodes + prefills

    def _score(self, r: Resident, w: ScheduledSequence, hidden: torch.Tensor) -> None:
        """Log-probabilities of the prompt tokens this chunk predicts (position p predicts p+1)."""
        prompt = r.prompt
        count = min(w.query_len, len(prompt) - 1 - w.past_len)
        top_n = r.request.params.prompt_logprobs
        for start in range(0, count, _SCORE_SLICE):
            end = min(count, start + _SCORE_SLICE)
            logits = self._rt.runner.logits(hidden[start:end])
            targets = prompt[w.past_len + start + 1 : w.past_len + end + 1]
            for row in self._rt.sampler.score(logits, targets, top_n):
                r.prompt_logprobs.append(self._logprob_entry(row))

    def _publish(self, r: Resident) -> None:
        """Make the resident's newly completed blocks findable (this step has written them)."""
        bs = self._rt.blocks.block_size
        known = (*r.prompt, *r.output)
        while len(r.digests) < min(r.committed, len(known)) // bs:
            i = len(r.digests)
            if (i + 1) * bs > len(r.prompt) and not r.request.params.cache_generated_tokens:
                return
            digest = chain_digest(r.digests[-1] if r.digests else b"", known[i * bs : (i + 1) * bs])
            # If another block already holds this digest, ours stays private.
            self._rt.blocks.publish(r.blocks[i], digest)
            r.digests.append(digest)

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
            prompt_logprobs=r.prompt_logprobs,
            cached_tokens=r.cached_tokens,
        )

    def _settle(self) -> None:
        """Wait for a launched step nobody will complete (its residents are all gone)."""
        if self._inflight is not None and self._inflight.sampled is not None:
            self._rt.sampler.fetch(self._inflight.sampled)
        self._inflight = None

    def _check_open(self) -> None:
        if self._finished:
            raise RuntimeError("this generation session has finished")
