"""What the per-row features add to a step's forward pass: the encoder outputs of media (and
M-RoPE's shifted positions), each row's LoRA adapter, each row's recurrent state slot. The
executor asks every `ForwardInput` of its runtime in turn instead of branching on each.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from inflight.model.contract import CausalLM, MediaEmbeds, MediaEncoder
from inflight.model.encoders.vision import prune_image_tokens
from inflight.model.layers.mamba import MambaRows
from inflight.model.transfer import to_device
from inflight.protocol.request import MediaItem
from inflight.runtime.device.batch_builder import RaggedBatch
from inflight.runtime.device.encoder_cache import EncoderCache
from inflight.runtime.host.media import mrope_positions, mrope_shift
from inflight.runtime.host.residents import Resident
from inflight.runtime.host.rows import ScheduledRow

log = logging.getLogger(__name__)


class ForwardInput:
    """A feature's part in a forward pass; every hook does nothing unless it says otherwise."""

    def prepare(self, rows: Sequence[ScheduledRow]) -> dict[Resident, str]:
        """Work the step needs before its batch is built; the residents whose rows cannot run,
        and why (each fails its request alone)."""
        return {}

    def unfolds(self, rows: Sequence[ScheduledRow]) -> bool:
        """Whether the rows may be packed as one decode row per token (and replay a graph)."""
        return True

    def add(self, rows: Sequence[ScheduledRow], batch: RaggedBatch) -> None:
        """Put the feature's inputs into `batch.forward`."""


@dataclass
class KeptMedia:
    """A stretch of a prompt's media positions (`start` .. `end`) whose hidden states a step
    kept for a talker: rows `rows` of that step's `MediaEmbeds.kept`, once it has run."""

    start: int
    end: int
    media: MediaEmbeds
    rows: slice

    def hidden(self) -> torch.Tensor:
        assert self.media.kept is not None, "read before the step that keeps it ran"
        return self.media.kept[self.rows]


class MediaInputs(ForwardInput):
    """Images and audio: the step that starts a resident's prefill encodes the media it still
    needs (from the encoder cache where it holds them; the step's other items together, one
    encoder run per kind), and every chunk takes the encoder outputs its placeholder positions
    cover (such a step runs eagerly). With M-RoPE, the tokens after an image sit at shifted
    rotary positions, decode rows too. An item that fails to encode fails its request alone.
    With `keep_layer` (a model that speaks), a step keeps the hidden states entering that
    decoder layer of the media of requests asking for audio (`Resident.features.kept_media`)."""

    def __init__(
        self,
        encoders: Mapping[str, MediaEncoder],
        cache: EncoderCache,
        mrope: bool,
        device: torch.device,
        keep_layer: int | None = None,
    ) -> None:
        self.encoders = encoders
        self.cache = cache
        self.mrope = mrope
        self.device = device
        self.keep_layer = keep_layer

    @torch.inference_mode()
    def prepare(self, rows: Sequence[ScheduledRow]) -> dict[Resident, str]:
        """Give each resident whose prefill starts in this step the encoder outputs of its
        media (None for an item whose placeholders precede the row, their KV being cached)."""
        starting = [
            row
            for row in rows
            if row.resident.request.media and row.resident.features.media is None
        ]
        found: dict[bytes, torch.Tensor | None] = {}
        missing: dict[str, dict[bytes, MediaItem]] = {}
        for row in starting:
            for item in row.resident.request.media:
                if item.offset + item.length > row.past_len and item.key not in found:
                    found[item.key] = self.cache.get(item.key)
                    if found[item.key] is None:
                        missing.setdefault(item.kind, {})[item.key] = item
        errors: dict[bytes, str] = {}
        for kind, items in missing.items():
            for key, output in self._encode(kind, items, errors).items():
                self.cache.put(key, output)
                found[key] = output
        failed: dict[Resident, str] = {}
        for row in starting:
            media = row.resident.request.media
            error = next((errors[item.key] for item in media if item.key in errors), None)
            if error is not None:
                failed[row.resident] = error
                continue
            row.resident.features.media = [_kept(found.get(m.key), m.length) for m in media]
        return failed

    def _encode(
        self, kind: str, items: dict[bytes, MediaItem], errors: dict[bytes, str]
    ) -> dict[bytes, torch.Tensor]:
        """The items' encoder outputs, all in one run (a pageable copy waits for the step in
        flight: once a step and kind, for all its items; pinning a new size costs ~100 ms on an
        H200, measured). Where that run fails, each item is encoded alone, so that only those
        that fail again fail (`errors`, by key)."""
        encoder = self.encoders[kind]
        try:
            outputs = encoder.encode([item.data for item in items.values()])
            return dict(zip(items, outputs, strict=True))
        except Exception:
            log.exception(
                "encoding %d %s item(s) failed; encoding them one by one", len(items), kind
            )
        encoded: dict[bytes, torch.Tensor] = {}
        for key, item in items.items():
            try:
                encoded[key] = encoder.encode([item.data])[0]
            except Exception as exc:
                errors[key] = f"its {kind} could not be encoded: {type(exc).__name__}: {exc}"
        return encoded

    def unfolds(self, rows: Sequence[ScheduledRow]) -> bool:
        return not any(self._spans(row) for row in rows)

    def add(self, rows: Sequence[ScheduledRow], batch: RaggedBatch) -> None:
        """The step's media placeholder tokens (their packed indices, the encoder output each
        takes and, M-RoPE, their 3-D positions), and M-RoPE's shift of the positions."""
        forward = batch.forward
        indices: list[int] = []
        parts: list[torch.Tensor] = []
        grids: list[np.ndarray] = []
        keeps: list[tuple[Resident, int, int, slice]] = []
        offset = 0
        for row in rows:
            start = row.past_len
            media = row.resident.request.media
            spoken = self.keep_layer is not None and row.resident.request.generate_audio
            for i, lo, hi, (output, kept) in self._spans(row):
                item = media[i]
                if spoken:
                    keeps.append(
                        (row.resident, lo, hi, slice(len(indices), len(indices) + hi - lo))
                    )
                indices += range(offset + lo - start, offset + hi - start)
                parts.append(output[lo - item.offset : hi - item.offset])
                if self.mrope:
                    positions = mrope_positions(media, i)
                    if kept is not None:
                        positions = positions[:, kept]
                    grids.append(positions[:, lo - item.offset : hi - item.offset])
            offset += len(row.token_ids)
        if parts:
            forward.media = MediaEmbeds(
                to_device(indices, torch.int64, self.device),
                torch.cat(parts),
                to_device(np.concatenate(grids, axis=1), torch.int64, self.device)
                if grids
                else None,
                keep_layer=self.keep_layer if keeps else None,
            )
            for resident, lo, hi, kept_rows in keeps:
                resident.features.kept_media.append(KeptMedia(lo, hi, forward.media, kept_rows))
        if self.mrope and any(row.resident.request.media for row in rows):
            shift = np.concatenate(
                [
                    mrope_shift(row.resident.request.media, row.past_len, len(row.token_ids))
                    for row in rows
                ]
            )
            forward.positions += to_device(shift, torch.int64, self.device)

    @staticmethod
    def _spans(row: ScheduledRow) -> list[tuple[int, int, int, tuple[torch.Tensor, object]]]:
        """(item index, first position, end) of each stretch of the row's tokens that takes an
        item's encoder output, with that output."""
        embeds = row.resident.features.media
        start, end = row.past_len, row.past_len + len(row.token_ids)
        if not embeds or start >= row.resident.prompt_len:
            return []
        spans = []
        for i, (item, encoded) in enumerate(zip(row.resident.request.media, embeds, strict=True)):
            lo, hi = max(start, item.offset), min(end, item.offset + item.length)
            if lo < hi and encoded is not None:
                spans.append((i, lo, hi, encoded))
        return spans


class AdapterInputs(ForwardInput):
    """LoRA: each packed row runs with its resident's adapter slot (-1: the base model)."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model

    def add(self, rows: Sequence[ScheduledRow], batch: RaggedBatch) -> None:
        slots = [row.resident.features.adapter for row in rows]
        if max(slots) < 0:
            return
        packed = [slots[i] for i in batch.row_index]
        lengths = batch.forward.attention.query_lens_host
        batch.forward.lora = self.model.lora.mapping(list(zip(packed, lengths, strict=True)))


class RecurrentInputs(ForwardInput):
    """A hybrid's rows read and write their resident's state slot (its resident slot); a row's
    first chunk starts from zero. A sequence's tokens never run as separate decode rows: each
    would read the same state."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def unfolds(self, rows: Sequence[ScheduledRow]) -> bool:
        return False

    def add(self, rows: Sequence[ScheduledRow], batch: RaggedBatch) -> None:
        packed = [rows[i] for i in batch.row_index]
        slots = [row.resident.ref.slot for row in packed]
        fresh = [row.past_len == 0 for row in packed]
        batch.forward.recurrent = MambaRows.build(slots, fresh, self.device)


def _kept(output: torch.Tensor | None, length: int) -> tuple[torch.Tensor, object] | None:
    """An item's encoder output as its prompt takes it: the tokens the visual-token pruner
    keeps (with their indices; None: all are kept)."""
    if output is None:
        return None
    kept = prune_image_tokens(output, length)
    return (output, None) if kept is None else (output[kept], kept.cpu().numpy())
