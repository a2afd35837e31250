"""Media in prompts: placeholders expanded to the tokens an encoder output fills, the checks
a request with media passes, and M-RoPE's positions around them (torch-free).

A prompt names each image or audio clip with one placeholder token (LLaVA's `<image>`,
Qwen2-VL's `<|image_pad|>`, Voxtral's `[AUDIO]`); `expand` repeats it as many times as the
encoder yields embeddings for the item (for an image, or as many as the visual-token pruner
keeps, `mm_processor_kwargs={"keep_ratio": r}`) and records where, as the request's
`MediaItem`s. Once the request is seated, the step that starts its prefill runs the encoders
(for all the media that step starts, together) and the prefill reads their output in place of
those tokens' embeddings (see `Executor._encode` and `encoder_cache.py`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from inflight.model.encoders.base import PreparedItem
from inflight.protocol.request import (
    MEDIA_FIELD,
    PROCESSOR_FIELD,
    GenerationRequest,
    MediaItem,
    RequestFieldError,
)
from inflight.runtime.host.features import RowFeature


@dataclass(frozen=True)
class MediaSpec:
    """A kind of media a model takes: the token that stands for one item in a prompt, and the
    tokens its expansion puts before and after the item's placeholder tokens (`opens`,
    `closes`; Gemma-4's begin- and end-of-image)."""

    kind: str
    placeholder: int
    opens: tuple[int, ...] = ()
    closes: tuple[int, ...] = ()


def media_spec(specs: Mapping[str, MediaSpec], kind: str) -> MediaSpec:
    """How the model takes media of `kind` (a RequestFieldError when it takes none)."""
    spec = specs.get(kind)
    if spec is None:
        taken = ", ".join(specs) or "text only"
        raise RequestFieldError(f"this model takes no {kind} input (it takes {taken})", MEDIA_FIELD)
    return spec


def keep_ratio(kwargs: Mapping[str, Any] | None) -> float:
    """The visual-token pruner's share of each image's tokens kept, from a request's
    `mm_processor_kwargs` ({"keep_ratio": r}, 0 < r <= 1; 1 when absent)."""
    kwargs = dict(kwargs or {})
    unknown = sorted(set(kwargs) - {"keep_ratio"})
    if unknown:
        raise RequestFieldError(
            f"mm_processor_kwargs has unknown keys {unknown}; known: ['keep_ratio']",
            PROCESSOR_FIELD,
        )
    ratio = kwargs.get("keep_ratio", 1.0)
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio <= 1:
        raise RequestFieldError(
            f"mm_processor_kwargs.keep_ratio must be a number in (0, 1], got {ratio!r}",
            PROCESSOR_FIELD,
        )
    return float(ratio)


def expand(
    prompt: Sequence[int],
    groups: Sequence[tuple[MediaSpec, Sequence[PreparedItem]]],
    ratio: float = 1.0,
) -> tuple[list[int], list[MediaItem]]:
    """The prompt with each placeholder token repeated for the tokens an item keeps (all its
    `tokens`; of an image, the share `ratio` the pruner keeps, at least one), between its
    spec's `opens` and `closes`, and its media in
    prompt order (the i-th placeholder of a kind is the i-th item of its group); a
    RequestFieldError when the counts differ."""
    pending: dict[int, tuple[MediaSpec, Iterator[PreparedItem]]] = {}
    for spec, items in groups:
        count = sum(1 for t in prompt if t == spec.placeholder)
        if count != len(items):
            raise RequestFieldError(
                f"the prompt has {count} {spec.kind} placeholder(s) (token {spec.placeholder}) "
                f"for {len(items)} {spec.kind}(s): put one placeholder where each goes",
                MEDIA_FIELD,
            )
        pending[spec.placeholder] = spec, iter(items)
    ids: list[int] = []
    media: list[MediaItem] = []
    for token in prompt:
        if token not in pending:
            ids.append(token)
            continue
        spec, items = pending[token]
        item = next(items)
        share = ratio if spec.kind == "image" else 1.0
        length = max(1, round(item.tokens * share))
        ids += spec.opens
        media.append(
            MediaItem(spec.kind, len(ids), length, item.key, item.data, item.tokens, item.grid)
        )
        ids += [token] * length
        ids += spec.closes
    return ids, media


def check_media(request: GenerationRequest, specs: Mapping[str, MediaSpec]) -> None:
    """A RequestFieldError unless the request's media are of kinds the model takes and lie
    exactly on its placeholder tokens, every placeholder token belonging to one."""
    prompt = request.prompt_token_ids
    end = 0
    for item in request.media:
        spec = media_spec(specs, item.kind)
        if not 1 <= item.length <= item.tokens:
            raise RequestFieldError(
                f"a {item.kind} of {item.tokens} tokens takes 1 to {item.tokens} placeholder "
                f"tokens (all, or those the pruner keeps), got {item.length}",
                MEDIA_FIELD,
            )
        if item.offset < end or item.offset + item.length > len(prompt):
            raise RequestFieldError(
                f"{item.kind} placeholders at {item.offset}..{item.offset + item.length} "
                "overlap another item or run past the prompt",
                MEDIA_FIELD,
            )
        if any(t != spec.placeholder for t in prompt[item.offset : item.offset + item.length]):
            raise RequestFieldError(
                f"the prompt's tokens at {item.offset}..{item.offset + item.length} are not "
                f"all {item.kind} placeholders (token {spec.placeholder})",
                MEDIA_FIELD,
            )
        end = item.offset + item.length
    for spec in specs.values():
        placed = sum(m.length for m in request.media if m.kind == spec.kind)
        if sum(1 for t in prompt if t == spec.placeholder) != placed:
            raise RequestFieldError(
                f"the prompt holds {spec.kind} placeholder tokens (token {spec.placeholder}) "
                f"with no {spec.kind} for them",
                MEDIA_FIELD,
            )


# M-RoPE (Qwen2-VL): an image's tokens sit at 3-D positions (t, h, w) offset by the position of
# its first token, and the text after it continues at that position plus the larger side of its
# grid; text tokens' three coordinates are equal, so their rotation is plain RoPE's at that one
# position. Tokens are indexed 0, 1, ... in the sequence (their KV slots); `mrope_shift` says
# how far each one's rotary position lies from its index.


def mrope_shift(media: Sequence[MediaItem], start: int, count: int) -> np.ndarray:
    """Each of tokens start .. start + count's rotary position minus its index (an image's
    tokens: its first one's; their own 3-D positions come from `mrope_positions`)."""
    index = np.arange(start, start + count)
    shift = np.zeros(count, np.int64)
    before = 0  # the shift of the text before the item
    for item in media:
        end = item.offset + item.length
        if end > start and item.offset < start + count:
            inside = (index >= item.offset) & (index < end)
            shift[inside] = before - (index[inside] - item.offset)
        before += item.span - item.length
        shift[index >= end] = before
    return shift


def mrope_positions(media: Sequence[MediaItem], which: int) -> np.ndarray:
    """The 3-D positions [3, tokens] of every token of `media[which]`'s grid (before any
    pruning), in the order its encoder yields them: temporal, then height, then width. An
    item without a grid (an audio clip) sits at text's positions, its three coordinates
    equal."""
    item = media[which]
    start = item.offset + sum(m.span - m.length for m in media[:which])
    if item.grid is None:
        return np.tile(np.arange(item.length), (3, 1)) + start
    return np.indices(item.grid).reshape(3, -1) + start


class MediaChecks(RowFeature):
    """Media as a per-row feature at admission: a request's media must be of kinds the model
    takes (`specs`; none for a text model), each lying exactly on its placeholder tokens. Their
    encoding, when the prefill starts, is the device's (`device/inputs.py`)."""

    def __init__(self, specs: Mapping[str, MediaSpec]) -> None:
        self.specs = specs

    def check(self, request: GenerationRequest) -> None:
        check_media(request, self.specs)
