"""`SpeechSession`: the stepped execution of a text-to-speech model.

Every resident is one speech request, one row of the talker loop (`talker_loop.py`): rows join
at any step and leave at the step they end.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np
import torch

from inflight.model.families.qwen3_tts import Qwen3TTSForSpeech
from inflight.protocol.outputs import FinishedSnapshot, FinishReason, StreamChunk
from inflight.protocol.request import GenerationRequest
from inflight.protocol.stepped import (
    Admission,
    AdmissionAnswer,
    ResidentRef,
    ScheduledSequence,
    StepResult,
)
from inflight.runtime.host.slots import ResidentSlots
from inflight.runtime.speech.prompt import build_prompt
from inflight.runtime.speech.sampling import Draw
from inflight.runtime.speech.talker_loop import TalkerLoop, TalkerRow

MIN_FRAMES = 2  # no end before the second frame (the package's min_new_tokens)


@dataclass
class FixedText:
    """A speech request's text rows: all known from the start (the rows the first frames
    add, then tts_pad)."""

    rows: torch.Tensor  # [n, hidden]
    pad: torch.Tensor  # [hidden]

    def row(self, frame: int) -> torch.Tensor:
        return self.rows[frame] if frame < self.rows.shape[0] else self.pad


@dataclass
class SpeechRow:
    """A resident speech request: its row of the talker loop."""

    ref: ResidentRef
    request: GenerationRequest
    talker: TalkerRow


class SpeechSession:
    def __init__(
        self,
        model: Qwen3TTSForSpeech,
        loop: TalkerLoop,
        slots: ResidentSlots,
        generator: torch.Generator,
        *,
        on_finish: Callable[[], None] | None = None,
    ) -> None:
        self.model = model
        self.loop = loop
        self.blocks = loop.blocks
        self.slots = slots
        self.generator = generator
        self.rows: dict[ResidentRef, SpeechRow] = {}
        self.step_id = 0
        self._on_finish = on_finish
        self.eos = loop.shape.eos

    # -- the SteppedExecution contract ---------------------------------------------------------

    def residents(self) -> list[ResidentRef]:
        return list(self.rows)

    @torch.inference_mode()
    def admit(self, request: GenerationRequest) -> Admission:
        intent, speech = request.intent, request.speech
        assert intent is not None and speech is not None, "admit takes checked requests"
        if self.slots.num_free < 1 or self.blocks.num_free < intent.blocks_needed:
            return Admission(AdmissionAnswer.NO_CAPACITY)
        try:
            voice_row = None
            if speech.reference_audio is not None:
                samples = torch.as_tensor(np.asarray(speech.reference_audio, np.float32))
                voice_row = self.model.speaker_embedding(samples, speech.reference_sample_rate)
            prompt = build_prompt(self.model, request, voice_row)
        except ValueError as exc:
            return Admission(AdmissionAnswer.REJECTED, reason=str(exc))
        length = prompt.prefill.shape[0]
        # The check reserved for the length it computed without building the prompt.
        assert self.blocks.blocks_for(length + intent.max_new_tokens) <= intent.blocks_needed
        first = self.blocks.blocks_for(length)
        taken = self.blocks.allocate(first)
        assert taken is not None  # within blocks_needed, which was free
        held = intent.blocks_needed - first
        self.blocks.reserve(held)
        ref = self.slots.acquire()
        assert ref is not None
        generator = torch.Generator(self.generator.device)
        seed = request.params.seed
        if seed is None:
            seed = int(
                torch.randint(2**62, (1,), generator=self.generator, device=self.generator.device)
            )
        generator.manual_seed(seed)
        p = request.params
        top_k = 0 if p.top_k < 1 else p.top_k
        predict = Draw(
            speech.subtalker_temperature if speech.subtalker_sample else 0.0,
            speech.subtalker_top_k,
            speech.subtalker_top_p,
            generator,
        )
        talker = TalkerRow(
            slot=ref.slot,
            blocks=taken,
            held=held,
            max_frames=intent.max_new_tokens,
            repetition_penalty=p.repetition_penalty,
            ignore_eos=p.ignore_eos,
            talk=Draw(p.temperature, top_k, p.top_p, generator),
            predict=predict,
            text=FixedText(prompt.text_rows, prompt.pad_row),
            prefill=prompt.prefill,
        )
        self.loop.start(talker)
        self.rows[ref] = SpeechRow(ref, request, talker)
        return Admission(AdmissionAnswer.ADMITTED, (ref,))

    @torch.inference_mode()
    def step(self, cancelled: Collection[ResidentRef] = ()) -> StepResult:
        self.step_id += 1
        result = StepResult(self.step_id)
        for ref in cancelled:
            if ref in self.rows:
                self._evict(self.rows[ref], FinishReason.CANCELLED, result)
        by_talker = {id(row.talker): row for row in self.rows.values()}
        planned, outputs = self.loop.step(row.talker for row in self.rows.values())
        if not planned:
            return result
        result.work = [
            ScheduledSequence(by_talker[id(p.row)].ref, p.inputs.shape[0], p.past, p.samples)
            for p in planned
        ]
        sampling = [by_talker[id(p.row)] for p in planned if p.samples]
        for row, out in zip(sampling, outputs, strict=True):
            chunk = StreamChunk(prompt_tokens=len(row.request.prompt_token_ids))
            chunk.codes = out.codes
            chunk.token_ids = [codes[0] for codes in out.codes]
            chunk.audio = out.audio
            if out.finish is FinishReason.ERROR:
                self._evict(row, FinishReason.ERROR, result, out.error)
                continue
            if out.finish is not None:
                chunk.finished, chunk.finish_reason = True, out.finish.value
                self._evict(row, out.finish, result)
            result.deltas[row.ref] = chunk
        return result

    def finish(self) -> None:
        if self.rows:
            raise RuntimeError("a speech session finished with residents")
        if self._on_finish is not None:
            self._on_finish()

    def abort(self) -> list[ResidentRef]:
        refs = list(self.rows)
        sink = StepResult(self.step_id)
        for ref in refs:
            self._evict(self.rows[ref], FinishReason.ERROR, sink)
        return refs

    def _evict(
        self, row: SpeechRow, reason: FinishReason, result: StepResult, error: str = ""
    ) -> None:
        del self.rows[row.ref]
        self.loop.release(row.talker)
        self.slots.release(row.ref)
        result.finished[row.ref] = FinishedSnapshot(
            request=row.request,
            token_ids=list(row.talker.first_codes),
            text="",
            finish_reason=reason,
            stop_reason=self.eos if reason is FinishReason.STOP else None,
            error=error,
        )
