"""A request's record, shared by its caller and the actor, and the caller's `RequestHandle`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import Enum

from inflight.engine.channel import StreamChannel
from inflight.engine.errors import RequestCancelled, RequestFailed
from inflight.runtime.request import GenerationRequest
from inflight.runtime.stepped import CompletionOutput


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
        self.output: CompletionOutput | None = None
        self.error = ""
        self._done = threading.Event()

    @property
    def cancel_requested(self) -> bool:
        return self.channel.is_cancelled

    @property
    def published(self) -> bool:
        return self._done.is_set()

    def publish(self, status: TerminalStatus, output: CompletionOutput | None, error: str) -> bool:
        """Set the outcome; False (and nothing changes) when one was already published."""
        if self._done.is_set():
            return False
        self.status, self.output, self.error = status, output, error
        self._done.set()
        return True

    def wait(self, timeout: float | None) -> bool:
        return self._done.wait(timeout)


class RequestHandle:
    """The caller's side of a submitted request. It holds the record, not the engine, so it stays
    usable after the engine is gone."""

    def __init__(self, record: RequestRecord, wake_actor: Callable[[], None]) -> None:
        self._record = record
        self._wake_actor = wake_actor

    @property
    def id(self) -> int:
        return self._record.id

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
            self._record.channel.cancel()
            self._wake_actor()

    def get(self, timeout: float | None = None) -> CompletionOutput:
        """Wait for the outcome: the output, or RequestCancelled / RequestFailed.

        A request its caller cancelled raises RequestCancelled at once, without waiting for the
        actor to retire it.
        """
        record = self._record
        if not record.published and record.cancel_requested and not record.channel.is_finished:
            raise RequestCancelled(f"Request {record.id} was cancelled.")
        if not record.wait(timeout):
            raise TimeoutError(f"Request {record.id} has no outcome after {timeout} s")
        if record.status is TerminalStatus.CANCELLED:
            raise RequestCancelled(f"Request {record.id} was cancelled.")
        if record.status is TerminalStatus.FAILED:
            raise RequestFailed(f"Request {record.id} failed: {record.error}")
        assert record.output is not None
        return record.output
