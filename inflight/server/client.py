"""`EngineClient`: the server's async bridge to the `LLM`, with the HTTP admission gate.

Under in-flight batching the gate hands out at most `max_batch_size + max_queued_requests`
leases and answers 429 at once beyond that; on the blocking path it is one generation slot plus
up to `max_queued_requests` callers waiting at most `queue_timeout` seconds. A lease is held from
admission until the generation is over and its worker thread has returned.

Streams advance in a dedicated thread pool (each active stream parks a thread on its channel). A
client that goes away cancels its request inside the engine: the request leaves its seat at the
next step instead of decoding to `max_tokens`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio

from inflight.api import LLM, GenerationStream, StreamDelta
from inflight.engine import RequestCancelled, RequestFailed, SubmitError
from inflight.runtime.request import GenerationRequest, PromptTooLongError, SamplingParams
from inflight.runtime.stepped import CompletionOutput
from inflight.server.errors import ServerError, overloaded
from inflight.server.metrics import ServerMetrics


class AdmissionGate:
    def __init__(
        self, in_flight_batching: bool, max_batch_size: int, max_queued: int, timeout: float
    ):
        self.ifb = in_flight_batching
        self.limit = max(1, max_batch_size) + max_queued if in_flight_batching else 1
        self.max_waiting = max_queued
        self.timeout = timeout
        self.active = 0
        self.waiting = 0
        self.closing = False
        self._slot = asyncio.Semaphore(1)
        self._idle = asyncio.Event()
        self._idle.set()

    async def acquire(self) -> None:
        if self.closing:
            raise ServerError(503, "server is shutting down")
        if self.ifb:
            if self.active >= self.limit:
                raise overloaded()
        else:
            if self.active + self.waiting >= 1 + self.max_waiting:
                raise overloaded()
            self.waiting += 1
            try:
                await asyncio.wait_for(self._slot.acquire(), self.timeout)
            except TimeoutError:
                raise overloaded("timed out waiting for the generation slot") from None
            finally:
                self.waiting -= 1
        self.active += 1
        self._idle.clear()

    def release(self) -> None:
        self.active -= 1
        if not self.ifb:
            self._slot.release()
        if self.active == 0:
            self._idle.set()

    async def close(self) -> None:
        """Refuse new leases (503), then wait until every lease is back."""
        self.closing = True
        await self._idle.wait()


class EngineClient:
    def __init__(
        self,
        llm: LLM,
        max_queued_requests: int,
        queue_timeout: float,
        max_input_len: int | None,
        metrics: ServerMetrics,
    ) -> None:
        self.llm = llm
        self.max_input_len = max_input_len
        self.metrics = metrics
        self.gate = AdmissionGate(
            llm.in_flight_batching, llm.max_batch_size, max_queued_requests, queue_timeout
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.gate.limit + max_queued_requests + 4,
            thread_name_prefix="inflight-stream",
        )

    # -- preparing ------------------------------------------------------------------------------

    def prepare(self, prompt: object, params: SamplingParams) -> GenerationRequest:
        """Tokenize and validate; bad input is a 400 naming the problem, a long prompt a 413."""
        try:
            request = self.llm.prepare(prompt, params)
        except PromptTooLongError as exc:
            raise ServerError(413, str(exc), "messages") from exc
        except ValueError as exc:
            raise ServerError(400, str(exc)) from exc
        if self.max_input_len is not None and len(request.prompt_token_ids) > self.max_input_len:
            raise ServerError(
                413,
                f"the prompt is {len(request.prompt_token_ids)} tokens, more than this server's "
                f"--max-input-len of {self.max_input_len}",
            )
        return request

    def count_tokens(self, prompt: object) -> int:
        try:
            return len(self.llm.prepare(prompt, SamplingParams(max_tokens=1)).prompt_token_ids)
        except PromptTooLongError as exc:
            raise ServerError(413, str(exc)) from exc
        except ValueError as exc:
            raise ServerError(400, str(exc)) from exc

    # -- running --------------------------------------------------------------------------------

    def run(self, request: GenerationRequest) -> Run:
        return Run(self, request)

    async def generate(
        self, request: GenerationRequest, disconnected: Callable[[], Awaitable[bool]]
    ) -> CompletionOutput:
        """Run to the end; a client that disconnects meanwhile cancels the request."""
        run = self.run(request)
        await run.start()

        async def collect() -> None:
            async for _ in run:
                pass

        task = asyncio.ensure_future(collect())
        while not task.done():
            await asyncio.wait({task}, timeout=0.1)
            if not task.done() and await disconnected():
                task.cancel()
                with anyio.CancelScope(shield=True):
                    await asyncio.wait({task})
                raise ServerError(499, "client disconnected")
        task.result()
        assert run.output is not None
        return run.output

    async def close(self) -> None:
        await self.gate.close()
        await asyncio.get_running_loop().run_in_executor(None, self.llm.close)
        self._pool.shutdown(wait=False)


class Run:
    """One request on its way through the server: `start()` takes a lease and submits (a full
    gate or engine is a 429 here, before any response has begun); iterating yields its deltas;
    `output` is set once it ended. Whatever way iteration stops, the request is cancelled unless
    it completed, its worker thread has returned, and the lease is back."""

    def __init__(self, client: EngineClient, request: GenerationRequest) -> None:
        self._client = client
        self._request = request
        self._generation: GenerationStream | None = None
        self._pending: concurrent.futures.Future | None = None
        self._started_at = 0.0
        self._leased = False
        self._gate_wait = 0.0
        self.output: CompletionOutput | None = None

    async def start(self) -> None:
        client = self._client
        arrived = time.monotonic()
        await client.gate.acquire()
        self._leased = True
        self._started_at = time.monotonic()
        self._gate_wait = self._started_at - arrived
        try:
            self._generation = client.llm.start(self._request)
        except SubmitError as exc:
            await self._finish("rejected")
            raise overloaded(str(exc)) from exc

    async def __aiter__(self) -> AsyncIterator[StreamDelta]:
        assert self._generation is not None, "start() first"
        client, loop = self._client, asyncio.get_running_loop()
        outcome, last = "failed", None
        try:
            while True:
                self._pending = client._pool.submit(next, self._generation, None)
                delta = await asyncio.wrap_future(self._pending, loop=loop)
                self._pending = None
                if delta is None:
                    break
                if delta.token_ids:
                    now = time.monotonic()
                    if last is None:
                        client.metrics.time_to_first_token.observe(now - self._started_at)
                    else:
                        client.metrics.inter_token_latency.observe(
                            (now - last) / len(delta.token_ids)
                        )
                    last = now
                yield delta
            self.output = self._generation.output
            outcome = "completed"
        except (RequestCancelled, asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        except RequestFailed as exc:
            raise ServerError(500, f"generation failed: {exc}") from exc
        finally:
            await self._finish(outcome)

    async def _finish(self, outcome: str) -> None:
        if not self._leased:
            return
        self._leased = False
        loop = asyncio.get_running_loop()
        with anyio.CancelScope(shield=True):
            generation = self._generation
            if generation is not None:
                generation.cancel()  # nothing happens if it ended cleanly
                if self._pending is not None:
                    # Let the worker return; what it returns (or raises) no longer matters.
                    await asyncio.wait([asyncio.wrap_future(self._pending, loop=loop)])
                await loop.run_in_executor(self._client._pool, generation.close)
            self._client.gate.release()
        metrics = self._client.metrics
        metrics.requests.labels(outcome=outcome).inc()
        engine_wait = self._generation.queue_time() if self._generation is not None else None
        if engine_wait is not None:
            metrics.queue_time.observe(self._gate_wait + engine_wait)
        metrics.request_latency.observe(time.monotonic() - self._started_at)

    async def aclose(self) -> None:
        """Give everything back without iterating (the response never started)."""
        await self._finish("cancelled")
