"""The request options of the support matrix, and what a runtime that does not serve one tells
the caller: one table (torch-free).

Each option is a `GenerationRequest` field that asks for more than plain generation. A runtime
serves an option or not, the same on both paths (in-flight batching and the blocking path): it
refuses one it does not serve when the request is checked (`Runtime.check`: `LLM.prepare`, or
`submit()` for a request built by hand), a permanent refusal naming what the caller can do
instead. Structured outputs are a sampling parameter, applied per row: not an option here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inflight.protocol.request import GenerationRequest, RequestFieldError


@dataclass(frozen=True)
class RequestOption:
    field: str  # the GenerationRequest field
    what: str  # how refusals name it
    default: Any  # the value that does not ask for it
    alternative: str  # where a runtime does not serve it: what the caller can do instead


REQUEST_OPTIONS: tuple[RequestOption, ...] = (
    RequestOption(
        "lora_name",
        "per-request LoRA (lora_name)",
        None,
        "start with enable_lora=True (--enable-lora) and register the adapter (lora_modules, "
        "--lora-modules)",
    ),
    RequestOption(
        "generate_audio",
        "speech output (generate_audio)",
        None,
        "it needs a model that speaks its replies (Qwen3-Omni) served with its talker (not "
        "--no-speech); ask for text",
    ),
    RequestOption(
        "speech",
        "text to speech (speech)",
        None,
        "it needs a text-to-speech model (Qwen3-TTS); this one writes text",
    ),
    RequestOption(
        "diffusion",
        "block diffusion settings (diffusion)",
        None,
        "they steer a block-diffusion model (DiffusionGemma); this one writes a token at a time",
    ),
    RequestOption(
        "save_system_prompt_kv_cache",
        "system-prompt KV capture (save_system_prompt_kv_cache)",
        False,
        "it pins the prompt's KV in the context cache: serve with the context cache on "
        "(enable_context_reuse, the default) a model whose KV prefixes are reusable (not a "
        "hybrid Mamba model)",
    ),
    RequestOption(
        "past_trajectory",
        "trajectory execution (past_trajectory)",
        None,
        "send the trajectory's turns as a chat conversation",
    ),
)

OPTION_FIELDS = frozenset(o.field for o in REQUEST_OPTIONS)


def requested(request: GenerationRequest) -> list[RequestOption]:
    """The options this request asks for, in table order."""
    return [o for o in REQUEST_OPTIONS if getattr(request, o.field) != o.default]


def check_runtime_serves(request: GenerationRequest, served: frozenset[str]) -> None:
    """Raise RequestFieldError for the first option the request asks for that the runtime does
    not serve: `served` names the options of the table it serves (LoRA, when enabled)."""
    option = next((o for o in requested(request) if o.field not in served), None)
    if option is not None:
        raise RequestFieldError(
            f"{option.what} is not served by this deployment: {option.alternative}", option.field
        )
