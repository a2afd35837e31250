"""What a request produces, one type per kind of event (torch-free).

A step's new tokens travel as one `StreamChunk` per request, from the runtime through the
engine's `StreamChannel` to the caller unchanged; a chunk that ends a request has `finished` set.
A request's end is a `FinishedSnapshot`, taken by the runtime at the step that evicts it, which
`materialize` turns into the caller's `CompletionOutput`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

from inflight.runtime.request import GenerationRequest


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


# Built for every row of every step: slots and no `frozen`, whose __init__ costs ~10x.
@dataclass(slots=True)
class SampledRow:
    """The sampler's pick for one row, on the host: the token, and with logprobs asked for, its
    log-probability and the top alternatives."""

    token_id: int
    logprob: float | None = None
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None


@dataclass(slots=True)
class StreamChunk:
    """New token ids of a request and the text they released; the chunk that ends a completed
    request has `finished` and its `finish_reason` ("stop" or "length").

    Text may lag tokens: bytes of an unfinished UTF-8 character, or text that could still turn out
    to begin a stop string, are held back until they are settled.
    """

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[LogprobEntry] | None = None
    prompt_tokens: int = -1  # -1: unknown
    finished: bool = False
    finish_reason: str | None = None


def merge_chunks(chunks: Iterable[StreamChunk]) -> StreamChunk:
    """One chunk holding the tokens, text and logprobs of several in order (for a consumer that
    fell behind); the last one's end, if it is one, ends the merged chunk."""
    merged = StreamChunk()
    for chunk in chunks:
        merged.token_ids += chunk.token_ids
        merged.text += chunk.text
        if chunk.logprobs is not None:
            merged.logprobs = [*(merged.logprobs or []), *chunk.logprobs]
        merged.prompt_tokens = max(merged.prompt_tokens, chunk.prompt_tokens)
        merged.finished, merged.finish_reason = chunk.finished, chunk.finish_reason
    return merged


@dataclass
class FinishedSnapshot:
    """Everything a resident produced, taken at the step that evicted it."""

    request: GenerationRequest
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    stop_reason: str | int | None  # the stop string or stop token id that ended it, if any
    logprobs: list[LogprobEntry] | None = None
    prompt_logprobs: list[LogprobEntry | None] | None = None
    cached_tokens: int = 0


@dataclass(frozen=True)
class CompletionOutput:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" | "length" | "cancelled" | "error"
    stop_reason: str | int | None
    logprobs: tuple[LogprobEntry, ...] | None
    prompt_tokens: int
    # One entry per prompt token (None for the first, which nothing predicts), when asked for.
    prompt_logprobs: tuple[LogprobEntry | None, ...] | None = None
    cached_tokens: int = 0  # prompt tokens whose KV came from the context cache


def materialize(snapshot: FinishedSnapshot) -> CompletionOutput:
    """The caller's output of a finished request."""
    return CompletionOutput(
        text=snapshot.text,
        token_ids=tuple(snapshot.token_ids),
        finish_reason=snapshot.finish_reason.value,
        stop_reason=snapshot.stop_reason,
        logprobs=None if snapshot.logprobs is None else tuple(snapshot.logprobs),
        prompt_tokens=len(snapshot.request.prompt_token_ids),
        prompt_logprobs=None
        if snapshot.prompt_logprobs is None
        else tuple(snapshot.prompt_logprobs),
        cached_tokens=snapshot.cached_tokens,
    )
