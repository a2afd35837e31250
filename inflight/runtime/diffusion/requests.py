"""A block-diffusion model's check of a request (torch-free): what it serves, its denoising
settings resolved, and what it needs (canvases, KV blocks).

Block diffusion samples whole canvases: per-token sampling filters (top-p, top-k, min-p),
penalties, logit biases, log-probabilities, structured outputs and n > 1 have no meaning here
and are refused by name; `temperature` scales the denoising schedule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from inflight.protocol.options import check_runtime_serves
from inflight.protocol.request import (
    MEDIA_FIELD,
    PROCESSOR_FIELD,
    AdmissionIntent,
    DiffusionParams,
    GenerationRequest,
    RequestFieldError,
    SamplingParams,
    completion_past_context,
    prompt_past_context,
)
from inflight.runtime.host.media import MediaSpec, check_media

if TYPE_CHECKING:
    from inflight.model.config import DenoiseDefaults

SERVED_OPTIONS = frozenset({"diffusion"})
_ALTERNATIVE = (
    "block diffusion samples whole canvases; steer it with temperature, t_min/t_max, entropy_bound"
)
# SamplingParams fields a diffusion request must leave as they are, and why.
_REFUSED: tuple[tuple[str, object, str], ...] = (
    ("top_p", 1.0, _ALTERNATIVE),
    ("top_k", 0, _ALTERNATIVE),
    ("min_p", 0.0, _ALTERNATIVE),
    ("presence_penalty", 0.0, _ALTERNATIVE),
    ("frequency_penalty", 0.0, _ALTERNATIVE),
    ("repetition_penalty", 1.0, _ALTERNATIVE),
    ("logprobs", None, "a canvas's tokens have no per-token log-probabilities"),
    ("prompt_logprobs", None, "the prompt is encoded, not scored"),
    ("structured_outputs", None, "a canvas is not sampled a token at a time"),
    ("n", 1, "send the request n times, each with its own seed"),
    ("min_tokens", 0, "a canvas ends where its denoised tokens say, not where a draw allows"),
)


@dataclass(frozen=True)
class Denoising:
    """A request's denoising settings, resolved against the model's defaults (see
    `DiffusionParams`); `temperature` scales the schedule (0: every step its argmax)."""

    steps: int
    t_min: float
    t_max: float
    entropy_bound: float
    stability_threshold: int
    confidence_threshold: float
    temperature: float = 1.0

    def scale(self, left: int) -> float:
        """The temperature of the step with `left` steps left (N down to 1)."""
        t = self.t_min + (self.t_max - self.t_min) * (left / self.steps)
        return t * self.temperature


def denoising(
    params: SamplingParams, diffusion: DiffusionParams | None, defaults: DenoiseDefaults
) -> Denoising:
    """The request's settings: its own where it sets them, the model's where not; a t_min
    above the resolved t_max is a RequestFieldError."""
    d = diffusion or DiffusionParams()

    def pick(name: str) -> float:
        value = getattr(d, name)
        return getattr(defaults, name) if value is None else value

    settings = Denoising(
        steps=int(pick("max_denoising_steps")),
        t_min=pick("t_min"),
        t_max=pick("t_max"),
        entropy_bound=pick("entropy_bound"),
        stability_threshold=int(pick("stability_threshold")),
        confidence_threshold=pick("confidence_threshold"),
        temperature=params.temperature,
    )
    if settings.t_min > settings.t_max:
        raise RequestFieldError(
            f"t_min ({settings.t_min}) must not exceed t_max ({settings.t_max}) (the model's "
            "default fills the one left unset)",
            "t_min",
        )
    return settings


@dataclass(frozen=True)
class DiffusionChecks:
    """The checks of one runtime (`checked_by`: its id), from its fixed facts."""

    checked_by: int
    canvas: int
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    defaults: DenoiseDefaults
    media: Mapping[str, MediaSpec] = field(default_factory=dict)  # the media it takes
    # The most tokens a step encodes, where an image is encoded whole (its tokens attend to
    # each other both ways); None where chunks may split it.
    whole_media_limit: int | None = None

    def checked(self, request: GenerationRequest) -> GenerationRequest:
        """The request carrying its intent (ValueError naming what it cannot have)."""
        if request.intent is not None and request.intent.checked_by == self.checked_by:
            return request
        return replace(request, intent=self.intent(request))

    def intent(self, request: GenerationRequest) -> AdmissionIntent:
        check_runtime_serves(request, SERVED_OPTIONS)
        prompt, params = request.prompt_token_ids, request.params
        if request.media:
            check_media(request, self.media)
        limit = self.whole_media_limit
        big = next((i for i in request.media if limit is not None and i.length > limit), None)
        if big is not None:
            raise RequestFieldError(
                f"an {big.kind} of {big.length} tokens is encoded in one step here, above "
                f"max_num_tokens ({limit}); send a smaller one or raise max_num_tokens",
                MEDIA_FIELD,
            )
        if any(item.length != item.tokens for item in request.media):
            raise RequestFieldError(
                "the visual-token pruner (mm_processor_kwargs keep_ratio) is not served for a "
                "block-diffusion model",
                PROCESSOR_FIELD,
            )
        for name, default, why in _REFUSED:
            if getattr(params, name) != default:
                raise RequestFieldError(
                    f"{name}={getattr(params, name)!r} is not served for a block-diffusion "
                    f"model: {why}",
                    name,
                )
        if params.logit_bias:
            raise RequestFieldError(
                f"logit_bias is not served for a block-diffusion model: {_ALTERNATIVE}",
                "logit_bias",
            )
        denoising(params, request.diffusion, self.defaults)  # its settings' own checks
        if not prompt:
            raise ValueError("prompt is empty: at least one token is needed")
        bad = next(
            (t for t in (*prompt, *params.stop_token_ids) if not 0 <= t < self.vocab_size), None
        )
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary (size {self.vocab_size})")
        canvases = self.canvases(request)
        # The KV of the prompt and of every canvas but the last (which is never encoded).
        blocks = -(-(len(prompt) + (canvases - 1) * self.canvas) // self.block_size)
        if blocks > self.num_blocks:
            raise RequestFieldError(
                f"request needs {blocks} KV blocks but the whole cache holds {self.num_blocks}; "
                "lower max_tokens or raise the KV cache size",
                "max_tokens",
            )
        return AdmissionIntent(self.checked_by, canvases * self.canvas, blocks, blocks)

    def canvases(self, request: GenerationRequest) -> int:
        """How many canvases the request may write: max_tokens rounded up to whole canvases
        (None: as many as the context holds)."""
        prompt, limit, canvas = len(request.prompt_token_ids), self.max_model_len, self.canvas
        room = (limit - prompt) // canvas
        if room < 1:
            raise prompt_past_context(limit, prompt, limit - canvas, f"one canvas of {canvas}")
        max_tokens = request.params.max_tokens
        if max_tokens is None:
            return room
        wanted = -(-max_tokens // canvas)
        if wanted > room:
            how = f", rounded up to {wanted} canvases of {canvas}"
            raise completion_past_context(limit, prompt, max_tokens, wanted * canvas, how)
        return wanted
