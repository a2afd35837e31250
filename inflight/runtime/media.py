"""Media in prompts: placeholders expanded to the tokens an encoder output fills, and the checks
a request with media passes (torch-free).

A prompt names each image with one placeholder token (LLaVA's `<image>`); `expand` repeats it
as many times as the encoder yields embeddings for one image (or as many as the visual-token
pruner keeps, `mm_processor_kwargs={"keep_ratio": r}`) and records where, as the request's
`MediaItem`s. Once the request is seated, the step that starts its prefill runs the
encoder (for all the media that step starts, together) and the prefill reads its output in place
of those tokens' embeddings (see `Executor._encode` and `encoder_cache.py`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from inflight.runtime.request import GenerationRequest, MediaItem, RequestFieldError

MEDIA_FIELD = "multi_modal_data"
PROCESSOR_FIELD = "mm_processor_kwargs"


@dataclass(frozen=True)
class MediaSpec:
    """A kind of media a model takes: the token that stands for one item in a prompt, and how
    many embeddings its encoder yields per item."""

    kind: str
    placeholder: int
    tokens_per_item: int


def media_spec(specs: Mapping[str, MediaSpec], kind: str) -> MediaSpec:
    """How the model takes media of `kind` (a RequestFieldError when it takes none)."""
    spec = specs.get(kind)
    if spec is None:
        taken = ", ".join(specs) or "text only"
        raise RequestFieldError(f"this model takes no {kind} input (it takes {taken})", MEDIA_FIELD)
    return spec


def content_key(kind: str, data: np.ndarray) -> bytes:
    """What identifies an item's content: its preprocessed input, shape included."""
    h = hashlib.sha256(f"{kind}:{data.dtype}:{data.shape}".encode())
    h.update(np.ascontiguousarray(data).tobytes())
    return h.digest()


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
    prompt: Sequence[int], spec: MediaSpec, items: Sequence[np.ndarray], ratio: float = 1.0
) -> tuple[list[int], list[MediaItem]]:
    """The prompt with each placeholder token repeated for the tokens an item keeps (all
    `tokens_per_item`, or the share `ratio` the pruner keeps, at least one), and its media (the
    i-th placeholder is `items[i]`'s); a ValueError when the counts differ."""
    length = max(1, round(spec.tokens_per_item * ratio))
    count = sum(1 for t in prompt if t == spec.placeholder)
    if count != len(items):
        raise RequestFieldError(
            f"the prompt has {count} {spec.kind} placeholder(s) (token {spec.placeholder}) "
            f"for {len(items)} {spec.kind}(s): put one placeholder where each goes",
            MEDIA_FIELD,
        )
    ids: list[int] = []
    media: list[MediaItem] = []
    it = iter(items)
    for token in prompt:
        if token != spec.placeholder:
            ids.append(token)
            continue
        data = next(it)
        key = content_key(spec.kind, data)
        media.append(MediaItem(spec.kind, len(ids), length, key, data))
        ids += [spec.placeholder] * length
    return ids, media


def check_media(request: GenerationRequest, specs: Mapping[str, MediaSpec]) -> None:
    """A RequestFieldError unless the request's media are of kinds the model takes and lie
    exactly on its placeholder tokens, every placeholder token belonging to one."""
    prompt = request.prompt_token_ids
    end = 0
    for item in request.media:
        spec = media_spec(specs, item.kind)
        if not 1 <= item.length <= spec.tokens_per_item:
            raise RequestFieldError(
                f"a {item.kind} takes 1 to {spec.tokens_per_item} placeholder tokens (all, or "
                f"those the pruner keeps), got {item.length}",
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
