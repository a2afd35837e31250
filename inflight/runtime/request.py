"""What a caller asks the runtime for: sampling parameters and a tokenized prompt (torch-free)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20


class PromptTooLongError(ValueError):
    """The prompt does not fit the deployment's context (HTTP 413)."""


MAX_LOGIT_BIAS_ENTRIES = 1024


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each output token and when to stop; every field applies per request (per row).

    `max_tokens=None` generates until EOS, a stop, or the context capacity. `temperature=0` is
    greedy. `top_k` of 0 or -1 and `top_p=1` turn those filters off. `logprobs=N` returns the
    chosen token's log-probability and the N most likely alternatives at each step (0: the chosen
    one only); `prompt_logprobs=N` does the same for every prompt token after the first, and with
    it `max_tokens=0` scores the prompt without generating. Log-probabilities are those of the
    model's raw distribution.
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
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

    def __post_init__(self) -> None:
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
        least = 0 if self.prompt_logprobs is not None else 1
        if self.max_tokens is not None and (
            not _is_int(self.max_tokens) or self.max_tokens < least
        ):
            raise ValueError(
                f"max_tokens must be an integer >= 1 (0 only to score a prompt, with "
                f"prompt_logprobs), got {self.max_tokens!r}"
            )
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1: off), got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], "
                f"got {self.prompt_logprobs!r}"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {list(self.stop)!r}")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
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


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt, already tokenized, and how to continue it.

    The fields after `params` are request options of the design's support matrix; where each is
    served or refused, and with which message, is the table in `options.py`.
    """

    prompt_token_ids: Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    n: int = 1  # sequences to generate for the prompt
    lora_name: str | None = None  # a per-request LoRA adapter
    guided_decoding: Mapping[str, Any] | None = None  # a JSON schema / regex / grammar constraint
    generate_audio: bool = False  # speech output
    save_system_prompt_kv_cache: bool = False  # the legacy system-prompt KV capture
    past_trajectory: Sequence[Any] | None = None  # trajectory execution

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
