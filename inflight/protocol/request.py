"""What a caller asks the runtime for: sampling parameters and a tokenized prompt (torch-free)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

MAX_LOGPROBS = 20
# The request fields that carry a prompt's media and their preprocessing options (vLLM's names),
# as errors name them.
MEDIA_FIELD = "multi_modal_data"
PROCESSOR_FIELD = "mm_processor_kwargs"


class PromptTooLongError(ValueError):
    """The prompt does not fit the deployment's context: `tokens` where at most `maximum` fit
    (HTTP 400, OpenAI's `context_length_exceeded`)."""

    def __init__(self, message: str, tokens: int, maximum: int) -> None:
        super().__init__(message)
        self.tokens = tokens
        self.maximum = maximum


def _context_overflow(limit: int, detail: str) -> str:
    """A refusal of a request past the context of `limit` tokens in OpenAI's and vLLM's words
    ("This model's maximum context length is N tokens. However, you requested M tokens" or
    "your prompt resulted in M tokens"), which clients' error classifiers match: litellm's and
    any-llm's the opening, Crush's (fantasy's) the numbers after it."""
    opening = f"This model's maximum context length is {limit} tokens (max_model_len)."
    return f"{opening} However, {detail}"


def prompt_past_context(limit: int, tokens: int, maximum: int, room: str) -> PromptTooLongError:
    """A prompt of `tokens` where at most `maximum` leave room for `room` (the least output the
    deployment must still write) in the context of `limit`."""
    detail = (
        f"your prompt resulted in {tokens} tokens, where at most {maximum} leave room for {room}. "
        "Please reduce the length of the prompt."
    )
    return PromptTooLongError(_context_overflow(limit, detail), tokens, maximum)


class RequestFieldError(ValueError):
    """A request field this runtime cannot take (an option it does not serve, a constraint that
    does not compile); `field` names it."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class ContextOverflowError(RequestFieldError):
    """The prompt's `tokens` plus `max_tokens` outgrow the context of `limit` tokens (HTTP 400,
    OpenAI's `context_length_exceeded`)."""

    def __init__(self, message: str, tokens: int, max_tokens: int, limit: int) -> None:
        super().__init__(message, "max_tokens")
        self.tokens = tokens
        self.max_tokens = max_tokens
        self.limit = limit


def completion_past_context(
    limit: int, tokens: int, max_tokens: int, counted: int | None = None, how: str = ""
) -> ContextOverflowError:
    """A prompt of `tokens` whose `max_tokens` outgrow the context of `limit`; `counted`: the
    completion's tokens as the deployment reserves them where that differs (`how` says why)."""
    completion = max_tokens if counted is None else counted
    detail = (
        f"you requested {tokens + completion} tokens ({tokens} in the prompt, {max_tokens} in the "
        f"completion{how}). Please reduce the length of the prompt or max_tokens."
    )
    return ContextOverflowError(_context_overflow(limit, detail), tokens, completion, limit)


MAX_LOGIT_BIAS_ENTRIES = 1024


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on the output (vLLM's `structured_outputs`): exactly one of a JSON schema
    (`json`, an object or its JSON text), any JSON object (`json_object`), a regular expression
    (`regex`, matched whole), one of several strings (`choice`), or a context-free grammar
    (`grammar`, in Lark or GBNF syntax). Only outputs of that language can be sampled, and a
    request ends ("stop") when its output is complete in it.

    A JSON schema's objects take only the properties it declares unless it allows more
    (`additionalProperties`); `strict` (OpenAI's `strict: true`) closes also the objects that
    declare no properties at all, which then take only `{}`."""

    json: Mapping[str, Any] | str | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    strict: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object is True else []
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, json_object, regex, choice, "
                f"grammar; got {kinds or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, Mapping | str):
            raise ValueError("structured_outputs.json must be a JSON schema object or its text")
        if not isinstance(self.strict, bool) or (self.strict and self.json is None):
            raise ValueError("structured_outputs.strict must be a boolean, true only with json")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        """Which constraint it is: json, json_object, regex, choice or grammar."""
        if self.json_object is True:
            return "json_object"
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k))


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each output token and when to stop; every field applies per request (per row).

    `max_tokens=None` generates until EOS, a stop, or the context capacity. `temperature=0` is
    greedy. `top_k` of 0 or -1 and `top_p=1` turn those filters off. `logprobs=N` returns the
    chosen token's log-probability and the N most likely alternatives at each step (0: the chosen
    one only); `prompt_logprobs=N` does the same for every prompt token after the first, and with
    it `max_tokens=0` scores the prompt without generating. Log-probabilities are those of the
    model's raw distribution, also under `structured_outputs` (which masks what can be sampled).
    Penalties, as vLLM and the OpenAI API apply them: `repetition_penalty` divides the positive
    logits (multiplies the others) of every token in the prompt or the output so far;
    `frequency_penalty` subtracts itself times a token's count in the output so far,
    `presence_penalty` itself once a token is in it. `min_tokens` (vLLM's): the first that many
    output tokens are never EOS (unless `ignore_eos`) nor a stop token id, and no stop string ends
    the output before them.
    """

    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    # With the context cache on: look the prompt's prefix up (else compute it all), and make
    # blocks holding generated tokens findable too (else only the prompt's).
    reuse_context: bool = True
    cache_generated_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    # Sequences to generate for the prompt: prefilled once, each sampled on its own.
    n: int = 1
    # With speculative decoding on: draft and verify this request's tokens (False: one token
    # per step). The output is the same either way.
    speculative: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, Mapping):
            known = {f.name for f in fields(StructuredOutputs)}
            unknown = sorted(set(self.structured_outputs) - known)
            if unknown:
                raise ValueError(
                    f"structured_outputs has unknown fields {unknown}; known: {sorted(known)}"
                )
            object.__setattr__(
                self, "structured_outputs", StructuredOutputs(**self.structured_outputs)
            )
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        object.__setattr__(
            self, "logit_bias", {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        )
        self._validate()

    def _validate(self) -> None:
        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.n > 1 and self.max_tokens == 0:
            raise ValueError("n > 1 needs max_tokens >= 1: scoring a prompt makes one sequence")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputs
        ):
            raise ValueError(
                "structured_outputs must be a StructuredOutputs or a mapping of its fields, "
                f"got {type(self.structured_outputs).__name__}"
            )
        least = 0 if self.prompt_logprobs is not None else 1
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < least):
            raise ValueError(
                f"max_tokens must be an integer >= 1 (0 only to score a prompt, with "
                f"prompt_logprobs), got {self.max_tokens!r}"
            )
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be at most max_tokens, got {self.min_tokens} > {self.max_tokens}"
            )
        if self.min_tokens and self.structured_outputs is not None:
            raise ValueError(
                "min_tokens with structured_outputs is not served: the constraint may end the "
                "output before min_tokens, where only EOS is left to pick"
            )
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1: off), got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.logprobs is not None and (
            not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )
        if self.prompt_logprobs is not None and (
            not is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], "
                f"got {self.prompt_logprobs!r}"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {list(self.stop)!r}")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be non-negative integers, got {list(self.stop_token_ids)!r}"
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries")
        for token, bias in self.logit_bias.items():
            if token < 0 or not math.isfinite(bias) or not -100 <= bias <= 100:
                raise ValueError(
                    f"logit_bias entries must map token ids >= 0 to values in [-100, 100], "
                    f"got {token}: {bias}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether a penalty applies: the row's logits depend on the tokens before it."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )


@dataclass(frozen=True, eq=False)
class MediaItem:
    """An image or audio clip of the prompt: its placeholder tokens are prompt positions
    `offset` .. `offset + length`, whose embeddings its encoder's output (`tokens` of them; the
    visual-token pruner keeps `length`) replaces; `key` hashes its content (the encoder cache's
    and the context cache's key); `data` is what its encoder takes (opaque here). `grid`: with
    M-RoPE, the (temporal, height, width) extent of its tokens' 3-D positions."""

    kind: str
    offset: int
    length: int
    key: bytes
    data: Any = field(repr=False)
    tokens: int
    grid: tuple[int, int, int] | None = None

    @property
    def span(self) -> int:
        """How far the positions of the tokens after it advance past its first (M-RoPE: the
        larger side of its grid; else its token count)."""
        return self.length if self.grid is None else max(self.grid[1], self.grid[2])


@dataclass(frozen=True)
class SpeechParams:
    """What a speech request asks beside its text (its prompt, as the model reads it; its
    `params` sample each frame's first code, and `max_tokens` counts frames).

    `voice`: a preset speaker of a custom-voice model (None: the model's default voice, or
    the one the instructions or the reference audio give). `language`: one of the model's, or
    "auto". `instruction_token_ids`: the instructions as the model reads them (voice design,
    style), set by the input processor. `reference_audio`: a base model's voice to clone, mono
    float samples at `reference_sample_rate`. `subtalker_*`: the code predictor's sampling of
    a frame's other codebooks (`subtalker_sample=False`: greedy)."""

    voice: str | None = None
    language: str = "auto"
    instruction_token_ids: tuple[int, ...] = ()
    reference_audio: Any = field(default=None, repr=False, compare=False)
    reference_sample_rate: int = 24000
    # All the text in the prompt (True), or one text token joining each of the first frames
    # (False); None: as the model's kind does by default (the package's `non_streaming_mode`).
    text_in_prompt: bool | None = None
    subtalker_sample: bool = True
    subtalker_temperature: float = 0.9
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "instruction_token_ids", tuple(self.instruction_token_ids))
        t = self.subtalker_temperature
        if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t) or t <= 0:
            raise RequestFieldError(
                f"subtalker_temperature must be > 0, got {t!r}", "subtalker_temperature"
            )
        if not is_int(self.subtalker_top_k) or self.subtalker_top_k < 0:
            raise RequestFieldError(
                f"subtalker_top_k must be an integer >= 0 (0: off), got {self.subtalker_top_k!r}",
                "subtalker_top_k",
            )
        p = self.subtalker_top_p
        if not isinstance(p, int | float) or isinstance(p, bool) or not 0 < p <= 1:
            raise RequestFieldError(
                f"subtalker_top_p must be in (0, 1], got {p!r}", "subtalker_top_p"
            )
        if not is_int(self.reference_sample_rate) or self.reference_sample_rate <= 0:
            raise RequestFieldError(
                "reference_sample_rate must be a positive integer, "
                f"got {self.reference_sample_rate!r}",
                "reference_sample_rate",
            )


@dataclass(frozen=True)
class AudioReply:
    """A chat request's ask to hear its reply (a model that speaks, Qwen3-Omni): the reply's
    text spoken in `voice` as it is written. The talker samples each frame's first code with
    `temperature` (0: greedy, and then the code predictor too), `top_k` (0: off), `top_p`
    and `repetition_penalty` (its model's defaults unless set); `max_frames` bounds the
    audio (12.5 frames a second; None: as long as the talker's context allows).
    `reply_in_prompt`: the prompt's assistant turn holds the whole reply, which is read aloud
    (the speech API on such a model); what the thinker writes after it is not spoken, and the
    request ends as its voice does."""

    voice: str
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    max_frames: int | None = None
    reply_in_prompt: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.voice, str) or not self.voice:
            raise RequestFieldError(
                f"audio voice must be a voice's name, got {self.voice!r}", "voice"
            )
        t = self.temperature
        if not _is_number(t) or t < 0:
            raise RequestFieldError(f"audio temperature must be >= 0, got {t!r}", "temperature")
        if not is_int(self.top_k) or self.top_k < 0:
            raise RequestFieldError(
                f"audio top_k must be an integer >= 0 (0: off), got {self.top_k!r}", "top_k"
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestFieldError(f"audio top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        penalty = self.repetition_penalty
        if not _is_number(penalty) or penalty <= 0:
            raise RequestFieldError(
                f"audio repetition_penalty must be > 0, got {penalty!r}", "repetition_penalty"
            )
        frames = self.max_frames
        if frames is not None and (not is_int(frames) or frames < 1):
            raise RequestFieldError(
                f"audio max_frames must be an integer >= 1, got {frames!r}", "max_frames"
            )


@dataclass(frozen=True)
class DiffusionParams:
    """How a block-diffusion model (DiffusionGemma) denoises a request's canvases; each field
    left None takes the model's default (its generation_config.json, else transformers').

    Each canvas takes at most `max_denoising_steps` steps. Step s of N (counting the steps
    left, N down to 1) samples at temperature t_min + (t_max - t_min) * s / N. The positions
    of lowest entropy are accepted while their entropies beyond the largest one sum to at
    most `entropy_bound`; the rest are redrawn at random. A canvas ends early once its argmax
    held for `stability_threshold` steps and its mean entropy is below
    `confidence_threshold`. The request's `temperature` scales both temperatures (1: the
    model's schedule; 0: every step takes its argmax, from canvases drawn under seed 0, so
    the output is the same whatever the request's seed); `seed` seeds its own generator."""

    max_denoising_steps: int | None = None
    t_min: float | None = None
    t_max: float | None = None
    entropy_bound: float | None = None
    stability_threshold: int | None = None
    confidence_threshold: float | None = None
    # Stream each denoising step's argmax of the canvas in progress (`StreamChunk.draft`).
    stream_drafts: bool = False

    def __post_init__(self) -> None:
        steps = self.max_denoising_steps
        if steps is not None and (not is_int(steps) or steps < 1):
            raise RequestFieldError(
                f"max_denoising_steps must be an integer >= 1, got {steps!r}",
                "max_denoising_steps",
            )
        for name in ("t_min", "t_max", "entropy_bound"):
            value = getattr(self, name)
            if value is not None and (not _is_number(value) or value <= 0):
                raise RequestFieldError(f"{name} must be a number > 0, got {value!r}", name)
        if self.t_min is not None and self.t_max is not None and self.t_min > self.t_max:
            raise RequestFieldError(
                f"t_min ({self.t_min}) must not exceed t_max ({self.t_max})", "t_min"
            )
        stability = self.stability_threshold
        if stability is not None and (not is_int(stability) or stability < 0):
            raise RequestFieldError(
                f"stability_threshold must be an integer >= 0, got {stability!r}",
                "stability_threshold",
            )
        confidence = self.confidence_threshold
        if confidence is not None and (not _is_number(confidence) or confidence < 0):
            raise RequestFieldError(
                f"confidence_threshold must be a number >= 0, got {confidence!r}",
                "confidence_threshold",
            )


@dataclass(frozen=True)
class AdmissionIntent:
    """What a runtime's check of a request found it needs, so that admission takes it without
    checking again: its output budget, the KV blocks of each of its n sequences
    (`sequence_blocks`; the first `shared_blocks`, its prompt's full blocks but the last token,
    are the first sequence's and leased by the others) and in all (`blocks_needed`).
    `checked_by` names the runtime that checked it: another checks it again."""

    checked_by: int
    max_new_tokens: int
    blocks_needed: int
    sequence_blocks: int
    shared_blocks: int = 0


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt, already tokenized, and how to continue it.

    The fields after `params` but `priority` (the engine's queue order) are request options of
    the design's support matrix; where each is served or refused, and with which message, is the
    table in `options.py`. `intent` is set by a runtime's check (`LLM.prepare`, or `submit` for
    a request built by hand).
    """

    prompt_token_ids: Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    lora_name: str | None = None  # a per-request LoRA adapter
    generate_audio: AudioReply | None = None  # the reply spoken too (a model that speaks)
    # Pin the KV of its system prompt in the context cache (the seed's system-prompt capture):
    # its first `system_prompt_tokens` tokens (a chat's through its system turn, as rendering
    # it sets; None: the whole prompt).
    save_system_prompt_kv_cache: bool = False
    past_trajectory: Sequence[Any] | None = None  # trajectory execution
    media: Sequence[MediaItem] = ()  # images and audio clips in the prompt, in prompt order
    system_prompt_tokens: int | None = None
    speech: SpeechParams | None = None  # text to speech: the voice, and more (a speech model)
    diffusion: DiffusionParams | None = None  # how a block-diffusion model denoises it
    # The engine's, not a runtime option: its place in the queue under the priority scheduling
    # policy (lower first, as vLLM's; arrival order among equals).
    priority: int = 0
    intent: AdmissionIntent | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        object.__setattr__(self, "media", tuple(self.media))
        if not is_int(self.priority):
            raise RequestFieldError(
                f"priority must be an integer, got {self.priority!r}", "priority"
            )


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
