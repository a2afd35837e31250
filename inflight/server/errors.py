"""HTTP errors with the OpenAI and Anthropic error bodies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi.responses import JSONResponse

from inflight.protocol.request import ContextOverflowError, PromptTooLongError

# OpenAI error type per status; the Anthropic API has its own names (and 529 for overload).
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "server_overloaded",
    500: "internal_server_error",
    503: "server_unavailable",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


class ServerError(Exception):
    """`details`: the Anthropic error's machine-readable `details` (an `error_code` a client
    acts on), where it has them. `code`: the OpenAI body's `code` where OpenAI names one that
    clients act on (else the status, as vLLM's); `anthropic_message`: the Anthropic body's
    message where that API words the error otherwise."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        details: dict[str, object] | None = None,
        *,
        code: str | None = None,
        anthropic_message: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.details = details
        self.code = code
        self.anthropic_message = anthropic_message


def context_exceeded(exc: ContextOverflowError, param: str) -> ServerError:
    """A 400 for a prompt whose max_tokens outgrow the context, as each API says it: OpenAI's
    code `context_length_exceeded`, and Anthropic's "input length and `max_tokens` exceed
    context limit: N + M > L", from which Claude Code reads a max_tokens that fits."""
    return ServerError(
        400,
        str(exc),
        param,
        code="context_length_exceeded",
        anthropic_message=(
            f"input length and `max_tokens` exceed context limit: {exc.tokens} + "
            f"{exc.max_tokens} > {exc.limit}, decrease input length or `max_tokens` and try again"
        ),
    )


def prompt_too_long(exc: PromptTooLongError, param: str | None = None) -> ServerError:
    """A 400 for a prompt past the context, as each API says it: OpenAI's code
    `context_length_exceeded` and Anthropic's "prompt is too long: N tokens > M maximum", which
    clients match to compact or trim a conversation (LangChain's context-overflow errors, the
    OpenAI SDK's BadRequestError, Claude Code)."""
    return ServerError(
        400,
        str(exc),
        param,
        code="context_length_exceeded",
        anthropic_message=f"prompt is too long: {exc.tokens} tokens > {exc.maximum} maximum",
    )


def overloaded(message: str = "server request queue is full; retry later") -> ServerError:
    return ServerError(429, message)


def error_response(error: ServerError, anthropic: bool) -> JSONResponse:
    status, headers = error.status, {}
    if status == 429:
        headers["Retry-After"] = "1"
    if status == 503:  # shutting down, or the engine failed: another replica may serve it
        headers["Retry-After"] = "5"
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if anthropic:
        if status == 429:
            status = 529  # Anthropic's "overloaded"
        detail: dict[str, object] = {
            "type": _ANTHROPIC_TYPES.get(status, "api_error"),
            "message": error.anthropic_message or error.message,
        }
        if error.details:
            detail["details"] = error.details
        body = {"type": "error", "error": detail}
    else:
        body = {
            "error": {
                "message": error.message,
                "type": _OPENAI_TYPES.get(status, "internal_server_error"),
                "param": error.param,
                "code": error.code or status,
            }
        }
    return JSONResponse(body, status_code=status, headers=headers)


def openai_error_payload(error: ServerError) -> dict:
    """The body of an error event sent inside an OpenAI stream."""
    return {
        "error": {
            "message": error.message,
            "type": _OPENAI_TYPES.get(error.status, "internal_server_error"),
            "param": error.param,
            "code": error.code or error.status,
        }
    }


# The names pydantic gives a union's members in an error's location (`stop.constrained-str`,
# `tool_choice.literal['none','auto']`, `guided_json.dict[str,any]`, `tool_choice.NamedToolChoice`):
# the API's param names the request's fields and indices alone, as OpenAI's does.
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "bytes"}


def invalid_request(errors: Sequence[Any], body: Any) -> ServerError:
    """The 400 of a request that failed validation (pydantic's `errors()`), naming the field
    as the request wrote it. A field of several types reports one error per type; the deepest
    is that of the type the value has (a list of input items, not a string), which names the
    part that is wrong."""
    first = max(errors, key=lambda e: len(e.get("loc", ())), default={})
    where = list(first.get("loc", ()))
    if where[:1] == ["body"]:
        loc = _located(where[1:], body)
    else:
        loc = [str(p) for p in where if not _is_union_member(p)]
    message = first.get("msg", "invalid request")
    if first.get("type") == "value_error":
        # A validator's own words, without pydantic's "Value error, " before them.
        message = str(first.get("ctx", {}).get("error", message))
    if first.get("type") == "extra_forbidden":
        message = f"unknown field {loc[-1]!r}" if loc else "unknown field"
    param = ".".join(loc) or None
    return ServerError(400, f"{param}: {message}" if param else message, param)


def _is_union_member(part: object) -> bool:
    return isinstance(part, str) and (
        part in _TYPE_NAMES or part[:1].isupper() or any(c in part for c in "[]-,'")
    )


def _located(loc: list[object], body: object) -> list[str]:
    """The parts of a body error's location that name the request's own fields and indices,
    found by walking the body: the names pydantic gives a union's members and a tagged
    union's tags (`input.0.message.role`) are no keys of the value they stand under. The last
    part, unfound, is kept where it stands under an object (a field missing from it)."""
    out: list[str] = []
    value = body
    for i, part in enumerate(loc):
        keyed = isinstance(value, dict) and part in value
        indexed = isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value)
        if keyed or indexed:
            value = value[part]  # type: ignore[index]
        elif i < len(loc) - 1 or not isinstance(value, dict) or _is_union_member(part):
            continue
        out.append(str(part))
    return out
