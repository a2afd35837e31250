"""`TalkerLoop`: a talker's step over the rows generating speech, whoever they belong to (a
text-to-speech request, the spoken side of a chat reply).

A step packs the rows generating a frame (one position each) before the rows still prefilling
their talker prompt (chunks within the token budget), runs the talker once over all of them
(paged KV, each position's input an embedding), picks each sampling row's first code, runs the
code predictor's micro-loop once for all rows that go on, and decodes the audio of rows whose
frames make an emission. A row generates its next frame once the text row that frame reads is
known (`TextFeed`): a reply still being written holds its voice back. Each row samples from a
generator of its own, so its frames do not depend on its batchmates.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from inflight.model.contract import MediaEmbeds
from inflight.model.speech.code_predictor import CodePicker
from inflight.model.speech.codec_decoder import CodecStream
from inflight.model.transfer import to_device, to_device_packed
from inflight.protocol.outputs import FinishReason
from inflight.runtime.device.batch_builder import RowInput, build_ragged_batch
from inflight.runtime.device.model_runner import ModelRunner
from inflight.runtime.host.kv_cache import BlockPool
from inflight.runtime.speech.audio import AudioStream
from inflight.runtime.speech.predictor_graphs import PredictorGraphs
from inflight.runtime.speech.sampling import Draw, Draws, penalize, pick_rows

# Codes the talker never emits: the top 1024 of its vocabulary (tags, speakers, languages)
# but the end code.
RESERVED_CODES = 1024


class TalkerModel(Protocol):
    """What the loop runs beside the talker decoder its model runner runs."""

    def codec_embeds(self, ids: torch.Tensor) -> torch.Tensor: ...

    def predict_codes(
        self, hidden: torch.Tensor, first: torch.Tensor, pick: CodePicker
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def audio_stream(self, context: torch.Tensor | None) -> CodecStream: ...


@dataclass(frozen=True)
class TalkerShape:
    """The talker's codec vocabulary and end code, codebooks a frame, the code predictor's
    vocabulary, and the frames before which no row may end."""

    vocab_size: int
    eos: int
    num_code_groups: int
    predictor_vocab: int
    min_frames: int


class TextFeed(Protocol):
    def row(self, frame: int) -> torch.Tensor | None:
        """The text row [hidden] that frame `frame`'s embedding joins as the talker's next
        input; None where it is not known yet."""
        ...


@dataclass
class TalkerRow:
    """A voice being generated: its talker prompt (None until it is known), its KV blocks and
    the blocks the pool holds back for the frames it may still make, its sampling, its frames
    and audio so far. `slot`: its row of the loop's table of first codes seen."""

    slot: int
    blocks: list[int]
    held: int
    max_frames: int
    repetition_penalty: float
    ignore_eos: bool
    talk: Draw
    predict: Draw
    text: TextFeed
    prefill: torch.Tensor | None = None  # [positions, hidden]
    # M-RoPE: the prompt's 3-D rotary positions [3, positions] (None: each its index), and
    # how far those after it lie from their index.
    rope: np.ndarray | None = None
    rope_delta: int = 0
    audio: AudioStream = field(default_factory=AudioStream)
    computed: int = 0  # positions in its KV
    first_codes: list[int] = field(default_factory=list)
    # The last frame's summed code embeddings, until its text row joins them.
    frame_embed: torch.Tensor | None = None

    @property
    def prefilling(self) -> bool:
        return self.prefill is not None and self.computed < self.prefill.shape[0]

    def next_input(self) -> torch.Tensor | None:
        """Its next frame's input [hidden], where it can make one now."""
        if self.frame_embed is None:
            return None
        text = self.text.row(len(self.first_codes) - 1)
        return None if text is None else self.frame_embed + text


@dataclass
class Planned:
    """A row's share of a step: its input positions, and whether the step samples for it."""

    row: TalkerRow
    inputs: torch.Tensor  # [positions, hidden]
    past: int
    samples: bool


@dataclass
class FrameOutput:
    """What a step made of a row: its new frames, their audio (float32 little-endian), and
    why it ended, if it did."""

    codes: list[tuple[int, ...]] = field(default_factory=list)
    audio: bytes = b""
    finish: FinishReason | None = None
    error: str = ""


class TalkerLoop:
    def __init__(
        self,
        model: TalkerModel,
        shape: TalkerShape,
        runner: ModelRunner,
        blocks: BlockPool,
        capacity: int,
        *,
        max_num_tokens: int,
        graphs: PredictorGraphs | None = None,
    ) -> None:
        self.model = model
        self.shape = shape
        self.runner = runner
        self.blocks = blocks
        self.max_num_tokens = max_num_tokens
        self.graphs = graphs  # the code predictor's CUDA graphs (None: eager)
        vocab, eos = shape.vocab_size, shape.eos
        self.masked = torch.tensor(
            [i for i in range(vocab - RESERVED_CODES, vocab) if i != eos], device=runner.device
        )
        # Each slot's first codes so far (the repetition penalty's), on the device.
        self.seen = torch.zeros(capacity, vocab, dtype=torch.bool, device=runner.device)

    def start(self, row: TalkerRow) -> None:
        """A new row in its slot: no codes seen."""
        self.seen[row.slot] = False

    def release(self, row: TalkerRow) -> None:
        """Give back a row's KV blocks and those held back for it."""
        self.blocks.release(row.blocks)
        self.blocks.unreserve(row.held)
        row.blocks, row.held = [], 0

    def step(self, rows: Iterable[TalkerRow]) -> tuple[list[Planned], list[FrameOutput]]:
        """One talker step over the rows that can go on: what it planned, and what it made of
        each planned row that sampled (in the order of `planned`'s sampling rows)."""
        planned = self._plan(list(rows))
        if not planned:
            return [], []
        hidden = self._forward(planned)
        sampling = [p.row for p in planned if p.samples]
        outputs = [FrameOutput() for _ in sampling]
        going, firsts = self._first_codes(sampling, hidden, outputs)
        if going:
            self._frames([sampling[i] for i in going], hidden[going], firsts, outputs, going)
        for row, out in zip(sampling, outputs, strict=True):
            self._audio(row, out)
        return planned, outputs

    # -- a step's parts ------------------------------------------------------------------------

    def _plan(self, rows: list[TalkerRow]) -> list[Planned]:
        """Rows making a frame first (one position each), then prefill chunks in order within
        the token budget; each row's blocks grown to hold its new positions."""
        planned = []
        for row in rows:
            if row.prefilling:
                continue
            inputs = row.next_input()
            if inputs is not None:
                planned.append(Planned(row, inputs[None], row.computed, True))
        budget = self.max_num_tokens - len(planned)
        for row in rows:
            if not row.prefilling or budget < 1:
                continue
            assert row.prefill is not None
            end = min(row.prefill.shape[0], row.computed + budget)
            chunk = row.prefill[row.computed : end]
            planned.append(Planned(row, chunk, row.computed, end == row.prefill.shape[0]))
            budget -= end - row.computed
        for p in planned:
            need = self.blocks.blocks_for(p.past + p.inputs.shape[0]) - len(p.row.blocks)
            if need > 0:
                grown = self.blocks.allocate(need, reserved=True)
                assert grown is not None
                p.row.blocks += grown
                p.row.held -= need
        return planned

    def _forward(self, planned: list[Planned]) -> torch.Tensor:
        """The talker's final hidden states of the sampling rows [rows, hidden], in order."""
        rows = [RowInput([0] * p.inputs.shape[0], p.past, p.row.blocks, p.samples) for p in planned]
        device = self.runner.device
        batch = build_ragged_batch(rows, self.runner.block_size, device)
        inputs = torch.cat([p.inputs for p in planned])
        indices = torch.arange(inputs.shape[0], device=inputs.device)
        batch.forward.media = MediaEmbeds(indices, inputs, self._rope(planned))
        if any(p.row.rope_delta for p in planned):
            delta = [d for p in planned for d in [p.row.rope_delta] * p.inputs.shape[0]]
            batch.forward.positions += to_device(delta, torch.int64, device)
        hidden = self.runner.execute(batch)
        for p in planned:
            p.row.computed += p.inputs.shape[0]
            if p.samples:
                p.row.frame_embed = None
        return hidden

    def _rope(self, planned: list[Planned]) -> torch.Tensor | None:
        """The packed positions' 3-D rotary positions, where a prompt chunk has its own (a
        prompt with media; the others' three coordinates equal); None where none has."""

        def own(p: Planned) -> bool:
            return p.row.rope is not None and p.past < p.row.rope.shape[1]

        if not any(own(p) for p in planned):
            return None
        parts = []
        for p in planned:
            n, row = p.inputs.shape[0], p.row
            if own(p):
                assert row.rope is not None
                parts.append(row.rope[:, p.past : p.past + n])
            else:
                parts.append(np.tile(np.arange(p.past, p.past + n) + row.rope_delta, (3, 1)))
        return to_device(np.concatenate(parts, axis=1), torch.int64, self.runner.device)

    def _first_codes(
        self, rows: list[TalkerRow], hidden: torch.Tensor, outputs: list[FrameOutput]
    ) -> tuple[list[int], torch.Tensor]:
        """Each sampling row's first code; the indices of the rows that go on (a row that
        picked the end code ends here) and their codes."""
        logits = self.runner.logits(hidden).float()
        device = logits.device
        min_frames = self.shape.min_frames
        (slots, no_end), (penalty,) = (
            to_device_packed(
                [
                    np.array([row.slot for row in rows]),
                    np.array(
                        [len(row.first_codes) < min_frames or row.ignore_eos for row in rows],
                        np.int64,
                    ),
                ],
                torch.int64,
                device,
            ),
            to_device_packed(
                [np.array([row.repetition_penalty for row in rows], np.float32)],
                torch.float32,
                device,
            ),
        )
        eos = self.shape.eos
        logits = penalize(logits, self.seen[slots], penalty)
        logits[:, self.masked] = float("-inf")
        logits[:, eos] = logits[:, eos].masked_fill(no_end.bool(), float("-inf"))
        draws = Draws([row.talk for row in rows], logits.shape[-1], logits.device)
        noise = draws.noise(1, logits.shape[-1], logits.device)
        codes = pick_rows(logits, draws.sampling, None if noise is None else noise[:, 0])
        going = []
        for i, code in enumerate(codes.tolist()):
            if code == eos:
                outputs[i].finish = FinishReason.STOP
            else:
                going.append(i)
        firsts = codes[going]
        self.seen[slots[going], firsts] = True
        return going, firsts

    def _frames(
        self,
        rows: list[TalkerRow],
        hidden: torch.Tensor,
        firsts: torch.Tensor,
        outputs: list[FrameOutput],
        going: list[int],
    ) -> None:
        """The code predictor fills the frames of the rows that go on, in one micro-loop."""
        vocab, picks = self.shape.predictor_vocab, self.shape.num_code_groups - 1
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
        for i, row, frame, codes, embed in zip(
            going, rows, frames, frames.tolist(), embeds, strict=True
        ):
            row.frame_embed = embed
            row.first_codes.append(codes[0])
            row.audio.frames.append(frame)
            outputs[i].codes.append(tuple(codes))
            if len(row.first_codes) >= row.max_frames:
                outputs[i].finish = FinishReason.LENGTH

    def _audio(self, row: TalkerRow, out: FrameOutput) -> None:
        """Decode what is due of the row's audio; a decoder failure fails this row alone."""
        if not row.audio.due(out.finish is not None):
            return
        try:
            samples = row.audio.emit(self.model.audio_stream)
        except Exception as exc:  # noqa: BLE001 (any failure of one row's decode is its own)
            out.finish, out.error = FinishReason.ERROR, f"audio decoding failed: {exc}"
            return
        out.audio = samples.float().cpu().numpy().astype("<f4").tobytes()
