"""The request options of the support matrix, and where each is served or refused: one table.

Each option is a `GenerationRequest` field that asks for more than plain generation. Whether this
runtime serves it at all is decided when a request is checked (`Runtime.check_request`, before
anything is queued, so it is a ValueError on either path); whether in-flight batching serves it
is decided by the engine at `submit()` (a permanent refusal naming the alternative).
Structured outputs are a sampling parameter, applied per row: not an option here. torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from inflight.protocol.request import GenerationRequest, RequestFieldError

_BLOCKING_PATH = "use the blocking path (start without --enable-in-flight-batching)"


class UnderIFB(Enum):
    SERVED = "served"  # may share a batch
    REFUSED = "refused at submit"  # a permanent refusal naming the alternative


@dataclass(frozen=True)
class RequestOption:
    field: str  # the GenerationRequest field
    what: str  # how refusals name it
    default: Any  # the value that does not ask for it
    under_ifb: UnderIFB
    ifb_alternative: str = ""  # REFUSED: what the caller can do instead
    # None where this runtime serves the option; else what the caller can do instead.
    runtime_alternative: str | None = None


REQUEST_OPTIONS: tuple[RequestOption, ...] = (
    RequestOption(
        "lora_name",
        "per-request LoRA (lora_name)",
        None,
        UnderIFB.SERVED,
        runtime_alternative="start with enable_lora=True (--enable-lora) and register the "
        "adapter (lora_modules, --lora-modules)",
    ),
    RequestOption(
        "generate_audio",
        "speech output (generate_audio)",
        False,
        UnderIFB.REFUSED,
        ifb_alternative=_BLOCKING_PATH,
        runtime_alternative="this deployment has no speech model",
    ),
    RequestOption(
        "save_system_prompt_kv_cache",
        "system-prompt KV capture (save_system_prompt_kv_cache)",
        False,
        UnderIFB.REFUSED,
        ifb_alternative="the context cache covers shared prefixes; or " + _BLOCKING_PATH,
        runtime_alternative="the context cache covers shared prefixes",
    ),
    RequestOption(
        "past_trajectory",
        "trajectory execution (past_trajectory)",
        None,
        UnderIFB.REFUSED,
        ifb_alternative=_BLOCKING_PATH,
        runtime_alternative="send the trajectory's turns as a chat conversation",
    ),
)

OPTION_FIELDS = frozenset(o.field for o in REQUEST_OPTIONS)


def requested(request: GenerationRequest) -> list[RequestOption]:
    """The options this request asks for, in table order."""
    return [o for o in REQUEST_OPTIONS if getattr(request, o.field) != o.default]


def check_runtime_serves(request: GenerationRequest, served: frozenset[str]) -> None:
    """Raise RequestFieldError for the first option the runtime does not serve: `served` names
    the options of the table it was built to serve (LoRA, when enabled)."""
    option = next(
        (
            o
            for o in requested(request)
            if o.runtime_alternative is not None and o.field not in served
        ),
        None,
    )
    if option is not None:
        raise RequestFieldError(
            f"{option.what} is not supported by this runtime yet; {option.runtime_alternative}",
            option.field,
        )


def submit_refusal(request: GenerationRequest) -> str | None:
    """Why in-flight batching refuses the request at submit(), or None."""
    option = next((o for o in requested(request) if o.under_ifb is UnderIFB.REFUSED), None)
    if option is None:
        return None
    return f"{option.what} is not served under in-flight batching; {option.ifb_alternative}"
