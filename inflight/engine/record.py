"""A request's record, shared by its caller and the actor, and the caller's `RequestHandle`."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from enum import Enum

from inflight.engine.channel import StreamChannel
from inflight.engine.errors import RequestCancelled, RequestFailed
from inflight.protocol.outputs import RequestOutput, StreamChunk, merge_chunks
from inflight.protocol.request import GenerationRequest


class TerminalStatus(Enum):
    COMPLETED = "completed"  # ended on its own terms (stop, length)
    CANCELLED = "cancelled"
    FAILED = "failed"


class RequestRecord:
    """The outcome, once published, decides that a request is over; exactly one is published."""

    def __init__(self, request_id: int, request: GenerationRequest, channel: StreamChannel) -> None:
        self.id = request_id
        self.request = request
        self.channel = channel
        self.submitted_at = time.monotonic()
        self.admitted_at: float | None = None  # when the actor seated it (founder or joiner)
        self.status: TerminalStatus | None = None
        self.output: RequestOutput | None = None
        self.error = ""
        self._done = threading.Event()
        # Set with the outcome, or by a cancel: what a caller parked in get() waits for.
        self._wakeup = threading.Event()

    @property
    def cancel_requested(self) -> bool:
        return self.channel.is_cancelled

    @property
    def published(self) -> bool:
        return self._done.is_set()

    def publish(self, status: TerminalStatus, output: RequestOutput | None, error: str) -> bool:
        """Set the outcome; False (and nothing changes) when one was already published."""
        if self._done.is_set():
            return False
        self.status, self.output, self.error = status, output, error
        self._done.set()
        self._wakeup.set()
        return True

    def request_cancel(self) -> None:
        """Flag the request for cancellation, and release a caller waiting for its outcome."""
        self.channel.cancel()
        self._wakeup.set()

    def wait_outcome_or_cancel(self, timeout: float | None) -> bool:
        """Wait until the outcome is published or a cancel is asked for; False on timeout."""
        return self._wakeup.wait(timeout)


class RequestHandle(Iterator[StreamChunk]):
    """The caller's side of a submitted request. It holds the record, not the engine, so it stays
    usable after the engine is gone.

    Iterating it (with `for`, or `async for` on an asyncio loop, which parks no thread) yields
    the request's chunks as they come, those of one sequence merged when the consumer fell
    behind; a completed request ends with one chunk per sequence with `finished` set, and a
    request that did not complete raises RequestCancelled or RequestFailed where its stream
    ends. Abandoning the iteration early (`close()`) cancels the request.
    """

    def __init__(self, record: RequestRecord, wake_actor: Callable[[], None]) -> None:
        self._record = record
        self._wake_actor = wake_actor
        self._started = False  # the consumer has begun to iterate
        self._ended = False  # the consumer has seen the end of the stream
        self._unfinished = record.request.params.n  # sequences whose end it has not seen
        self._ready: list[StreamChunk] = []  # merged chunks not handed out yet

    @property
    def id(self) -> int:
        return self._record.id

    @property
    def request(self) -> GenerationRequest:
        return self._record.request

    def stream(self) -> StreamChannel:
        return self._record.channel

    @property
    def queue_time(self) -> float | None:
        """Seconds from submit() until the actor seated the request; None if it never was."""
        record = self._record
        return None if record.admitted_at is None else record.admitted_at - record.submitted_at

    def ready(self) -> bool:
        """Whether an outcome has been published."""
        return self._record.published

    def cancel(self) -> None:
        """Ask for cancellation; returns at once. Does nothing once the outcome is published."""
        if not self._record.published:
            self._record.request_cancel()
            self._wake_actor()

    def close(self) -> None:
        """Stop consuming: cancels the request unless its stream already ended cleanly."""
        if not self._ended:
            self._ended = True
            self.cancel()

    def get(self, timeout: float | None = None) -> RequestOutput:
        """Wait for the outcome: the output, or RequestCancelled / RequestFailed.

        A request its caller cancelled raises RequestCancelled at once, without waiting for the
        actor to retire it, a caller already waiting here included.
        """
        record = self._record
        if not record.cancel_requested and not record.wait_outcome_or_cancel(timeout):
            raise TimeoutError(f"Request {record.id} has no outcome after {timeout} s")
        if not record.published and record.cancel_requested and not record.channel.is_finished:
            raise RequestCancelled(f"Request {record.id} was cancelled.")
        if record.status is TerminalStatus.CANCELLED:
            raise RequestCancelled(f"Request {record.id} was cancelled.")
        if record.status is TerminalStatus.FAILED:
            raise RequestFailed(f"Request {record.id} failed: {record.error}")
        assert record.output is not None
        return record.output

    # -- iteration ------------------------------------------------------------------------------

    def __next__(self) -> StreamChunk:
        channel = self._record.channel
        self._started = True
        while not self._ended:
            ended = channel.ended  # read first: every chunk pushed before the end is popped
            chunks = channel.pop_all()
            if chunks or self._ready:
                return self._take(chunks)
            if ended:
                self._end()
            channel.wait_any()
        raise StopIteration

    def __aiter__(self) -> AsyncIterator[StreamChunk]:
        return self

    async def __anext__(self) -> StreamChunk:
        channel = self._record.channel
        loop = asyncio.get_running_loop()
        woken = asyncio.Event()
        channel.set_waker(lambda: loop.call_soon_threadsafe(woken.set))
        self._started = True
        try:
            while not self._ended:
                ended = channel.ended
                chunks = channel.pop_all()
                if chunks or self._ready:
                    return self._take(chunks)
                if ended:
                    self._end()
                await woken.wait()
                woken.clear()
        finally:
            channel.set_waker(None)
        raise StopAsyncIteration

    def _take(self, chunks: list[StreamChunk]) -> StreamChunk:
        self._ready += chunks if len(chunks) < 2 else merge_chunks(chunks)
        chunk = self._ready.pop(0)
        if chunk.finished:
            self._unfinished -= 1
            self._ended = self._unfinished == 0
        return chunk

    def _end(self) -> None:
        """The stream ended without a finished chunk: raise what ended it."""
        self._ended = True
        self.get()  # raises RequestCancelled or RequestFailed
        raise RequestFailed(f"Request {self.id}'s stream ended without its last chunk")

    def __del__(self) -> None:
        # A stream abandoned mid-iteration cancels its request instead of letting it decode on.
        if getattr(self, "_started", False) and not self._ended and not self._record.published:
            self._record.channel.cancel()
