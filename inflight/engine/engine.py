"""`RequestEngine`: the in-flight batching actor.

One actor thread owns the runtime. `submit()` and `cancel()` work from any thread and never wait
for it: submit posts to a bounded command queue behind an admission gate, cancel sets a flag. The
actor founds a batch with the head of its queue, then ticks: each tick seats as many queued heads
as may join (in strict order; a head that may not join waits and blocks those behind it), runs one
step of the execution, and commits the step's result, publishing the outcome of every resident the
step evicted. A drained batch never admits: the next head founds a new one. The queue is in
arrival order (FCFS), or under the priority policy in order of (priority, arrival): a request
jumps the queue, never a running batch.
"""

from __future__ import annotations

import gc
import itertools
import logging
import threading
import time
import weakref
from bisect import insort
from collections import deque
from collections.abc import Sequence
from enum import Enum

from inflight.engine.channel import StreamChannel
from inflight.engine.compatibility import BatchCompatibility
from inflight.engine.config import EngineConfig
from inflight.engine.coordinator import Commit, RequestCoordinator
from inflight.engine.errors import RequestCancelled, RequestFailed, SubmitError
from inflight.engine.metrics import EngineMetrics
from inflight.engine.record import RequestHandle, RequestRecord, TerminalStatus
from inflight.protocol.outputs import RequestOutput, StreamChunk
from inflight.protocol.request import GenerationRequest
from inflight.protocol.stepped import (
    AdmissionAnswer,
    ExecutionFactory,
    SteppedExecution,
)

log = logging.getLogger(__name__)


class ShutdownMode(Enum):
    DRAIN = "drain"  # finish every accepted request, then stop
    CANCEL = "cancel"  # stop queued requests and residents as soon as possible


class CommandQueue:
    """Submitted records on their way to the actor: bounded, never blocks, never grows."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: deque[RequestRecord] = deque()
        self._lock = threading.Lock()

    def try_push(self, record: RequestRecord) -> bool:
        with self._lock:
            if len(self._items) >= self.capacity:
                return False
            self._items.append(record)
            return True

    def __len__(self) -> int:
        return len(self._items)

    def pop_batch(self, limit: int) -> list[RequestRecord]:
        with self._lock:
            return [self._items.popleft() for _ in range(min(limit, len(self._items)))]


class RequestEngine:
    """Submit requests from any thread; one actor thread runs them in in-flight batches.

    Refusals: a request the runtime cannot serve (an option it does not serve, a bad prompt: its
    `check`, which a request prepared by the runtime has passed already) is a ValueError naming
    the problem and the alternative (permanent: counted in neither `submitted` nor `refused`);
    backpressure (too many requests in flight, a full command queue), shutdown and a runtime
    that can serve no more are a SubmitError (transient, or for good once `fault` is set).
    Dropping the last reference to the engine shuts it down in CANCEL mode.
    """

    def __init__(self, execution_factory: ExecutionFactory, config: EngineConfig | None = None):
        config = config or EngineConfig()
        caps = execution_factory.capabilities
        if not caps.stepped:
            raise RuntimeError(
                "this runtime cannot run stepped execution (e.g. it spans several ranks); "
                "it stays on the blocking path"
            )
        if config.max_batch_size > 1 and not caps.seated_admission:
            raise RuntimeError(
                "this deployment cannot seat a request mid-flight; use max_batch_size=1"
            )
        if config.max_batch_size > caps.max_batch_size:
            raise RuntimeError(
                f"max_batch_size {config.max_batch_size} exceeds the runtime's capacity of "
                f"{caps.max_batch_size} residents"
            )
        self.config = config
        self._factory = execution_factory
        self.metrics = EngineMetrics()
        self._actor = _Actor(execution_factory, config, self.metrics)
        weakref.finalize(self, self._actor.shutdown, ShutdownMode.CANCEL)

    def submit(
        self, request: GenerationRequest, channel: StreamChannel | None = None
    ) -> RequestHandle:
        """Accept a request (its tokens stream into `channel`, or a new one); never waits for
        the actor. A request the runtime has not checked is checked here, and its priority
        against the scheduling policy."""
        self._actor.check_runtime()
        self.config.check(request)
        request = self._factory.check(request)
        return self._actor.submit(request, channel or StreamChannel())

    def handle_request(self, request: GenerationRequest) -> RequestOutput | None:
        """Submit and wait, for callers written against a blocking API: the output, or None when
        the request was refused, cancelled or failed. Never raises."""
        try:
            return self.submit(request).get()
        except (ValueError, SubmitError, RequestCancelled, RequestFailed):
            return None

    def cancel(self, request_id: int) -> None:
        """Cancel by id; an unknown or finished id is ignored. Never waits."""
        self._actor.cancel(request_id)

    def shutdown(self, mode: ShutdownMode = ShutdownMode.DRAIN) -> None:
        """Stop accepting, then DRAIN (finish everything accepted) or CANCEL; waits for the actor.
        Only the first call's mode counts."""
        self._actor.shutdown(mode)

    def __enter__(self) -> RequestEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown(ShutdownMode.DRAIN)

    @property
    def queued(self) -> int:
        """Requests accepted and waiting for a seat: in the actor's FIFO or still on their way
        to it in the command queue."""
        return len(self._actor.queued) + len(self._actor.commands)

    @property
    def resident(self) -> int:
        return self._actor.resident_count

    @property
    def running(self) -> bool:
        return not self._actor.shutdown_called and self._actor.fault is None

    @property
    def fault(self) -> str | None:
        """Why the actor stopped on an unexpected error (every accepted request then failed and
        admission closed), or None."""
        return self._actor.fault


class _Actor:
    """The engine's state and its thread; held by the facade, never the other way round."""

    def __init__(
        self, factory: ExecutionFactory, config: EngineConfig, metrics: EngineMetrics
    ) -> None:
        self.factory = factory
        self.config = config
        self.metrics = metrics
        self.compatibility = BatchCompatibility(factory.capabilities.per_row_fields)
        self.commands = CommandQueue(config.command_queue_capacity)
        self.queued: deque[RequestRecord] = deque()  # the actor's queue, in seating order
        self.ledger = RequestCoordinator()
        self.resident_count = 0
        self.wake = threading.Event()
        self.stop_mode: ShutdownMode | None = None
        self.shutdown_called = False
        self.fault: str | None = None
        self._gate = threading.Lock()  # "accepting" and a push are one decision
        self._accepting = True
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._registry: weakref.WeakValueDictionary[int, RequestRecord] = (
            weakref.WeakValueDictionary()
        )
        self._registry_lock = threading.Lock()
        self._shutdown_lock = threading.Lock()
        self._founder: GenerationRequest | None = None
        self.thread = threading.Thread(target=self._run, name="inflight-engine", daemon=True)
        self.thread.start()

    # -- caller threads -------------------------------------------------------------------------

    def check_runtime(self) -> None:
        """Refuse new requests for good once the runtime can serve no more (a tensor-parallel
        rank lost while no step ran): the engine stops as after a fault of its own."""
        fault = self.factory.fault
        if fault is not None and self.fault is None:
            self.fail(f"the runtime stopped: {fault}")
        if self.fault is not None:
            raise SubmitError(
                f"the engine stopped on an internal error: {self.fault}", shutting_down=True
            )

    def fail(self, fault: str) -> None:
        """Close admission; the actor fails every request without an outcome and stops."""
        with self._gate:
            if self.fault is None:
                self.fault = fault
            self._accepting = False
        self.wake.set()

    def submit(self, request: GenerationRequest, channel: StreamChannel) -> RequestHandle:
        with self._pending_lock:
            if self._pending >= self.config.max_pending_requests:
                self.metrics.add("refused")
                raise SubmitError("too many requests in flight; retry later")
            self._pending += 1
        record = RequestRecord(next(self._ids), request, channel)
        with self._registry_lock:
            self._registry[record.id] = record
        with self._gate:
            accepting = self._accepting
            posted = accepting and self.commands.try_push(record)
            if posted:
                self.metrics.add("submitted")
        if not posted:
            with self._registry_lock:
                self._registry.pop(record.id, None)
            with self._pending_lock:
                self._pending -= 1
            self.metrics.add("refused")
            if self.fault is not None:
                raise SubmitError(
                    f"the engine stopped on an internal error: {self.fault}", shutting_down=True
                )
            if not accepting:
                raise SubmitError(
                    "the engine is shutting down and no longer accepts requests",
                    shutting_down=True,
                )
            raise SubmitError("command queue is full; retry later")
        self.wake.set()
        return RequestHandle(record, self.wake.set)

    def cancel(self, request_id: int) -> None:
        with self._registry_lock:
            record = self._registry.get(request_id)
        if record is not None and not record.published:
            record.request_cancel()
            self.wake.set()

    def shutdown(self, mode: ShutdownMode) -> None:
        if threading.current_thread() is self.thread:
            raise RuntimeError("shutdown() called from the engine's own thread would deadlock")
        with self._shutdown_lock:
            if not self.shutdown_called:
                self.shutdown_called = True
                with self._gate:
                    self._accepting = False
                # The mode lives here, not in a queued command, so a full queue cannot turn a
                # cancelling shutdown into a drain.
                self.stop_mode = mode
                self.wake.set()
        self.thread.join()

    # -- the actor thread -----------------------------------------------------------------------

    def _run(self) -> None:
        # The heap the engine starts with (the runtime: its model, its imports) lives as long as
        # it runs: frozen out of the cyclic collector, whose full passes over it otherwise stall
        # a step for 150-250 ms (a 0.6B model on an H200). Thawed when the actor stops, so
        # whatever of it became garbage can still be collected.
        gc.freeze()
        try:
            while True:
                self._drain_commands()
                if self.stop_mode is ShutdownMode.CANCEL or self._runtime_lost():
                    break
                if self.queued:
                    self._run_batch()
                    continue
                if self.stop_mode is ShutdownMode.DRAIN:
                    # Catch a submit accepted just before the gate closed.
                    self._drain_commands()
                    if self.queued:
                        continue
                    break
                self.wake.wait(self.config.idle_wait)
                self.wake.clear()
        except BaseException as exc:
            # Whatever escaped, no accepted request may wait forever: admission closes and
            # every request still without an outcome fails (below).
            log.exception("the engine's actor stopped on an unexpected error")
            self.fault = f"{type(exc).__name__}: {exc}"
            with self._gate:
                self._accepting = False
            if not isinstance(exc, Exception):
                raise
        finally:
            self._abandon_everything()
            gc.unfreeze()

    def _runtime_lost(self) -> bool:
        """Whether the runtime can serve no more (its fault, seen between batches): then every
        request without an outcome fails and the actor stops."""
        fault = self.factory.fault
        if fault is not None and self.fault is None:
            log.error("the runtime stopped serving: %s", fault)
            self.fail(f"the runtime stopped: {fault}")
        return self.fault is not None

    def _drain_commands(self) -> None:
        arrived = self.commands.pop_batch(self.commands.capacity)
        if self.config.scheduling_policy == "priority":
            for record in arrived:
                insort(self.queued, record, key=_seating_order)
        else:
            self.queued.extend(arrived)
        self._retire_cancelled_queued()
        if self.stop_mode is ShutdownMode.CANCEL:
            for _, record in self.ledger.residents():
                record.channel.cancel()

    def _retire_cancelled_queued(self) -> None:
        if any(r.cancel_requested for r in self.queued):
            keep: deque[RequestRecord] = deque()
            for record in self.queued:
                if record.cancel_requested:
                    self._terminate(record, TerminalStatus.CANCELLED)
                else:
                    keep.append(record)
            self.queued = keep

    def _run_batch(self) -> None:
        """Found a batch with the queue head and tick until no resident remains."""
        head = self.queued[0]
        try:
            execution = self.factory.new_session()
        except Exception as exc:
            log.exception("the runtime could not start a batch")
            self.queued.popleft()
            self._terminate(head, TerminalStatus.FAILED, error=f"the runtime refused: {exc}")
            return
        self._founder = head.request
        answer = self._admit(execution, founder=True)
        if answer is AdmissionAnswer.NO_CAPACITY:
            self.queued.popleft()
            self._terminate(
                head, TerminalStatus.FAILED, error="the runtime has no capacity for this request"
            )
        try:
            failure = self._tick_until_drained(execution)
        except Exception as exc:
            # Outside the step itself: the engine's own state may be off, so the batch fails
            # and the actor stops (see _run).
            self._fail_batch(execution, f"the engine stopped on an internal error: {exc}")
            raise
        if failure is not None:
            # A failed step fails its batch; the engine serves on unless the runtime could not
            # be brought back to a state where a new batch can start.
            if not self._fail_batch(execution, failure):
                raise RuntimeError(f"the runtime did not recover from a failed step ({failure})")
            return
        try:
            execution.finish()
        except Exception as exc:
            raise RuntimeError(f"the runtime did not close a drained batch ({exc})") from exc

    def _tick_until_drained(self, execution: SteppedExecution) -> str | None:
        """Step until no resident remains; why a step failed (its batch to be failed), or
        None."""
        while len(self.ledger):
            self._drain_commands()
            self._admit_joiners(execution)
            # A published resident failed outside the step (its channel raised): evict it.
            cancelled = [
                ref
                for ref, record in self.ledger.residents()
                if record.cancel_requested or record.published
            ]
            try:
                result = execution.step(cancelled)
                self.metrics.add("steps")
                committed = self.ledger.commit(result)
            except Exception as exc:
                log.exception("a step failed; failing its batch")
                return f"the step failed: {exc}"
            self._publish(committed)
            for record in self.ledger.retire_missing(execution.residents()):
                self._terminate(record, TerminalStatus.FAILED, error="the runtime lost the request")
            self.resident_count = len(self.ledger)
        return None

    def _admit_joiners(self, execution: SteppedExecution) -> None:
        """Seat queued heads in order while they may join and the batch has room."""
        while self.queued and len(self.ledger) < self.config.max_batch_size:
            if self.stop_mode is not None:
                return  # under shutdown, queued requests found later batches instead
            stall = self._head_may_join(self.queued[0].request)
            if stall is not None:
                self.metrics.add(stall)
                return
            if self._admit(execution, founder=False) is AdmissionAnswer.NO_CAPACITY:
                self.metrics.add("stalls_no_capacity")
                return

    def _head_may_join(self, head: GenerationRequest) -> str | None:
        """None, or the stall counter naming why the head cannot join the running batch."""
        founder = self._founder
        assert founder is not None
        if not self.compatibility.compatible(founder, head):
            return "stalls_incompatible"
        return None

    def _admit(self, execution: SteppedExecution, founder: bool) -> AdmissionAnswer:
        record = self.queued[0]
        try:
            admission = execution.admit(record.request)
        except Exception as exc:
            log.exception("admission of request %d raised", record.id)
            self.queued.popleft()
            self._terminate(record, TerminalStatus.FAILED, error=str(exc))
            return AdmissionAnswer.REJECTED
        if admission.answer is AdmissionAnswer.ADMITTED:
            self.queued.popleft()
            for ref in admission.refs:
                self.ledger.add(ref, record)
            self.resident_count = len(self.ledger)
            record.admitted_at = time.monotonic()
            self.metrics.record_queue_latency(int((record.admitted_at - record.submitted_at) * 1e6))
            if not founder:
                self.metrics.add("admitted_mid_flight")
        elif admission.answer is AdmissionAnswer.REJECTED:
            self.queued.popleft()
            self._terminate(record, TerminalStatus.FAILED, error=admission.reason)
        return admission.answer

    def _publish(self, committed: Commit) -> None:
        """Each request's chunks of the step; a request that ended gets them with its outcome
        (published before its stream ends)."""
        ended = {outcome.record.id for outcome in committed.outcomes}
        for request_id, (record, chunks) in committed.chunks.items():
            if request_id in ended or record.published:
                continue
            try:
                for chunk in chunks:
                    record.channel.push(chunk)
            except Exception as exc:
                # The consumer's channel is broken: only its own request fails (evicted at the
                # next step), the batch goes on.
                log.exception("the stream channel of request %d raised", record.id)
                self._terminate(record, TerminalStatus.FAILED, error=f"its stream raised: {exc}")
        for outcome in committed.outcomes:
            chunks = committed.chunks.get(outcome.record.id, (outcome.record, []))[1]
            self._terminate(outcome.record, outcome.status, outcome.output, outcome.error, chunks)

    def _fail_batch(self, execution: SteppedExecution, message: str) -> bool:
        """Fail every resident of the batch; whether the runtime closed the batch cleanly."""
        closed = True
        try:
            execution.abort()
        except Exception:
            log.exception("aborting a failed batch raised")
            closed = False
        for record in self.ledger.take_all():
            self._terminate(record, TerminalStatus.FAILED, error=message)
        self.resident_count = 0
        try:
            execution.finish()
        except Exception:
            log.exception("finishing a failed batch raised")
            closed = False
        return closed

    def _terminate(
        self,
        record: RequestRecord,
        status: TerminalStatus,
        output: RequestOutput | None = None,
        error: str = "",
        chunks: Sequence[StreamChunk] = (),
    ) -> None:
        """The single exit of every accepted request: one outcome, published before its last
        `chunks` (a completed request's end with each sequence's terminal chunk) and the end of
        its stream; a request that did not complete always gets its stream cancelled."""
        if record.published:
            return
        with self._pending_lock:
            self._pending -= 1
        self.metrics.add(status.value)
        with self._registry_lock:
            self._registry.pop(record.id, None)
        # Published first: a consumer that sees the terminal chunk can read the outcome at once.
        record.publish(status, output, error)
        channel = record.channel
        try:
            for chunk in chunks:
                channel.push(chunk)
            if status is TerminalStatus.COMPLETED:
                channel.finish()
            else:
                channel.cancel()
        except Exception:
            # The outcome stands; a consumer's broken channel is its own.
            log.exception("the stream channel of request %d raised at its end", record.id)

    def _abandon_everything(self) -> None:
        """At the actor's end: under a shutdown, what never ran is cancelled; after a fault,
        everything without an outcome fails (nobody cancelled it)."""
        abandoned = list(self.queued) + self.commands.pop_batch(self.commands.capacity)
        abandoned += self.ledger.take_all()
        self.queued.clear()
        self.resident_count = 0
        for record in abandoned:
            if self.fault is None or record.cancel_requested:
                self._terminate(record, TerminalStatus.CANCELLED)
            else:
                error = f"the engine stopped on an internal error: {self.fault}"
                self._terminate(record, TerminalStatus.FAILED, error=error)
        if abandoned:
            log.warning("the engine's end left %d request(s) without a run", len(abandoned))


def _seating_order(record: RequestRecord) -> tuple[int, int]:
    """The priority policy's queue order: priority (lower first), then arrival (ids rise)."""
    return record.request.priority, record.id
