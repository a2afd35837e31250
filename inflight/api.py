"""The Python API: `LLM` and `SamplingParams`, in the shape vLLM users know."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inflight.engine import (
    EngineConfig,
    RequestEngine,
    RequestHandle,
    ShutdownMode,
    SubmitError,
)
from inflight.runtime.request import GenerationRequest, SamplingParams
from inflight.runtime.runtime import Runtime, RuntimeConfig
from inflight.runtime.stepped import CompletionOutput, ExecutionCapabilities, LogprobEntry

Message = dict[str, Any]
# A prompt is raw text, a chat conversation (a list of messages), or pre-tokenized ids.
Prompt = str | list[Message] | dict[str, Any]


@dataclass(frozen=True)
class StreamDelta:
    """One piece of a streamed generation; the last one has `finished` set."""

    text: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    logprobs: tuple[LogprobEntry, ...] | None
    prompt_tokens: int


def ifb_unsupported_reason(capabilities: ExecutionCapabilities) -> str | None:
    """Why this deployment cannot run under in-flight batching, or None. Decided once, at load."""
    if not capabilities.stepped:
        return "the runtime cannot run stepped execution (it spans several ranks)"
    return None


class LLM:
    """A loaded model you can generate from.

    `model` is a Hugging Face checkpoint directory or a `.gguf` file; None loads the embedded
    default, SmolLM2-135M-Instruct. By default requests run one at a time, each to completion (the
    blocking path). With `enable_in_flight_batching=True` a `RequestEngine` serves them: up to
    `max_batch_size` generate together, a queued request joins the running batch as soon as it
    may, and callers on several threads overlap. `context_cache=True` reuses the KV of prompt
    prefixes computed before (the prompt's uncached tail is all that is prefilled).
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        enable_in_flight_batching: bool = False,
        max_batch_size: int = 8,
        max_model_len: int | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_num_tokens: int = 2048,
        max_pending_requests: int = 256,
        context_cache: bool = False,
        dtype: str | None = None,
        quantization: str | None = None,
        device: str | None = None,
        seed: int | None = None,
        show_progress: bool = False,
    ) -> None:
        config = RuntimeConfig(
            max_batch_size=max_batch_size,
            max_model_len=max_model_len,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_num_tokens=max_num_tokens,
            context_cache=context_cache,
            dtype=dtype,
            quantization=quantization,
            device=device,
            seed=seed,
        )
        engine_config = EngineConfig(
            max_batch_size=max_batch_size, max_pending_requests=max_pending_requests
        )
        self._runtime: Runtime | None = Runtime(model, config, show_progress)
        self._lock = threading.Lock()  # the blocking path serves one request at a time
        self._engine: RequestEngine | None = None
        if enable_in_flight_batching:
            reason = ifb_unsupported_reason(self._runtime.capabilities)
            try:
                if reason is not None:
                    raise RuntimeError(reason)
                self._engine = RequestEngine(self._runtime, engine_config)
            except RuntimeError as exc:
                raise ValueError(
                    f"in-flight batching is not supported for this deployment: {exc}; "
                    "start without --enable-in-flight-batching to use the blocking path"
                ) from exc
        # Counters stay readable after close().
        self._blocks = self._runtime.blocks
        self._context_cache = self._runtime.context_cache
        self.tokenizer = self._runtime.tokenizer
        self.model_name = self._runtime.model_name
        self.max_model_len = self._runtime.max_model_len
        self.max_batch_size = max_batch_size

    @property
    def in_flight_batching(self) -> bool:
        return self._engine is not None

    # -- generation -----------------------------------------------------------------------------

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's recommended settings (generation_config.json)."""
        return SamplingParams(**self._live().checkpoint.sampling_defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Generate for one prompt or a list of them; returns one output per prompt, in order.

        Under in-flight batching every prompt is submitted at once (waiting, not failing, when
        the engine pushes back) and they generate together.
        """
        requests = self._requests(prompts, params)
        if self._engine is None:
            return [self._run(request) for request in requests]
        handles: list[RequestHandle] = []
        try:
            for request in requests:
                handles.append(self._submit(request))
            return [handle.get() for handle in handles]
        finally:
            for handle in handles:
                if not handle.ready():
                    handle.cancel()

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Generate a reply to a conversation (or to each of a list of conversations)."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of chat messages")
        conversations = messages if isinstance(messages[0], list) else [messages]
        return self.generate(conversations, params)

    def generate_stream(
        self, prompt: Prompt, params: SamplingParams | None = None
    ) -> GenerationStream:
        """Yield the output as it is generated, then one last delta with `finished` set.

        Closing the iterator before the end cancels the request."""
        (request,) = self._requests(prompt, params)
        return self.start(request, wait_for_room=True)

    def prepare(self, prompt: Prompt, params: SamplingParams | None = None) -> GenerationRequest:
        """Tokenize and validate one prompt (ValueError naming the problem); queues nothing."""
        (request,) = self._requests(prompt, params)
        return request

    def start(self, request: GenerationRequest, *, wait_for_room: bool = False) -> GenerationStream:
        """Start a prepared request. Under in-flight batching it is submitted at once; a full
        engine raises SubmitError (retry later), unless `wait_for_room`, which waits for room
        instead. On the blocking path the request runs as the stream is iterated."""
        if self._engine is None:
            cancelled = threading.Event()
            return GenerationStream(
                self._run_blocking(request, cancelled), cancelled.set, lambda: 0.0
            )
        handle = self._submit(request) if wait_for_room else self._engine.submit(request)
        return GenerationStream(
            _follow(handle, len(request.prompt_token_ids)),
            handle.cancel,
            lambda: handle.queue_time,
        )

    def kv_cache_usage(self) -> tuple[int, int]:
        """(KV blocks in use, KV blocks in all)."""
        blocks = self._blocks
        return blocks.num_blocks - blocks.num_free, blocks.num_blocks

    def get_scheduling_metrics(self) -> dict[str, float] | None:
        """The engine's counters and gauges, and the context cache's as `context_cache_*`;
        None on the blocking path."""
        if self._engine is None:
            return None
        values: dict[str, float] = dict(self._engine.metrics.snapshot())
        values.update(queued=self._engine.queued, resident=self._engine.resident)
        for key, value in (self.get_context_cache_metrics() or {}).items():
            values[f"context_cache_{key}"] = value
        return values

    def get_context_cache_metrics(self) -> dict[str, float] | None:
        """Lookups, looked-up and hit prompt tokens, hit ratio, evictions, cached blocks; None
        when the context cache is off."""
        cache = self._context_cache
        return None if cache is None else cache.snapshot()

    def close(self) -> None:
        """Finish what was accepted (drain), then release the model. Safe to call twice."""
        if self._engine is not None:
            self._engine.shutdown(ShutdownMode.DRAIN)
        with self._lock:
            self._runtime = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------

    def _live(self) -> Runtime:
        if self._runtime is None:
            raise RuntimeError("this LLM is closed")
        return self._runtime

    def _run(self, request: GenerationRequest) -> CompletionOutput:
        with self._lock:
            return self._live().handle_request(request).result()

    def _submit(self, request: GenerationRequest) -> RequestHandle:
        """Submit, waiting while the engine pushes back; only shutdown is an error here."""
        assert self._engine is not None
        delay = 0.001
        while True:
            try:
                return self._engine.submit(request)
            except SubmitError as exc:
                if exc.shutting_down:
                    raise RuntimeError("this LLM is closed") from exc
                time.sleep(delay)
                delay = min(delay * 2, 0.05)

    def _run_blocking(
        self, request: GenerationRequest, cancelled: threading.Event
    ) -> Generator[StreamDelta, None, CompletionOutput | None]:
        prompt_tokens = len(request.prompt_token_ids)
        with self._lock:
            run = self._live().handle_request(request)
            try:
                for delta in run:
                    if cancelled.is_set():
                        return None
                    yield StreamDelta(
                        delta.text,
                        tuple(delta.token_ids),
                        False,
                        None,
                        None if delta.logprobs is None else tuple(delta.logprobs),
                        prompt_tokens,
                    )
            finally:
                run.close()  # frees the request when it stopped early; nothing otherwise
            yield StreamDelta("", (), True, run.output.finish_reason, None, prompt_tokens)
            return run.output

    def _requests(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[GenerationRequest]:
        items = _as_prompt_list(prompts)
        if params is None:
            params = self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            param_list = [params] * len(items)
        else:
            param_list = list(params)
            if len(param_list) != len(items):
                raise ValueError(
                    f"got {len(param_list)} SamplingParams for {len(items)} prompts; "
                    "pass one, or one per prompt"
                )
        requests = [
            GenerationRequest(self._tokenize(p), sp)
            for p, sp in zip(items, param_list, strict=True)
        ]
        runtime = self._live()
        for request in requests:
            runtime.check_request(request)  # bad input fails here, before anything is queued
        return requests

    def _tokenize(self, prompt: Prompt) -> list[int]:
        tokenizer = self.tokenizer
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict):
            ids = prompt.get("prompt_token_ids")
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise ValueError("a token prompt must be {'prompt_token_ids': [int, ...]}")
            return ids
        _check_messages(prompt)
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if isinstance(prompts, list | tuple):
        if not prompts:
            raise ValueError("prompts is empty")
        if all(isinstance(m, dict) and "role" in m for m in prompts):
            return [list(prompts)]  # one conversation
        return list(prompts)
    raise ValueError(
        f"prompts must be a string, a list of strings or a list of chat conversations, "
        f"got {type(prompts).__name__}"
    )


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("a chat conversation must be a non-empty list of messages")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"each chat message must be a dict with a 'role', got {m!r}")


def _follow(
    handle: RequestHandle, prompt_tokens: int
) -> Generator[StreamDelta, None, CompletionOutput]:
    """The engine's chunks for one request, as deltas; cancels it if abandoned before the end."""
    ended_cleanly = False
    try:
        for chunk in handle.stream():
            ended_cleanly = chunk.finished
            yield StreamDelta(
                chunk.text,
                chunk.token_ids,
                chunk.finished,
                None if chunk.reason is None else chunk.reason.value,
                chunk.logprobs,
                prompt_tokens,
            )
        # Raises what ended the stream if it did not complete (or an error behind a clean end).
        return handle.get()
    finally:
        # A stream that ended cleanly is never cancelled: that could record it as cancelled.
        if not ended_cleanly:
            handle.cancel()


class GenerationStream(Iterator[StreamDelta]):
    """A started request, delta by delta; the last delta has `finished` set, after which `output`
    holds the whole CompletionOutput.

    `cancel()` may be called from any thread, also while another thread is waiting for the next
    delta: the stream then ends early. `close()` (from the iterating thread) cancels a stream
    that has not finished and releases it.
    """

    def __init__(
        self,
        deltas: Generator[StreamDelta, None, CompletionOutput | None],
        cancel: Callable[[], None],
        queue_time: Callable[[], float | None],
    ) -> None:
        self._deltas = deltas
        self._cancel = cancel
        self.queue_time = queue_time  # seconds the engine queued it (None: not seated yet)
        self.finished = False
        self.output: CompletionOutput | None = None

    def __next__(self) -> StreamDelta:
        try:
            delta = next(self._deltas)
        except StopIteration as end:
            self.output = end.value
            raise StopIteration from None
        self.finished = delta.finished
        return delta

    def cancel(self) -> None:
        if not self.finished:
            self._cancel()

    def close(self) -> None:
        self.cancel()
        self._deltas.close()
