"""`EngineClient`: the server's async bridge to the `LLM`, with the HTTP admission gate.

The gate counts sequences (a request of `n` is `n`; a completions prompt list, each of its
prompts times `n`). Under in-flight batching it holds at most `max_batch_size +
max_queued_requests` (the LLM's queue, deep by default) and answers 429 at once beyond that; on
the blocking path it is one generation slot plus up to `max_queued_requests` callers waiting at
most `queue_timeout` seconds. A request that could never fit, more sequences than the gate ever
holds, is a 400 naming the limit. A lease is held from admission until the generation is over.

Streams are read on the event loop itself: the engine's channel wakes the loop when chunks
arrive, and chunks that piled up while a client was slow come as one. A client that goes away
cancels its request inside the engine: the request leaves its seat at the next step instead of
decoding to `max_tokens`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import anyio

from inflight.api import LLM
from inflight.engine import RequestCancelled, RequestFailed, RequestHandle, SubmitError
from inflight.protocol.outputs import RequestOutput, StreamChunk
from inflight.protocol.request import (
    ContextOverflowError,
    GenerationRequest,
    PromptTooLongError,
    RequestFieldError,
    SamplingParams,
)
from inflight.server.documents import DocumentReader
from inflight.server.errors import ServerError, context_exceeded, overloaded, prompt_too_long
from inflight.server.files import FileStore
from inflight.server.metrics import ServerMetrics


class AdmissionGate:
    def __init__(
        self, in_flight_batching: bool, max_batch_size: int, max_queued: int, timeout: float
    ):
        self.ifb = in_flight_batching
        self.batch = max(1, max_batch_size) if in_flight_batching else 1
        self.max_waiting = max_queued
        # Sequences admitted at once (generating or waiting), whatever else is running.
        self.limit = self.batch + max_queued
        self.timeout = timeout
        self.active = 0
        self.waiting = 0
        self.closing = False
        self._slot = asyncio.Semaphore(1)
        self._idle = asyncio.Event()
        self._idle.set()

    def check(self, sequences: int, field: str | None = None) -> None:
        """Whether `sequences` more may be admitted now: a 400 naming the limit for more than
        the gate ever admits (retrying could never succeed), a 429 under in-flight batching
        when they fit but not beside what runs now."""
        if sequences > self.limit:
            raise ServerError(
                400,
                f"the request asks for {sequences} sequences, more than this server ever admits "
                f"at once: {self.limit} (a batch of {self.batch} + max_queued_requests "
                f"{self.max_waiting}); send fewer prompts or a smaller n",
                field,
            )
        if self.ifb and self.active + sequences > self.limit:
            raise overloaded()

    async def acquire(self, sequences: int = 1) -> None:
        if self.closing:
            raise ServerError(503, "server is shutting down")
        self.check(sequences)
        if not self.ifb:
            if self.active + self.waiting >= 1 + self.max_waiting:
                raise overloaded()
            self.waiting += 1
            try:
                await asyncio.wait_for(self._slot.acquire(), self.timeout)
            except TimeoutError:
                raise overloaded("timed out waiting for the generation slot") from None
            finally:
                self.waiting -= 1
        self.active += sequences
        self._idle.clear()

    def release(self, sequences: int = 1) -> None:
        self.active -= sequences
        if not self.ifb:
            self._slot.release()
        if self.active == 0:
            self._idle.set()

    async def close(self) -> None:
        """Refuse new leases (503), then wait until every lease is back."""
        self.closing = True
        await self.wait_idle()

    async def wait_idle(self) -> None:
        await self._idle.wait()


class EngineClient:
    def __init__(
        self,
        llm: LLM,
        max_queued_requests: int,
        queue_timeout: float,
        max_input_len: int | None,
        metrics: ServerMetrics,
        allow_fetch: bool = False,
    ) -> None:
        """`allow_fetch`: documents by http(s) URL are fetched (`--allow-media-fetch`)."""
        self.llm = llm
        self.max_input_len = max_input_len
        self.metrics = metrics
        self.gate = AdmissionGate(
            llm.in_flight_batching, llm.max_batch_size, max_queued_requests, queue_timeout
        )
        self.runs: set[Run] = set()  # started and not yet finished
        # The Files API's store, which prompts' documents may name by id.
        self.files = FileStore()
        self.documents = DocumentReader(self.files, allow_fetch)

    # -- preparing ------------------------------------------------------------------------------

    def prepare(
        self,
        prompt: object,
        params: SamplingParams,
        *,
        params_of: dict[str, str] | None = None,
        **options: Any,
    ) -> GenerationRequest:
        """Tokenize and validate; bad input is a 400 naming the problem (a long prompt as each
        API says it: `errors.prompt_too_long`).
        `options` are request options (`GenerationRequest` fields) and chat-template arguments
        (`tools`, `chat_template`, `chat_template_kwargs`), as `LLM.prepare` takes them;
        `params_of` maps an option to the HTTP field it came from, which a refusal names.
        A conversation's documents are read to text here (`documents.DocumentReader`)."""
        fields = params_of or {}
        try:
            request = self.llm.prepare(self._read_documents(prompt), params, **options)
        except PromptTooLongError as exc:
            raise prompt_too_long(exc, fields.get("prompt", "messages")) from exc
        except ContextOverflowError as exc:
            raise context_exceeded(exc, fields.get(exc.field, exc.field)) from exc
        except RequestFieldError as exc:
            if exc.field == "lora_name":  # an adapter unloaded since `model` was checked
                raise ServerError(404, str(exc), "model", code="model_not_found") from exc
            raise ServerError(400, str(exc), fields.get(exc.field, exc.field)) from exc
        except ValueError as exc:
            raise ServerError(400, str(exc)) from exc
        tokens = len(request.prompt_token_ids)
        if self.max_input_len is not None and tokens > self.max_input_len:
            raise prompt_too_long(
                PromptTooLongError(
                    f"the prompt is {tokens} tokens, more than this server's --max-input-len of "
                    f"{self.max_input_len}",
                    tokens,
                    self.max_input_len,
                ),
                fields.get("prompt", "messages"),
            )
        return request

    async def prepare_chat(
        self, messages: list[dict[str, Any]], params: SamplingParams, **options: Any
    ) -> GenerationRequest:
        """`prepare` for a conversation, on a worker thread: its images are read (fetched,
        decoded, preprocessed) there, off the event loop."""
        return await asyncio.to_thread(self.prepare, messages, params, **options)

    async def prompt_tokens(self, prompt: object, **template: Any) -> list[int]:
        """The prompt's token ids (a 400 as for a request), rendered on a worker thread
        as `prepare_chat` renders a conversation; `template`: chat-template arguments."""
        return await asyncio.to_thread(self._prompt_tokens, prompt, template)

    def _prompt_tokens(self, prompt: object, template: dict[str, Any]) -> list[int]:
        try:
            prompt = self._read_documents(prompt)
            request = self.llm.prepare(prompt, SamplingParams(max_tokens=1), **template)
            return list(request.prompt_token_ids)
        except PromptTooLongError as exc:
            raise prompt_too_long(exc) from exc
        except RequestFieldError as exc:
            raise ServerError(400, str(exc), exc.field) from exc
        except ValueError as exc:
            raise ServerError(400, str(exc)) from exc

    def _read_documents(self, prompt: object) -> object:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return self.documents.read(prompt)
        return prompt

    # -- running --------------------------------------------------------------------------------

    def run(self, request: GenerationRequest) -> Run:
        return Run(self, request)

    async def generate(
        self,
        request: GenerationRequest,
        disconnected: Callable[[], Awaitable[bool]],
        on_chunk: Callable[[StreamChunk], None] | None = None,
    ) -> RequestOutput:
        """Run to the end (`on_chunk` sees each chunk); a client that disconnects meanwhile
        cancels the request."""
        run = self.run(request)
        await run.start()

        async def collect() -> None:
            async for chunk in run:
                if on_chunk is not None:
                    on_chunk(chunk)

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

    def cancel_all(self) -> int:
        """Cancel every running request (each ends as cancelled, its client told so); how
        many there were."""
        runs = list(self.runs)
        for run in runs:
            run.cancel()
        return len(runs)

    async def close(self) -> None:
        await self.gate.close()
        await asyncio.get_running_loop().run_in_executor(None, self.llm.close)


class Run:
    """One request on its way through the server: `start()` takes a lease and submits (a full
    gate or engine is a 429 here, before any response has begun); iterating yields its chunks;
    `output` is set once it ended. Whatever way iteration stops, the request is cancelled unless
    it completed, and the lease is back."""

    def __init__(self, client: EngineClient, request: GenerationRequest) -> None:
        self._client = client
        self._request = request
        self._handle: RequestHandle | None = None
        self._started_at = 0.0
        self._leased = False
        self._gate_wait = 0.0
        self.output: RequestOutput | None = None

    @property
    def n(self) -> int:
        """How many sequences the request generates."""
        return self._request.params.n

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        return self._request.prompt_token_ids

    async def start(self) -> None:
        client = self._client
        arrived = time.monotonic()
        await client.gate.acquire(self.n)
        self._leased = True
        self._started_at = time.monotonic()
        self._gate_wait = self._started_at - arrived
        try:
            self._handle = client.llm.start(self._request)
        except SubmitError as exc:
            self._finish("rejected")
            if exc.shutting_down:  # a shutdown, or an engine stopped on an error
                raise ServerError(503, str(exc)) from exc
            raise overloaded(str(exc)) from exc
        client.runs.add(self)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()

    async def __aiter__(self) -> AsyncIterator[StreamChunk]:
        handle = self._handle
        assert handle is not None, "start() first"
        metrics = self._client.metrics
        outcome, last = "failed", None
        try:
            async for chunk in handle:
                if chunk.token_ids:
                    now = time.monotonic()
                    if last is None:
                        metrics.time_to_first_token.observe(now - self._started_at)
                    else:
                        metrics.inter_token_latency.observe((now - last) / len(chunk.token_ids))
                    last = now
                yield chunk
            self.output = handle.get()
            outcome = "completed"
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        except RequestCancelled as exc:
            # Not by its client (a client going away ends the iteration above): the server
            # cancelled it.
            outcome = "cancelled"
            why = ": the server is shutting down" if self._client.gate.closing else ""
            raise ServerError(503, f"the request was cancelled before it finished{why}") from exc
        except RequestFailed as exc:
            raise ServerError(500, f"generation failed: {exc}") from exc
        finally:
            self._finish(outcome)

    def _finish(self, outcome: str) -> None:
        if not self._leased:
            return
        self._leased = False
        self._client.runs.discard(self)
        if self._handle is not None:
            self._handle.close()  # cancels the request unless its stream ended
        self._client.gate.release(self.n)
        metrics = self._client.metrics
        metrics.requests.labels(outcome=outcome).inc()
        engine_wait = self._handle.queue_time if self._handle is not None else None
        if engine_wait is not None:
            metrics.queue_time.observe(self._gate_wait + engine_wait)
        metrics.request_latency.observe(time.monotonic() - self._started_at)

    async def aclose(self) -> None:
        """Give everything back without iterating (the response never started)."""
        self._finish("cancelled")
