"""`StreamChannel`: a request's chunks from the actor to one consumer, and its cancel flag."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from inflight.protocol.outputs import StreamChunk


class StreamChannel:
    """One producer (the actor) pushes chunks; one consumer pops them.

    Cancellation is a flag on the channel, set from any thread and read by the actor at the top of
    every step: it is never a queued command, so it cannot be lost under overload. The producer
    pushes the terminal chunk before it marks the channel finished. A request that ends without
    completing (cancelled, failed) gets its channel cancelled, so a consumer never waits forever.

    A consumer that cannot block a thread (an asyncio loop) sets a waker: it is called, from the
    producer's thread, after every change a consumer may be waiting for.
    """

    def __init__(self) -> None:
        self._chunks: deque[StreamChunk] = deque()
        self._cond = threading.Condition()
        self._finished = False
        self._cancelled = False
        self._waker: Callable[[], None] | None = None

    # -- producer -------------------------------------------------------------------------------

    def push(self, chunk: StreamChunk) -> None:
        with self._cond:
            self._chunks.append(chunk)
            self._cond.notify_all()
            waker = self._waker
        if waker is not None:
            waker()

    def finish(self) -> None:
        with self._cond:
            self._finished = True
            self._cond.notify_all()
            waker = self._waker
        if waker is not None:
            waker()

    # -- consumer -------------------------------------------------------------------------------

    def set_waker(self, waker: Callable[[], None] | None) -> None:
        with self._cond:
            self._waker = waker

    def wait_pop(self, timeout: float | None = None) -> StreamChunk | None:
        """The next chunk; None on timeout, or once finished or cancelled with nothing left."""
        with self._cond:
            self._cond.wait_for(lambda: self._chunks or self._finished or self._cancelled, timeout)
            return self._chunks.popleft() if self._chunks else None

    def pop_all(self) -> list[StreamChunk]:
        """Every chunk waiting, oldest first (none: an empty list); never blocks."""
        with self._cond:
            chunks = list(self._chunks)
            self._chunks.clear()
            return chunks

    def wait_any(self, timeout: float | None = None) -> None:
        """Block until a chunk waits or the stream has ended (or the timeout passes)."""
        with self._cond:
            self._cond.wait_for(lambda: self._chunks or self._finished or self._cancelled, timeout)

    def cancel(self) -> None:
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()
            waker = self._waker
        if waker is not None:
            waker()

    @property
    def ended(self) -> bool:
        """Finished or cancelled: a consumer waits for nothing more than the chunks waiting."""
        return self._finished or self._cancelled

    @property
    def is_finished(self) -> bool:
        return self._finished

    @property
    def is_cancelled(self) -> bool:
        return self._cancelled
