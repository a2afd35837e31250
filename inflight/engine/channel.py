"""`StreamChannel`: a request's token stream from the actor to one consumer, and its cancel flag."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from inflight.runtime.stepped import FinishReason, LogprobEntry


# Built for every row of every step: slots and no `frozen`, whose __init__ costs ~10x.
@dataclass(slots=True)
class StreamChunk:
    """New tokens and text of one step; the terminal chunk has `finished` and a reason."""

    token_ids: tuple[int, ...] = ()
    text: str = ""
    logprobs: tuple[LogprobEntry, ...] | None = None
    finished: bool = False
    reason: FinishReason | None = None
    prompt_tokens: int = -1  # -1: unknown


class StreamChannel:
    """One producer (the actor) pushes chunks; one consumer pops them.

    Cancellation is a flag on the channel, set from any thread and read by the actor at the top of
    every step: it is never a queued command, so it cannot be lost under overload. The producer
    pushes the terminal chunk before it marks the channel finished. A request that ends without
    completing (cancelled, failed) gets its channel cancelled, so a consumer never waits forever.
    """

    def __init__(self) -> None:
        self._chunks: deque[StreamChunk] = deque()
        self._cond = threading.Condition()
        self._finished = False
        self._cancelled = False
        self._reason: FinishReason | None = None

    # -- producer -------------------------------------------------------------------------------

    def push(self, chunk: StreamChunk) -> None:
        with self._cond:
            self._chunks.append(chunk)
            if chunk.finished:
                self._reason = chunk.reason
            self._cond.notify_all()

    def finish(self) -> None:
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    # -- consumer -------------------------------------------------------------------------------

    def try_pop(self) -> StreamChunk | None:
        with self._cond:
            return self._chunks.popleft() if self._chunks else None

    def wait_pop(self, timeout: float | None = None) -> StreamChunk | None:
        """The next chunk; None on timeout, or once finished or cancelled with nothing left."""
        with self._cond:
            self._cond.wait_for(lambda: self._chunks or self._finished or self._cancelled, timeout)
            return self._chunks.popleft() if self._chunks else None

    def __iter__(self) -> Iterator[StreamChunk]:
        """Every chunk until the stream ends (finished, or cancelled and drained)."""
        while True:
            chunk = self.wait_pop()
            if chunk is None:
                return
            yield chunk
            if chunk.finished:
                return

    def cancel(self) -> None:
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()

    @property
    def is_finished(self) -> bool:
        return self._finished

    @property
    def is_cancelled(self) -> bool:
        return self._cancelled

    @property
    def reason(self) -> FinishReason | None:
        return self._reason
