"""HTTP errors with the OpenAI and Anthropic error bodies."""

from __future__ import annotations

from fastapi.responses import JSONResponse

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
    acts on), where it has them."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        details: dict[str, object] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.details = details


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
            "message": error.message,
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
                "code": status,
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
            "code": error.status,
        }
    }
