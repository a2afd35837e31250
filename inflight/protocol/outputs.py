"""What a request produces, one type per kind of event (torch-free).

A step's new tokens travel as one `StreamChunk` per sequence, from the runtime through the
engine's `StreamChannel` to the caller unchanged; a request's last chunks have `finished` set.
A sequence's end is a `FinishedSnapshot`, taken by the runtime at the step that evicts it; once
all of a request's sequences ended, `materialize` turns their snapshots into the caller's
`RequestOutput` (one `CompletionOutput` per sequence).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum

from inflight.protocol.request import GenerationRequest


class FinishReason(Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context capacity
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float
    token: str  # the token's text (a partial UTF-8 character shows as U+FFFD)
    bytes: bytes


@dataclass(frozen=True)
class LogprobEntry:
    """The chosen token's log-probability and the most likely alternatives, best first."""

    token_id: int
    logprob: float
    token: str
    bytes: bytes
    top: tuple[TopLogprob, ...] = ()


@dataclass(slots=True)
class StreamChunk:
    """New token ids of one sequence of a request (`index`: 0 unless it asked for n > 1) and the
    text they released. When a request completes, one chunk per sequence has `finished` and
    that sequence's `finish_reason` ("stop" or "length").

    Text may lag tokens: bytes of an unfinished UTF-8 character, or text that could still turn out
    to begin a stop string, are held back until they are settled.
    """

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[LogprobEntry] | None = None
    prompt_tokens: int = -1  # -1: unknown
    finished: bool = False
    finish_reason: str | None = None
    index: int = 0
    # Speech: new audio (float32 little-endian samples at the model's rate) and the frames it
    # decodes (one tuple of codebook codes each; their first codes are `token_ids`).
    audio: bytes = b""
    codes: list[tuple[int, ...]] = field(default_factory=list)
    # Block diffusion asked for drafts: the canvas being denoised, as its last step's argmax
    # (each draft replaces the one before; the canvas's tokens, once it ends, replace both).
    draft: list[int] | None = None
    cached_tokens: int = 0  # prompt tokens whose KV came from the context cache


def merge_chunks(chunks: Iterable[StreamChunk]) -> list[StreamChunk]:
    """The chunks of a consumer that fell behind, merged where they follow one another in one
    sequence: tokens, text and logprobs in order; the last one's end, if it is one, ends it."""
    merged: list[StreamChunk] = []
    for chunk in chunks:
        last = merged[-1] if merged else None
        if last is None or last.index != chunk.index or last.finished:
            merged.append(
                replace(
                    chunk,
                    token_ids=list(chunk.token_ids),
                    logprobs=None if chunk.logprobs is None else list(chunk.logprobs),
                    codes=list(chunk.codes),
                )
            )
            continue
        last.token_ids += chunk.token_ids
        last.text += chunk.text
        last.audio += chunk.audio
        last.codes += chunk.codes
        if chunk.logprobs is not None:
            last.logprobs = [*(last.logprobs or []), *chunk.logprobs]
        last.prompt_tokens = max(last.prompt_tokens, chunk.prompt_tokens)
        last.finished, last.finish_reason = chunk.finished, chunk.finish_reason
        # The latest draft stands; tokens that came after it end it.
        if chunk.draft is not None:
            last.draft = chunk.draft
        elif chunk.token_ids:
            last.draft = None
    return merged


@dataclass
class FinishedSnapshot:
    """Everything a resident (one sequence of a request) produced, taken at the step that
    evicted it."""

    request: GenerationRequest
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    stop_reason: str | int | None  # the stop string or stop token id that ended it, if any
    logprobs: list[LogprobEntry] | None = None
    prompt_logprobs: list[LogprobEntry | None] | None = None
    cached_tokens: int = 0
    index: int = 0  # which of the request's n sequences
    error: str = ""  # why it failed (finish_reason ERROR)
    audio: bytes = b""  # a spoken reply's audio (float32 little-endian samples)


@dataclass(frozen=True)
class CompletionOutput:
    """One generated sequence."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" | "length" | "cancelled" | "error"
    stop_reason: str | int | None
    logprobs: tuple[LogprobEntry, ...] | None
    # A spoken reply's audio: float32 little-endian mono samples at the model's sample rate.
    audio: bytes = b""


@dataclass(frozen=True)
class RequestOutput:
    """A request's outcome: its `n` sequences (in index order) and what concerns its prompt.

    `text`, `token_ids`, `finish_reason`, `stop_reason` and `logprobs` are those of the first
    sequence: the only one unless the request asked for n > 1."""

    outputs: tuple[CompletionOutput, ...]
    prompt_tokens: int
    # One entry per prompt token (None for the first, which nothing predicts), when asked for.
    prompt_logprobs: tuple[LogprobEntry | None, ...] | None = None
    cached_tokens: int = 0  # prompt tokens whose KV came from the context cache

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.outputs[0].stop_reason

    @property
    def logprobs(self) -> tuple[LogprobEntry, ...] | None:
        return self.outputs[0].logprobs


def materialize(snapshots: Sequence[FinishedSnapshot]) -> RequestOutput:
    """The caller's output of a finished request, from the snapshots of all its sequences."""
    ordered = sorted(snapshots, key=lambda s: s.index)
    first = ordered[0]
    return RequestOutput(
        outputs=tuple(
            CompletionOutput(
                index=s.index,
                text=s.text,
                token_ids=tuple(s.token_ids),
                finish_reason=s.finish_reason.value,
                stop_reason=s.stop_reason,
                logprobs=None if s.logprobs is None else tuple(s.logprobs),
                audio=s.audio,
            )
            for s in ordered
        ),
        prompt_tokens=len(first.request.prompt_token_ids),
        prompt_logprobs=None if first.prompt_logprobs is None else tuple(first.prompt_logprobs),
        cached_tokens=first.cached_tokens,
    )
