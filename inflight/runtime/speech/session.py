"""`SpeechSession`: the stepped execution of a text-to-speech model.

Every resident is one speech request. A step packs the rows still prefilling their prompt
(chunks within the token budget) after the rows generating, runs the talker once over all of
them (paged KV, each position's input an embedding), picks each sampling row's first code,
runs the code predictor's micro-loop once for all rows that go on, and decodes the audio of
rows whose frames make an emission. Rows join at any step and leave at the step they end; each
samples from a generator of its own, so its frames do not depend on its batchmates.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import numpy as np
import torch

from inflight.model.contract import MediaEmbeds
from inflight.model.families.qwen3_tts import Qwen3TTSForSpeech
from inflight.model.transfer import to_device_packed
from inflight.protocol.outputs import FinishedSnapshot, FinishReason, StreamChunk
from inflight.protocol.request import GenerationRequest
from inflight.protocol.stepped import (
    Admission,
    AdmissionAnswer,
    ResidentRef,
    ScheduledSequence,
    StepResult,
)
from inflight.runtime.device.batch_builder import RowInput, build_ragged_batch
from inflight.runtime.device.model_runner import ModelRunner
from inflight.runtime.host.kv_cache import BlockPool
from inflight.runtime.host.slots import ResidentSlots
from inflight.runtime.speech.audio import AudioStream
from inflight.runtime.speech.predictor_graphs import PredictorGraphs
from inflight.runtime.speech.prompt import SpeechPrompt, build_prompt
from inflight.runtime.speech.sampling import Draw, Draws, penalize, pick_rows

# Codes the talker never emits: the top 1024 of its vocabulary (tags, speakers, languages)
# but the end code.
RESERVED_CODES = 1024
MIN_FRAMES = 2  # no end before the second frame (the package's min_new_tokens)


@dataclass
class SpeechRow:
    """A resident speech request: its prompt still to prefill, its KV blocks (and the blocks
    held back for the frames it may still make), its sampling, its frames so far, its audio."""

    ref: ResidentRef
    request: GenerationRequest
    prompt: SpeechPrompt
    blocks: list[int]
    held: int  # blocks held back in the pool for it
    max_frames: int
    talk: Draw
    predict: Draw
    audio: AudioStream
    computed: int = 0  # positions in its KV
    first_codes: list[int] = field(default_factory=list)
    next_input: torch.Tensor | None = None  # its next decode position's embedding

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt.prefill.shape[0]


@dataclass
class _Planned:
    row: SpeechRow
    inputs: torch.Tensor  # [positions, hidden]
    samples: bool


class SpeechSession:
    def __init__(
        self,
        model: Qwen3TTSForSpeech,
        runner: ModelRunner,
        blocks: BlockPool,
        slots: ResidentSlots,
        generator: torch.Generator,
        *,
        max_num_tokens: int,
        graphs: PredictorGraphs | None = None,
        on_finish: Callable[[], None] | None = None,
    ) -> None:
        self.model = model
        self.runner = runner
        self.blocks = blocks
        self.slots = slots
        self.generator = generator
        self.max_num_tokens = max_num_tokens
        self.graphs = graphs  # the code predictor's CUDA graphs (None: eager)
        self.rows: dict[ResidentRef, SpeechRow] = {}
        self.step_id = 0
        self._on_finish = on_finish
        vocab = model.config.vocab_size
        self.eos = model.speech.codec_ids["eos"]
        self.masked = torch.tensor(
            [i for i in range(vocab - RESERVED_CODES, vocab) if i != self.eos],
            device=runner.device,
        )
        # Each resident slot's first codes so far (the repetition penalty's), on the device.
        self.seen = torch.zeros(slots.capacity, vocab, dtype=torch.bool, device=runner.device)

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
        self.seen[ref.slot] = False
        generator = torch.Generator(self.runner.device)
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
        self.rows[ref] = SpeechRow(
            ref,
            request,
            prompt,
            taken,
            held,
            intent.max_new_tokens,
            Draw(p.temperature, top_k, p.top_p, generator),
            predict,
            AudioStream(),
        )
        return Admission(AdmissionAnswer.ADMITTED, (ref,))

    @torch.inference_mode()
    def step(self, cancelled: Collection[ResidentRef] = ()) -> StepResult:
        self.step_id += 1
        result = StepResult(self.step_id)
        for ref in cancelled:
            if ref in self.rows:
                self._evict(self.rows[ref], FinishReason.CANCELLED, result)
        planned = self._plan()
        if not planned:
            return result
        result.work = [
            ScheduledSequence(p.row.ref, p.inputs.shape[0], p.row.computed, p.samples)
            for p in planned
        ]
        hidden = self._forward(planned)
        sampling = [p.row for p in planned if p.samples]
        chunks = {
            row.ref: StreamChunk(prompt_tokens=len(row.request.prompt_token_ids))
            for row in sampling
        }
        going, firsts = self._first_codes(sampling, hidden, chunks)
        if going:
            rows = [sampling[i] for i in going]
            self._frames(rows, hidden[going], firsts, chunks)
        for row in sampling:
            self._audio(row, chunks[row.ref], result)
        for ref, chunk in chunks.items():
            if ref in self.rows or chunk.finished:
                result.deltas[ref] = chunk
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

    # -- a step's parts ------------------------------------------------------------------------

    def _plan(self) -> list[_Planned]:
        """Generating rows first (one position each), then prefill chunks in seat order within
        the token budget; each row's blocks grown to hold its new positions."""
        planned = [
            _Planned(row, row.next_input[None], True)
            for row in self.rows.values()
            if row.next_input is not None
        ]
        budget = self.max_num_tokens - len(planned)
        for row in self.rows.values():
            if not row.prefilling or budget < 1:
                continue
            prefill = row.prompt.prefill
            end = min(prefill.shape[0], row.computed + budget)
            planned.append(_Planned(row, prefill[row.computed : end], end == prefill.shape[0]))
            budget -= end - row.computed
        for p in planned:
            need = self.blocks.blocks_for(p.row.computed + p.inputs.shape[0]) - len(p.row.blocks)
            if need > 0:
                grown = self.blocks.allocate(need, reserved=True)
                assert grown is not None
                p.row.blocks += grown
                p.row.held -= need
        return planned

    def _forward(self, planned: list[_Planned]) -> torch.Tensor:
        """The talker's final hidden states of the sampling rows [rows, hidden], in order."""
        rows = [
            RowInput([0] * p.inputs.shape[0], p.row.computed, p.row.blocks, p.samples)
            for p in planned
        ]
        batch = build_ragged_batch(rows, self.runner.block_size, self.runner.device)
        inputs = torch.cat([p.inputs for p in planned])
        indices = torch.arange(inputs.shape[0], device=inputs.device)
        batch.forward.media = MediaEmbeds(indices, inputs)
        hidden = self.runner.execute(batch)
        for p in planned:
            p.row.computed += p.inputs.shape[0]
            if p.samples:
                p.row.next_input = None
        return hidden

    def _first_codes(
        self, rows: list[SpeechRow], hidden: torch.Tensor, chunks: dict[ResidentRef, StreamChunk]
    ) -> tuple[list[int], torch.Tensor]:
        """Each sampling row's first code; the indices of the rows that go on (a row that
        picked the end code ends here) and their codes."""
        logits = self.runner.logits(hidden).float()
        device = logits.device
        (slots, no_end), (penalty,) = (
            to_device_packed(
                [
                    np.array([row.ref.slot for row in rows]),
                    np.array(
                        [
                            len(row.first_codes) < MIN_FRAMES or row.request.params.ignore_eos
                            for row in rows
                        ],
                        np.int64,
                    ),
                ],
                torch.int64,
                device,
            ),
            to_device_packed(
                [np.array([row.request.params.repetition_penalty for row in rows], np.float32)],
                torch.float32,
                device,
            ),
        )
        logits = penalize(logits, self.seen[slots], penalty)
        logits[:, self.masked] = float("-inf")
        logits[:, self.eos] = logits[:, self.eos].masked_fill(no_end.bool(), float("-inf"))
        draws = Draws([row.talk for row in rows], logits.shape[-1], logits.device)
        noise = draws.noise(1, logits.shape[-1], logits.device)
        codes = pick_rows(logits, draws.sampling, None if noise is None else noise[:, 0])
        going = []
        for i, (row, code) in enumerate(zip(rows, codes.tolist(), strict=True)):
            if code == self.eos:
                chunks[row.ref].finish_reason = FinishReason.STOP.value
            else:
                going.append(i)
        firsts = codes[going]
        self.seen[slots[going], firsts] = True
        return going, firsts

    def _frames(
        self,
        rows: list[SpeechRow],
        hidden: torch.Tensor,
        firsts: torch.Tensor,
        chunks: dict[ResidentRef, StreamChunk],
    ) -> None:
        """The code predictor fills the frames of the rows that go on, in one micro-loop."""
        speech = self.model.speech
        vocab, picks = speech.code_predictor.vocab_size, speech.num_code_groups - 1
        draws = Draws([row.predict for row in rows], vocab, hidden.device)
        noise = draws.noise(picks, vocab, hidden.device)
        if self.graphs is not None:
            frames, embeds = self.graphs.run(hidden, firsts, draws.sampling, noise)
        else:
            frames, embeds = self.model.predict_codes(
                hidden,
                firsts,
                lambda g, logits: pick_rows(
                    logits, draws.sampling, None if noise is None else noise[:, g]
                ),
            )
        # One copy to the host for all rows' frames.
        for row, frame, codes, embed in zip(rows, frames, frames.tolist(), embeds, strict=True):
            step = len(row.first_codes)
            text = row.prompt.text_rows
            row.next_input = embed + (text[step] if step < text.shape[0] else row.prompt.pad_row)
            codes = tuple(codes)
            row.first_codes.append(codes[0])
            row.audio.frames.append(frame)
            chunk = chunks[row.ref]
            chunk.token_ids.append(codes[0])
            chunk.codes.append(codes)
            if len(row.first_codes) >= row.max_frames:
                chunk.finish_reason = FinishReason.LENGTH.value

    def _audio(self, row: SpeechRow, chunk: StreamChunk, result: StepResult) -> None:
        """Decode what is due of the row's audio; end the row where its chunk says so. A decoder
        failure fails this row alone."""
        ended = chunk.finish_reason is not None
        if row.audio.due(ended):
            try:
                samples = row.audio.emit(self.model.audio_stream)
            except Exception as exc:  # noqa: BLE001 (any failure of one row's decode is its own)
                self._evict(row, FinishReason.ERROR, result, f"audio decoding failed: {exc}")
                return
            chunk.audio = samples.float().cpu().numpy().astype("<f4").tobytes()
        if ended:
            chunk.finished = True
            self._evict(row, FinishReason(chunk.finish_reason), result)

    def _evict(
        self, row: SpeechRow, reason: FinishReason, result: StepResult, error: str = ""
    ) -> None:
        del self.rows[row.ref]
        self.blocks.release(row.blocks)
        self.blocks.unreserve(row.held)
        self.slots.release(row.ref)
        result.finished[row.ref] = FinishedSnapshot(
            request=row.request,
            token_ids=list(row.first_codes),
            text="",
            finish_reason=reason,
            stop_reason=self.eos if reason is FinishReason.STOP else None,
            error=error,
        )
