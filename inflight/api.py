"""The Python API: `LLM` and `SamplingParams`, in the shape vLLM users know."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from inflight.engine import (
    EngineConfig,
    RequestEngine,
    RequestHandle,
    ShutdownMode,
    SubmitError,
)
from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.options import OPTION_FIELDS
from inflight.protocol.outputs import RequestOutput
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.runtime.deployment import ifb_unsupported_reason
from inflight.runtime.inputs.chat_media import MediaLimits, as_text, take_media
from inflight.runtime.runtime import Runtime

Message = dict[str, Any]
# A prompt is raw text, a chat conversation (a list of messages), or pre-tokenized ids.
Prompt = str | list[Message] | dict[str, Any]


class LLM:
    """A loaded model you can generate from.

    `model` is a Hugging Face checkpoint directory or a `.gguf` file; None loads the embedded
    default, SmolLM2-135M-Instruct. `options` are the deployment's knobs, by the names of
    `DeploymentOptions` (the command line's too: `max_model_len` is `--max-model-len`), which
    says what each does and its default; a deployment the plan cannot serve is a ValueError
    naming what would (`runtime/deployment.py`), before any weight loads.

    By default requests run one at a time, each to completion (the blocking path). With
    `enable_in_flight_batching=True` up to `max_batch_size` generate together, a queued request
    joins the running batch as soon as it may, and callers on several threads overlap. Either
    way a `RequestEngine` takes the requests: the same calls, streams, cancellation and shutdown
    serve both paths.

    `enable_lora`: requests may name a LoRA adapter (`lora_name`), several in one batch, up to
    `max_loras` of them at once in the model (others wait; idle ones are swapped out), of rank
    up to `max_lora_rank`; `lora_modules` ({name: PEFT directory}) registers adapters at load,
    `load_lora_adapter` later. `speculative_config` (vLLM's shape, e.g. {"method": "ngram",
    "num_speculative_tokens": 4}) turns on speculative decoding: drafts verified in the batch's
    steps, with the output plain decoding would give (a request may opt out:
    `SamplingParams(speculative=False)`). `tensor_parallel_size` > 1 splits a Llama-family
    model over that many ranks, one process each (one GPU each on CUDA) that the LLM spawns and
    `close()` stops: a script doing so needs the `if __name__ == "__main__":` guard of
    Python's spawned processes.
    """

    def __init__(
        self, model: str | Path | None = None, *, show_progress: bool = False, **options: Any
    ) -> None:
        known = {f.name for f in fields(DeploymentOptions)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown LLM options {unknown}; known: {sorted(known)}")
        deployment = DeploymentOptions(**options)
        limits = deployment.limit_mm_per_prompt
        self.media_limits = MediaLimits(
            max_images=limits.get("image", MediaLimits.max_images),
            max_audios=limits.get("audio", MediaLimits.max_audios),
            allow_fetch=deployment.allow_media_fetch,
        )
        ifb = deployment.enable_in_flight_batching
        # Validated before the model loads, which takes a while.
        engine_config = EngineConfig(
            max_batch_size=deployment.max_batch_size if ifb else 1,
            max_pending_requests=deployment.max_pending_requests,
        )
        runtime = Runtime(model, deployment, show_progress)
        for name, path in deployment.lora_modules.items():
            runtime.register_lora(name, path)
        reason = ifb_unsupported_reason(runtime.plan)
        if ifb and reason is not None:
            runtime.close()
            raise ValueError(
                f"in-flight batching is not supported for this deployment: {reason}; "
                "start without --enable-in-flight-batching to use the blocking path"
            )
        self._engine = RequestEngine(runtime, engine_config)
        self._runtime: Runtime | None = runtime
        self.in_flight_batching = ifb
        # Kept for the counters, which stay readable after close().
        self._blocks, self._slots = runtime.blocks, runtime.slots
        self._context_cache = runtime.context_cache
        self._speculator = runtime.speculator
        self._encoder_cache = runtime.encoder_cache
        # What a prompt may hold: text, and the media the model takes.
        self.input_modalities = ["text", *runtime.media]
        self._sampling_defaults = runtime.checkpoint.sampling_defaults
        self.tokenizer = runtime.tokenizer
        self.model_name = runtime.model_name
        self.max_model_len = runtime.max_model_len
        self.max_batch_size = engine_config.max_batch_size

    # -- generation -----------------------------------------------------------------------------

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's recommended settings (generation_config.json)."""
        return SamplingParams(**self._sampling_defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        lora_name: str | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list of them; returns one output per prompt, in order.
        `lora_name`: the LoRA adapter they run with (None: the base model).

        Every prompt is submitted at once (waiting, not failing, while the engine pushes back);
        under in-flight batching they generate together, on the blocking path one by one.
        """
        return self._run(self._requests(prompts, params, {"lora_name": lora_name}))

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_name: str | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate a reply to a conversation (or to each of a list of conversations).

        `tools` (OpenAI function tools) and `chat_template_kwargs` (e.g. `{"enable_thinking":
        False}`) are variables of the chat template; `chat_template` (a template's text) renders
        in place of the model's own. Messages may hold images (content parts `{"type": "image",
        "image": PIL image}` or `{"type": "image_url", ...}`) and audio clips (`{"type":
        "audio", "audio": 16 kHz samples or (samples, rate)}`, `{"type": "input_audio", ...}`
        or `{"type": "audio_url", ...}`; see `runtime/inputs/chat_media.py`); `mm_processor_kwargs`
        `{"keep_ratio": r}` keeps that share of each image's tokens (the visual-token
        pruner)."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of chat messages")
        conversations = messages if isinstance(messages[0], list) else [messages]
        template = _template_args(tools, chat_template, chat_template_kwargs)
        options = {"lora_name": lora_name}
        requests = self._requests(conversations, params, options, template, mm_processor_kwargs)
        return self._run(requests)

    def _run(self, requests: list[GenerationRequest]) -> list[RequestOutput]:
        handles: list[RequestHandle] = []
        try:
            for request in requests:
                handles.append(self.start(request, wait_for_room=True))
            return [handle.get() for handle in handles]
        finally:
            for handle in handles:
                if not handle.ready():
                    handle.cancel()

    def generate_stream(
        self, prompt: Prompt, params: SamplingParams | None = None, *, lora_name: str | None = None
    ) -> RequestHandle:
        """The output as it is generated: iterate the handle for its chunks (the last one has
        `finished` set), `for` on a thread or `async for` on an asyncio loop. Closing it before
        the end cancels the request."""
        (request,) = self._requests(prompt, params, {"lora_name": lora_name})
        return self.start(request, wait_for_room=True)

    def prepare(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        **options: Any,
    ) -> GenerationRequest:
        """Tokenize and validate one prompt (ValueError naming the problem); queues nothing.
        `tools`, `chat_template` and `chat_template_kwargs` go to the chat template of a
        conversation, and `mm_processor_kwargs` to its images, as in `chat`. `options` are
        request options of the support matrix (`lora_name`, ...: the `GenerationRequest` fields
        after `params`)."""
        unknown = sorted(set(options) - OPTION_FIELDS)
        if unknown:
            raise ValueError(f"unknown request options {unknown}; known: {sorted(OPTION_FIELDS)}")
        template = _template_args(tools, chat_template, chat_template_kwargs)
        (request,) = self._requests(prompt, params, options, template, mm_processor_kwargs)
        return request

    def start(self, request: GenerationRequest, *, wait_for_room: bool = False) -> RequestHandle:
        """Submit a prepared request. When the engine is full it raises SubmitError (retry
        later), unless `wait_for_room`, which waits for room instead; a closed LLM raises
        RuntimeError, one whose engine stopped on an error a SubmitError naming the error."""
        delay = 0.001
        while True:
            try:
                return self._engine.submit(request)
            except SubmitError as exc:
                if exc.shutting_down:
                    if self._engine.fault is not None:
                        raise
                    raise RuntimeError("this LLM is closed") from exc
                if not wait_for_room:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 0.05)

    def load_lora_adapter(self, name: str, path: str | Path) -> None:
        """Serve the PEFT adapter at `path` as `name`; a ValueError names what is wrong with it
        (another base model's shapes, a rank above max_lora_rank, DoRA, ...)."""
        self._live().register_lora(name, str(path))

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving an adapter (ValueError when unknown); requests running with it finish."""
        try:
            self._live().unregister_lora(name)
        except KeyError:
            raise ValueError(f"no LoRA adapter named {name!r} is served") from None

    @property
    def lora_adapters(self) -> list[str]:
        """The names of the LoRA adapters served."""
        return [] if self._runtime is None else self._runtime.lora_names()

    def kv_cache_usage(self) -> tuple[int, int]:
        """(KV blocks in use, KV blocks in all)."""
        blocks = self._blocks
        return blocks.num_blocks - blocks.num_free, blocks.num_blocks

    def resident_slot_usage(self) -> tuple[int, int]:
        """(resident slots in use, resident slots in all)."""
        slots = self._slots
        return slots.capacity - slots.num_free, slots.capacity

    def get_scheduling_metrics(self) -> dict[str, float] | None:
        """The engine's counters and gauges, the context cache's as `context_cache_*` and
        speculative decoding's as `spec_decode_*`; None on the blocking path."""
        if not self.in_flight_batching:
            return None
        values: dict[str, float] = dict(self._engine.metrics.snapshot())
        values.update(queued=self._engine.queued, resident=self._engine.resident)
        for key, value in (self.get_context_cache_metrics() or {}).items():
            values[f"context_cache_{key}"] = value
        for key, value in (self.get_speculative_metrics() or {}).items():
            values[f"spec_decode_{key}"] = value
        return values

    def get_speculative_metrics(self) -> dict[str, float] | None:
        """Draft tokens verified and accepted, rows verified, acceptance rate, mean tokens a
        verified row emits per step; None when speculative decoding is off."""
        speculator = self._speculator
        return None if speculator is None else speculator.snapshot()

    def get_encoder_metrics(self) -> dict[str, float] | None:
        """Encoder runs and encoder-cache hits (None for a model without media input)."""
        cache = self._encoder_cache
        return None if cache is None else cache.snapshot()

    def get_context_cache_metrics(self) -> dict[str, float] | None:
        """Lookups, looked-up and hit prompt tokens, hit ratio, evictions, cached blocks; None
        when the context cache is off."""
        cache = self._context_cache
        return None if cache is None else cache.snapshot()

    @property
    def engine_fault(self) -> str | None:
        """Why the engine stopped serving on an internal error (every request it held failed,
        new ones are refused; a tensor-parallel runtime that lost a rank), or None while it
        serves."""
        runtime = self._runtime
        return self._engine.fault or (runtime.fault if runtime is not None else None)

    def close(self) -> None:
        """Finish what was accepted (drain), then release the model. Safe to call twice."""
        self._engine.shutdown(ShutdownMode.DRAIN)
        if self._runtime is not None:
            self._runtime.close()
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

    def _requests(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
        options: dict[str, Any] | None = None,
        template: dict[str, Any] | None = None,
        processor_kwargs: dict[str, Any] | None = None,
    ) -> list[GenerationRequest]:
        runtime = self._live()
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
        requests = []
        for prompt, sp in zip(items, param_list, strict=True):
            ids, data = self._tokenize(prompt, template)
            media = []
            if data:
                kwargs = processor_kwargs
                if isinstance(prompt, dict):
                    kwargs = prompt.get("mm_processor_kwargs", kwargs)
                ids, media = runtime.expand_media(ids, data, kwargs)
            requests.append(GenerationRequest(ids, sp, media=media, **(options or {})))
        # Bad input fails here, before anything is queued; each request carries its intent.
        return [runtime.check(request) for request in requests]

    def _tokenize(
        self, prompt: Prompt, template: dict[str, Any] | None = None
    ) -> tuple[list[int], dict[str, Any] | None]:
        """A prompt's token ids, and its media (`multi_modal_data`) if any."""
        tokenizer = self.tokenizer
        if template and not isinstance(prompt, list):
            raise ValueError("tools and chat template arguments apply to chat messages only")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return tokenizer.encode(prompt, add_special_tokens=True), None
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - _PROMPT_KEYS)
            if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
                raise ValueError(
                    "a prompt dict holds 'prompt' (text) or 'prompt_token_ids' ([int, ...]), "
                    "and optionally 'multi_modal_data' and 'mm_processor_kwargs'; got keys "
                    f"{sorted(prompt)}"
                )
            data = prompt.get("multi_modal_data")
            if data is not None and not isinstance(data, dict):
                raise ValueError("multi_modal_data must be a dict such as {'image': image}")
            for kind, items in (data or {}).items():
                items = items if isinstance(items, list) else [items]
                self.media_limits.check_count(kind, len(items))
                if kind == "audio":
                    for clip in items:
                        self.media_limits.check_audio(clip)
            if "prompt" in prompt:
                if not isinstance(prompt["prompt"], str):
                    raise ValueError("a prompt dict's 'prompt' must be a string")
                return self._tokenize(prompt["prompt"])[0], data
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise ValueError("a token prompt must be {'prompt_token_ids': [int, ...]}")
            return ids, data
        _check_messages(prompt)
        runtime = self._live()
        messages, media = take_media(prompt, self.media_limits, runtime.media)
        if not media:
            return self._render(as_text(messages, {}), template), None
        placeholders = {kind: runtime.media_placeholder(kind) for kind in media}
        # A template of a media model renders media parts as their placeholders; one that
        # renders text only gets each placeholder's text on a line before the message's text.
        ids = self._render(messages, template)
        counts = {kind: sum(1 for t in ids if t == token) for kind, token in placeholders.items()}
        if any(counts[kind] != len(items) for kind, items in media.items()):
            texts = {
                kind: tokenizer.decode([token], skip_special_tokens=False)
                for kind, token in placeholders.items()
            }
            ids = self._render(as_text(messages, texts), template)
        return ids, media

    def _render(self, messages: list[dict[str, Any]], template: dict[str, Any] | None) -> list[int]:
        tokenizer = self.tokenizer
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, **(template or {})
        )
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


# What a prompt given as a dict may hold (vLLM's keys).
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "multi_modal_data", "mm_processor_kwargs"})

# Variables the rendering itself sets; chat_template_kwargs may not replace them.
_RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "chat_template"}
)


def _template_args(
    tools: list[dict[str, Any]] | None,
    chat_template: str | None,
    chat_template_kwargs: dict[str, Any] | None,
) -> dict[str, Any]:
    """The keyword arguments of `Tokenizer.apply_chat_template` for a conversation."""
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_VARIABLES & set(kwargs))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved}; pass them as arguments")
    if tools is not None:
        kwargs["tools"] = tools
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    return kwargs


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("a chat conversation must be a non-empty list of messages")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"each chat message must be a dict with a 'role', got {m!r}")
