"""The Python API: `LLM` and `SamplingParams`, in the shape vLLM users know."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
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
from inflight.protocol.request import (
    AudioReply,
    DiffusionParams,
    GenerationRequest,
    RequestFieldError,
    SamplingParams,
)
from inflight.protocol.speech import SPEECH_SAMPLING, SpeechFacts, SpeechOutput
from inflight.runtime.deployment import ifb_unsupported_reason
from inflight.runtime.diffusion.runtime import DiffusionRuntime
from inflight.runtime.factory import open_runtime
from inflight.runtime.host.pinned import pin_id
from inflight.runtime.inputs.processor import Message, Prompt, template_args
from inflight.runtime.runtime import Runtime
from inflight.runtime.speech.inputs import check_text
from inflight.runtime.speech.runtime import SpeechRuntime


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
        self,
        model: str | Path | None = None,
        *,
        show_progress: bool = False,
        warmup_prompts: Sequence[Prompt] = (),
        **options: Any,
    ) -> None:
        known = {f.name for f in fields(DeploymentOptions)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown LLM options {unknown}; known: {sorted(known)}")
        deployment = DeploymentOptions(**options)
        ifb = deployment.enable_in_flight_batching
        # Validated before the model loads, which takes a while.
        # Queued or generating, in requests: the engine's command queue holds as many, so
        # the one limit a caller meets is max_queued_requests.
        room = (deployment.max_batch_size if ifb else 1) + deployment.max_queued_requests
        engine_config = EngineConfig(
            max_batch_size=deployment.max_batch_size if ifb else 1,
            max_pending_requests=room,
            command_queue_capacity=room,
            scheduling_policy=deployment.scheduling_policy,
        )
        runtime = open_runtime(model, deployment, show_progress)
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
        self._runtime: Runtime | SpeechRuntime | DiffusionRuntime | None = runtime
        self.in_flight_batching = ifb
        # Kept for the counters, which stay readable after close().
        self._blocks, self._slots = runtime.blocks, runtime.slots
        self._context_cache = runtime.context_cache
        self._speculator = runtime.speculator
        self._encoder_cache = runtime.encoder_cache
        # What a prompt may hold: text, and the media the model takes.
        self.input_modalities = ["text", *runtime.media]
        # A text-to-speech model's voices, languages and rates (None: it writes text).
        self.speech_facts: SpeechFacts | None = None
        # A model that may speak its chat replies: its voices and rates (None: it does not).
        self.voice_facts: SpeechFacts | None = None
        if isinstance(runtime, SpeechRuntime):
            self.speech_facts = runtime.facts
            self.output_modalities = ["audio"]
        else:
            self.voice_facts = runtime.voice_facts
            self.output_modalities = ["text"] if self.voice_facts is None else ["text", "audio"]
        self._sampling_defaults = runtime.checkpoint.sampling_defaults
        self.tokenizer = runtime.tokenizer
        self.model_name = runtime.model_name
        self.max_model_len = runtime.max_model_len
        self.max_batch_size = engine_config.max_batch_size
        self.max_queued_requests = deployment.max_queued_requests
        # A block-diffusion model's canvas (its output comes this many tokens at a time; None:
        # the model writes a token at a time).
        self.canvas_length: int | None = None
        if isinstance(runtime, DiffusionRuntime):
            self.canvas_length = runtime.canvas_length
        if warmup_prompts:
            try:
                self.warm_up(warmup_prompts)
            except BaseException:
                self.close()
                raise

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
        save_system_prompt_kv_cache: bool = False,
        diffusion: DiffusionParams | None = None,
        priority: int = 0,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list of them; returns one output per prompt, in order.
        `lora_name`: the LoRA adapter they run with (None: the base model);
        `save_system_prompt_kv_cache`: pin each prompt's KV (its full blocks) in the context
        cache, never evicted until `unpin` (see `pinned_prefixes`); `diffusion`: how a
        block-diffusion model (`canvas_length` set) denoises them (None: its defaults);
        `priority`: their place in the queue under `scheduling_policy="priority"` (lower
        first).

        Every prompt is submitted at once (waiting, not failing, while the engine pushes back);
        under in-flight batching they generate together, on the blocking path one by one.
        """
        options = {
            "lora_name": lora_name,
            "save_system_prompt_kv_cache": save_system_prompt_kv_cache,
            "diffusion": diffusion,
            "priority": priority,
        }
        return self._run(self._requests(prompts, params, options))

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        lora_name: str | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        save_system_prompt_kv_cache: bool = False,
        audio: AudioReply | None = None,
        diffusion: DiffusionParams | None = None,
        priority: int = 0,
    ) -> list[RequestOutput]:
        """Generate a reply to a conversation (or to each of a list of conversations).

        `tools` (OpenAI function tools) and `chat_template_kwargs` (e.g. `{"enable_thinking":
        False}`) are variables of the chat template; `chat_template` (a template's text) renders
        in place of the model's own. As in vLLM, `continue_final_message` (with
        `add_generation_prompt=False`) has the reply go on with the final message's text (an
        assistant's prefill) where a new reply would open. Messages may hold images (content
        parts `{"type": "image", "image": PIL image}` or `{"type": "image_url", ...}`) and
        audio clips (`{"type": "audio", "audio": 16 kHz samples or (samples, rate)}`,
        `{"type": "input_audio", ...}` or `{"type": "audio_url", ...}`; see
        `runtime/inputs/chat_media.py`); `mm_processor_kwargs` `{"keep_ratio": r}` keeps that
        share of each image's tokens (the visual-token pruner). `save_system_prompt_kv_cache`:
        pin the KV of each conversation's system turn in the context cache (see `generate`).
        `audio` (a model that speaks, `voice_facts`): each reply spoken too, as it is written;
        its `CompletionOutput.audio` holds the samples (float32 little-endian,
        `voice_facts.sample_rate`). `diffusion` and `priority`: as in `generate`."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of chat messages")
        conversations = messages if isinstance(messages[0], list) else [messages]
        template = template_args(
            tools,
            chat_template,
            chat_template_kwargs,
            add_generation_prompt,
            continue_final_message,
        )
        options = {
            "lora_name": lora_name,
            "save_system_prompt_kv_cache": save_system_prompt_kv_cache,
            "generate_audio": audio,
            "diffusion": diffusion,
            "priority": priority,
        }
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
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        lora_name: str | None = None,
        diffusion: DiffusionParams | None = None,
        priority: int = 0,
    ) -> RequestHandle:
        """The output as it is generated: iterate the handle for its chunks (the last one has
        `finished` set; a block-diffusion model's come a canvas at a time), `for` on a thread
        or `async for` on an asyncio loop. Closing it before the end cancels the request."""
        options = {"lora_name": lora_name, "diffusion": diffusion, "priority": priority}
        (request,) = self._requests(prompt, params, options)
        return self.start(request, wait_for_room=True)

    def speech(
        self, text: str, params: SamplingParams | None = None, **options: Any
    ) -> SpeechOutput:
        """Speak `text` (a text-to-speech model): its audio, whole. `options`: `voice` (a
        custom-voice model's preset voice), `language` (one of the model's, or "auto"),
        `instructions` (the voice or style described; a voice-design model needs them),
        `reference_audio` (mono float samples at `reference_sample_rate`, 24 kHz by default,
        or a WAV file's bytes: the voice a base model clones), and the other `SpeechParams`
        fields (the code predictor's `subtalker_*` sampling, `text_in_prompt`). `params`
        sample each frame's first code (None: the package's defaults, temperature 0.9, top-k
        50, repetition penalty 1.05; `temperature=0` is greedy) and `max_tokens` counts frames,
        12.5 a second. A bad field is a ValueError naming it; nothing is queued."""
        handle = self.speech_stream(text, params, **options)
        audio, codes, reason = bytearray(), [], "stop"
        try:
            for chunk in handle:
                audio += chunk.audio
                codes += chunk.codes
                reason = chunk.finish_reason or reason
        finally:
            handle.close()
        facts = self.speech_facts or self.voice_facts
        assert facts is not None
        return SpeechOutput(bytes(audio), facts.sample_rate, tuple(codes), reason)

    def speech_stream(
        self, text: str, params: SamplingParams | None = None, **speech: Any
    ) -> RequestHandle:
        """`speech`'s audio as it is made: iterate the handle for chunks whose `audio` holds
        the new samples (float32 little-endian) and `codes` their frames; the last has
        `finished` set. Closing it before the end cancels the request."""
        return self.start(self.prepare_speech(text, params, **speech), wait_for_room=True)

    def prepare_speech(
        self, text: str, params: SamplingParams | None = None, **speech: Any
    ) -> GenerationRequest:
        """A checked speech request (see `speech`); queues nothing. A model that speaks its
        replies (Qwen3-Omni) reads `text` as its reply (see `_read_aloud`)."""
        runtime = self._live()
        if isinstance(runtime, SpeechRuntime):
            return runtime.inputs.request(text, params, **speech)
        if runtime.voice_facts is not None:
            return self._read_aloud(runtime, text, params, **speech)
        raise ValueError(f"{self.model_name} writes text; speech needs a model that speaks")

    def _read_aloud(
        self,
        runtime: Runtime,
        text: str,
        params: SamplingParams | None,
        voice: str | None = None,
        instructions: str | None = None,
        **others: Any,
    ) -> GenerationRequest:
        """A model that speaks its replies reading `text`: the assistant turn holding `text`
        already (`AudioReply.reply_in_prompt`), after a user turn of the `instructions`.
        `params` sample the talker (`max_tokens`: its frames)."""
        given = sorted(k for k, v in others.items() if v is not None)
        if given:
            raise RequestFieldError(
                f"{given[0]} is not served by a model that speaks its replies", given[0]
            )
        check_text(text)
        facts = runtime.voice_facts
        assert facts is not None
        if voice is None:
            raise RequestFieldError(f"voice is needed: one of {', '.join(facts.voices)}", "voice")
        turn = self.prepare([{"role": "user", "content": instructions or ""}])
        ids = [*turn.prompt_token_ids, *self.tokenizer.encode(text, add_special_tokens=False)]
        p = params or SamplingParams(**SPEECH_SAMPLING)
        audio = AudioReply(
            voice,
            temperature=p.temperature,
            top_k=max(p.top_k, 0),
            top_p=p.top_p,
            repetition_penalty=p.repetition_penalty,
            max_frames=p.max_tokens,
            reply_in_prompt=True,
        )
        # The thinker's token after the reply is not spoken.
        thinker = SamplingParams(max_tokens=1, seed=p.seed)
        return runtime.check(GenerationRequest(ids, thinker, generate_audio=audio))

    def prepare(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        mm_processor_kwargs: dict[str, Any] | None = None,
        priority: int = 0,
        **options: Any,
    ) -> GenerationRequest:
        """Tokenize and validate one prompt (ValueError naming the problem); queues nothing.
        `tools`, `chat_template`, `chat_template_kwargs`, `add_generation_prompt` and
        `continue_final_message` go to the chat template of a conversation, and
        `mm_processor_kwargs` to its images, as in `chat`; `priority` as in `generate`.
        `options` are request options of the support matrix (`lora_name`, ...: the
        `GenerationRequest` fields after `params`)."""
        unknown = sorted(set(options) - OPTION_FIELDS)
        if unknown:
            raise ValueError(f"unknown request options {unknown}; known: {sorted(OPTION_FIELDS)}")
        template = template_args(
            tools,
            chat_template,
            chat_template_kwargs,
            add_generation_prompt,
            continue_final_message,
        )
        options = {**options, "priority": priority}
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

    def warm_up(
        self, prompts: Sequence[Prompt], progress: Callable[[int, int], None] | None = None
    ) -> list[str]:
        """Prefill each prompt and pin it (a chat conversation's system turn; a text or token
        prompt whole) in the context cache, one after another (`progress(done, total)` after
        each); the pins' ids, in order."""
        ids = []
        params = SamplingParams(max_tokens=1, temperature=0)
        block_size = self._blocks.block_size
        for done, prompt in enumerate(prompts, 1):
            (request,) = self._requests(prompt, params, {"save_system_prompt_kv_cache": True})
            (output,) = self._run([request])
            ids.append(pin_id(request, block_size))
            assert self._context_cache is not None  # a pin was served: the cache is on
            if not self._context_cache.is_pinned(ids[-1]):
                raise RuntimeError(
                    f"warm-up prompt {done} was not pinned (it ended {output.finish_reason!r})"
                )
            if progress is not None:
                progress(done, len(prompts))
        return ids

    def pinned_prefixes(self) -> list[dict[str, Any]]:
        """The prefixes pinned in the context cache: each one's `id` (for `unpin`), `tokens`
        and `hit_tokens` (prompt tokens later requests found in it)."""
        cache = self._context_cache
        if cache is None:
            return []
        return [
            {"id": pin.id, "tokens": pin.tokens, "hit_tokens": pin.hit_tokens}
            for pin in cache.pinned()
        ]

    def unpin(self, prefix_id: str) -> None:
        """Let a pinned prefix's KV go (it stays cached until evicted); a ValueError for an id
        that is not pinned."""
        cache = self._context_cache
        try:
            if cache is None:
                raise KeyError(prefix_id)
            cache.unpin(prefix_id)
        except KeyError:
            raise ValueError(f"no pinned prefix has id {prefix_id!r}") from None

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

    def _live(self) -> Runtime | SpeechRuntime | DiffusionRuntime:
        if self._runtime is None:
            raise RuntimeError("this LLM is closed")
        return self._runtime

    def _requests(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
        options: dict[str, Any],
        template: dict[str, Any] | None = None,
        processor_kwargs: dict[str, Any] | None = None,
    ) -> list[GenerationRequest]:
        runtime = self._live()
        if isinstance(runtime, SpeechRuntime):
            raise ValueError(
                f"{self.model_name} is a text-to-speech model: use LLM.speech "
                "(POST /v1/audio/speech)"
            )
        if params is None:
            params = self.get_default_sampling_params()
        inputs = runtime.input_processor
        requests = inputs.requests(prompts, params, options, template, processor_kwargs)
        for request in requests:
            self._engine.config.check(request)
        return requests
