"""`DiffusionSession`: the stepped execution of a block-diffusion model.

Every resident is one request: its prompt encoded (in chunks within the token budget), then
canvas after canvas, each denoised step by step until it settles and then encoded in turn.
Residents join at any step (their prompt's encode is their first segment) and leave at a
canvas's end (a stop, the end of their canvases) or when cancelled, between or inside
canvases. One forward holds every segment the step plans (`schedule.py`): encodes and
denoising steps of any residents, at any step of their canvases. A finished canvas is
delivered whole: its tokens, its text, the stop checks over them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import numpy as np
import torch

from inflight.model.checkpoints.tokenizer import Tokenizer
from inflight.model.families.diffusion_gemma import CanvasBatch, DiffusionGemmaForBlockDiffusion
from inflight.model.metadata import KVCache
from inflight.protocol.outputs import FinishedSnapshot, FinishReason, StreamChunk
from inflight.protocol.request import GenerationRequest
from inflight.protocol.stepped import (
    Admission,
    AdmissionAnswer,
    ResidentRef,
    ScheduledSequence,
    StepResult,
)
from inflight.runtime.device.encoder_cache import EncoderCache
from inflight.runtime.diffusion.canvas import Canvas, CanvasSampler, denoise
from inflight.runtime.diffusion.requests import DiffusionChecks, denoising
from inflight.runtime.diffusion.schedule import Segment, plan_segments
from inflight.runtime.host.detokenizer import IncrementalDetokenizer
from inflight.runtime.host.kv_cache import BlockPool
from inflight.runtime.host.slots import ResidentSlots


@dataclass
class DiffusionRow:
    """A resident request: its KV (blocks, and the slot of each position), the tokens waiting
    to be encoded, its canvas in progress, its output."""

    ref: ResidentRef
    request: GenerationRequest
    sampler: CanvasSampler
    blocks: list[int]
    slots: np.ndarray
    waiting: list[int]
    canvases_left: int
    detokenizer: IncrementalDetokenizer
    encoded: int = 0
    canvas: Canvas | None = None
    output: list[int] = field(default_factory=list)
    # Its prompt's media not encoded yet: (first position, embeddings [tokens, hidden]).
    media: list[tuple[int, torch.Tensor]] = field(default_factory=list)


@dataclass(frozen=True)
class WindowRing:
    """The sliding layers' KV: a ring of `size` slots a resident, as many as its window and a
    step's tokens reach (position p of resident r in slot r * size + p % size), so a long
    sequence holds a window of it there."""

    window: int
    size: int

    def slots(self, resident: int, start: int, end: int) -> np.ndarray:
        return resident * self.size + np.arange(start, end) % self.size

    def past(self, resident: int, end: int) -> np.ndarray:
        """The slots of the last window - 1 positions before `end`."""
        return self.slots(resident, max(0, end - self.window + 1), end)


@dataclass
class DiffusionCounters:
    """What the session's steps did: forwards, denoising steps of canvases, tokens delivered
    (tokens per denoising step = tokens / denoise_steps)."""

    forwards: int = 0
    denoise_steps: int = 0
    tokens: int = 0


class DiffusionSession:
    def __init__(
        self,
        model: DiffusionGemmaForBlockDiffusion,
        caches: list[KVCache],
        checks: DiffusionChecks,
        blocks: BlockPool,
        slots: ResidentSlots,
        tokenizer: Tokenizer,
        generator: torch.Generator,
        max_num_tokens: int,
        ring: WindowRing,
        counters: DiffusionCounters,
        encoder_cache: EncoderCache | None = None,
        *,
        on_finish: Callable[[], None] | None = None,
    ) -> None:
        self.model = model
        self.caches = caches
        self.checks = checks
        self.blocks = blocks
        self.slots = slots
        self.tokenizer = tokenizer
        self.generator = generator
        self.max_num_tokens = max_num_tokens
        self.ring = ring
        self.counters = counters
        self.encoder_cache = encoder_cache
        self.canvas = checks.canvas
        self.device = generator.device
        self.eos = frozenset(tokenizer.eos_token_ids)
        self.rows: dict[ResidentRef, DiffusionRow] = {}
        self.step_id = 0
        self._on_finish = on_finish

    # -- the SteppedExecution contract ---------------------------------------------------------

    def residents(self) -> list[ResidentRef]:
        return list(self.rows)

    def admit(self, request: GenerationRequest) -> Admission:
        try:
            request = self.checks.checked(request)
            p = request.params
            settings = denoising(p, request.diffusion, self.checks.defaults)
        except ValueError as exc:
            return Admission(AdmissionAnswer.REJECTED, reason=str(exc))
        intent = request.intent
        assert intent is not None
        if self.slots.num_free < 1 or self.blocks.num_free < intent.blocks_needed:
            return Admission(AdmissionAnswer.NO_CAPACITY)
        try:
            media = self._encode_media(request)
        except (ValueError, RuntimeError) as exc:
            return Admission(AdmissionAnswer.REJECTED, reason=str(exc))
        blocks = self.blocks.allocate(intent.blocks_needed)
        ref = self.slots.acquire()
        assert blocks is not None and ref is not None
        size = self.blocks.block_size
        slots = (np.asarray(blocks, np.int64)[:, None] * size + np.arange(size)).ravel()
        generator = torch.Generator(self.device)
        # Greedy denoising is deterministic: its canvases start from one fixed draw.
        seed = 0 if p.temperature == 0 else p.seed
        if seed is None:
            seed = int(torch.randint(2**62, (1,), generator=self.generator, device=self.device))
        generator.manual_seed(seed)
        prompt = list(request.prompt_token_ids)
        self.rows[ref] = DiffusionRow(
            ref=ref,
            request=request,
            sampler=CanvasSampler(settings, self.model.config.vocab_size, self.canvas, generator),
            blocks=blocks,
            slots=slots,
            waiting=prompt,
            canvases_left=intent.max_new_tokens // self.canvas,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer,
                tuple(prompt),
                p.skip_special_tokens,
                p.stop,
                p.include_stop_str_in_output,
            ),
            media=media,
        )
        return Admission(AdmissionAnswer.ADMITTED, (ref,))

    @torch.inference_mode()
    def step(self, cancelled: Collection[ResidentRef] = ()) -> StepResult:
        self.step_id += 1
        result = StepResult(self.step_id)
        for ref in cancelled:
            if ref in self.rows:
                self._evict(self.rows[ref], FinishReason.CANCELLED, None, result)
        rows = list(self.rows.values())
        # Where an image's tokens attend to each other both ways, a chunk holds it whole.
        bidirectional = self.model.diffusion.media_bidirectional
        whole = [self._unencoded_media(r) for r in rows] if bidirectional else []
        waiting = [len(r.waiting) for r in rows]
        segments = plan_segments(waiting, self.canvas, self.max_num_tokens, whole)
        if not segments:
            return result
        batch, denoising_rows = self._batch(rows, segments, bidirectional, result)
        self.counters.forwards += 1
        hidden_states = self.model(batch, self.caches)
        if not denoising_rows:
            return result
        logits = self.model.compute_logits(hidden_states).view(len(denoising_rows), self.canvas, -1)
        canvases = [(r.sampler, r.canvas) for r in denoising_rows]
        done = denoise(canvases, logits, self.model.soft_embedding)  # type: ignore[arg-type]
        self.counters.denoise_steps += len(denoising_rows)
        drafting = [
            r
            for r, ended in zip(denoising_rows, done, strict=True)
            if not ended and r.request.diffusion is not None and r.request.diffusion.stream_drafts
        ]
        if drafting:
            drafts = torch.cat([r.canvas.argmax for r in drafting]).tolist()  # type: ignore[union-attr]
            for r, draft in zip(drafting, drafts, strict=True):
                prompt = len(r.request.prompt_token_ids)
                result.deltas[r.ref] = StreamChunk(prompt_tokens=prompt, draft=draft)
        for r, ended in zip(denoising_rows, done, strict=True):
            if ended:
                self._finish_canvas(r, result)
        return result

    def _batch(
        self,
        rows: list[DiffusionRow],
        segments: list[Segment],
        bidirectional: bool,
        result: StepResult,
    ) -> tuple[CanvasBatch, list[DiffusionRow]]:
        """The forward of the step's segments (their work recorded in `result`), and the
        residents whose canvases it steps, in order; the encoded tokens leave their queues."""
        pieces: list[torch.Tensor] = []
        batch = CanvasBatch(
            ids=torch.empty(0),
            soft=None,
            write_slots=torch.empty(0),
            window_write_slots=torch.empty(0),
            query_lens=[],
            starts=[],
            denoise=[],
            past_slots=[],
            window_past_slots=[],
            whole=[] if bidirectional else None,
        )
        writes, window_writes, softs, denoising_rows = [], [], [], []
        media_rows: list[torch.Tensor] = []
        media: list[torch.Tensor] = []
        packed = 0
        for segment in segments:
            r = rows[segment.index]
            past = r.encoded
            if segment.encode:
                chunk = r.waiting[: segment.encode]
                pieces.append(torch.tensor(chunk, dtype=torch.int64))
                runs = []
                for start, embeds in r.media:
                    first = max(start, r.encoded)
                    last = min(start + embeds.shape[0], r.encoded + len(chunk))
                    if first < last:
                        media_rows.append(torch.arange(first, last) - r.encoded + packed)
                        media.append(embeds[first - start : last - start])
                        runs.append((first - r.encoded, last - r.encoded))
                if batch.whole is not None:
                    batch.whole.append(runs)
                packed += len(chunk)
                self._add(batch, len(chunk), r, False)
                writes.append(r.slots[r.encoded : r.encoded + len(chunk)])
                window_writes.append(self.ring.slots(r.ref.slot, r.encoded, r.encoded + len(chunk)))
                r.encoded += len(chunk)
                del r.waiting[: segment.encode]
                if not r.waiting:
                    r.media = []  # the prompt is in the KV
            if segment.denoise:
                if r.canvas is None:
                    r.canvas = r.sampler.start()
                pieces.append(r.canvas.ids[0])
                packed += self.canvas
                if batch.whole is not None:
                    batch.whole.append([])
                self._add(batch, self.canvas, r, True)
                softs.append(r.canvas.soft)
                denoising_rows.append(r)
            query = segment.encode + (self.canvas if segment.denoise else 0)
            result.work.append(ScheduledSequence(r.ref, query, past, segment.denoise))
        device = self.device
        batch.ids = torch.cat([piece.to(device) for piece in pieces])
        none = np.zeros(0, np.int64)
        batch.write_slots = torch.from_numpy(np.concatenate([none, *writes])).to(device)
        batch.window_write_slots = torch.from_numpy(np.concatenate([none, *window_writes])).to(
            device
        )
        if media:
            batch.media = torch.cat(media_rows).to(device), torch.cat(media)
        if softs:
            hidden = self.model.config.hidden_size
            zeros = torch.zeros(self.canvas, hidden, dtype=self.caches[0][0].dtype, device=device)
            batch.soft = torch.cat([zeros if s is None else s for s in softs])
        return batch, denoising_rows

    def finish(self) -> None:
        if self.rows:
            raise RuntimeError("a diffusion session finished with residents")
        if self._on_finish is not None:
            self._on_finish()

    def abort(self) -> list[ResidentRef]:
        refs = list(self.rows)
        sink = StepResult(self.step_id)
        for ref in refs:
            self._evict(self.rows[ref], FinishReason.ERROR, None, sink)
        return refs

    # -- internals ------------------------------------------------------------------------------

    @staticmethod
    def _unencoded_media(r: DiffusionRow) -> list[tuple[int, int]]:
        """Its prompt's media still to encode, as runs of its waiting tokens."""
        return [(s - r.encoded, s + e.shape[0] - r.encoded) for s, e in r.media if s >= r.encoded]

    @torch.inference_mode()
    def _encode_media(self, request: GenerationRequest) -> list[tuple[int, torch.Tensor]]:
        """The request's media encoded (the model's encoder of each kind; an item the encoder
        cache holds, from there), by first position."""
        encoders, cache = self.model.media_encoders(), self.encoder_cache
        encoded = []
        for item in request.media:
            embeds = None if cache is None else cache.get(item.key)
            if embeds is None:
                (embeds,) = encoders[item.kind].encode([item.data])
                if cache is not None:
                    cache.put(item.key, embeds)
            encoded.append((item.offset, embeds))
        return encoded

    def _add(self, batch: CanvasBatch, length: int, r: DiffusionRow, denoise: bool) -> None:
        """A segment of `length` queries of `r` after what its KV holds."""
        batch.query_lens.append(length)
        batch.starts.append(r.encoded)
        batch.denoise.append(denoise)
        batch.past_slots.append(r.slots[: r.encoded])
        batch.window_past_slots.append(self.ring.past(r.ref.slot, r.encoded))

    def _finish_canvas(self, r: DiffusionRow, result: StepResult) -> None:
        """Deliver the canvas's argmax: its tokens up to a stop, its text; end the request at
        a stop or its last canvas, else queue the canvas to be encoded."""
        assert r.canvas is not None and r.canvas.argmax is not None
        tokens = r.canvas.argmax[0].tolist()
        r.canvas = None
        r.canvases_left -= 1
        params = r.request.params
        chunk = StreamChunk(prompt_tokens=len(r.request.prompt_token_ids))
        reason: FinishReason | None = None
        stop_reason: str | int | None = None
        for token in tokens:
            r.output.append(token)
            chunk.token_ids.append(token)
            if token in params.stop_token_ids:
                reason, stop_reason = FinishReason.STOP, token
                break
            if not params.ignore_eos and token in self.eos:
                reason = FinishReason.STOP
                break
            released, matched = r.detokenizer.add(token)
            chunk.text += released
            if matched is not None:
                reason, stop_reason = FinishReason.STOP, matched
                break
        self.counters.tokens += len(chunk.token_ids)
        result.deltas[r.ref] = chunk
        if reason is None and r.canvases_left == 0:
            reason = FinishReason.LENGTH
        if reason is None:
            r.waiting = tokens
            return
        if not isinstance(stop_reason, str):
            chunk.text += r.detokenizer.flush()
        chunk.finished, chunk.finish_reason = True, reason.value
        self._evict(r, reason, stop_reason, result)

    def _evict(
        self,
        r: DiffusionRow,
        reason: FinishReason,
        stop_reason: str | int | None,
        result: StepResult,
    ) -> None:
        del self.rows[r.ref]
        self.blocks.release(r.blocks)
        self.slots.release(r.ref)
        result.finished[r.ref] = FinishedSnapshot(
            request=r.request,
            token_ids=list(r.output),
            text=r.detokenizer.text,
            finish_reason=reason,
            stop_reason=stop_reason,
        )
