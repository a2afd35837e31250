"""The FastAPI app: the routers of `routes/`, the middleware (request ids, body limit, API key)
and the error bodies of both APIs."""

from __future__ import annotations

import hmac
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inflight.server.batches import BatchStore
from inflight.server.chat import ChatSetup
from inflight.server.client import EngineClient
from inflight.server.conversations import ConversationStore
from inflight.server.errors import ServerError, error_response, invalid_request
from inflight.server.files import UPLOAD_MAX_BYTES
from inflight.server.responses import ResponseStore
from inflight.server.routes import (
    anthropic,
    audio,
    batches,
    conversations,
    lora,
    openai,
    ops,
    pins,
    responses,
    tokenize,
)
from inflight.server.state import ServerSettings, ServerState
from inflight.server.threads import ThreadStore
from inflight.server.warmup import WarmUp

log = logging.getLogger("inflight.server")

__all__ = ["ServerSettings", "build_app"]


def build_app(client: EngineClient, settings: ServerSettings) -> FastAPI:
    """The app serving `client`; ValueError for parser settings this model cannot serve."""
    chat = ChatSetup.create(
        client.llm.tokenizer.chat_template,
        settings.chat_template,
        settings.tool_call_parser,
        settings.reasoning_parser,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.close()  # 503 to newcomers, wait for every lease, then drain the engine

    app = FastAPI(title="inflight", lifespan=lifespan)
    warm_up = WarmUp(settings.warmup_prompts)
    app.state.inflight = ServerState(client, settings, chat, warm_up)
    app.state.responses = ResponseStore()
    app.state.threads = ThreadStore()
    app.state.conversations = ConversationStore()
    app.state.files = client.files
    app.state.batches = BatchStore(app, client, app.state.files, settings.api_key)
    app.add_middleware(_BodyLimit, limit=settings.max_body_bytes)
    if settings.api_key:
        app.add_middleware(_ApiKey, key=settings.api_key)
    app.add_middleware(_RequestId)  # the outermost: refusals by the others carry it too
    app.add_exception_handler(ServerError, _on_server_error)
    app.add_exception_handler(RequestValidationError, _on_invalid)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_crash)
    for routes in (
        openai,
        responses,
        conversations,
        anthropic,
        batches,
        tokenize,
        audio,
        lora,
        pins,
        ops,
    ):
        app.include_router(routes.router)
    warm_up.start(client.llm)
    return app


def _is_anthropic(request: Request) -> bool:
    return _anthropic_scope(request.scope)


def _anthropic_scope(scope: Scope) -> bool:
    """Whether an error is answered in Anthropic's body: on its API's routes, and to any
    request of its SDKs (which send `anthropic-version` with every call, to `/v1/models` and
    `/v1/files` too, where the OpenAI SDKs never do)."""
    headers = dict(scope.get("headers") or [])
    return scope["path"].startswith("/v1/messages") or b"anthropic-version" in headers


async def _on_server_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ServerError)
    return error_response(exc, _is_anthropic(request))


async def _on_invalid(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return error_response(invalid_request(exc.errors(), exc.body), _is_anthropic(request))


async def _on_http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (no such route, a method the route lacks) in the API's body,
    naming what was asked: a client (`/v1/embeddings`, say) learns that this server has no
    such endpoint rather than reading a bare 404."""
    assert isinstance(exc, HTTPException)
    asked = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        message = f"no endpoint {asked} on this server"
    elif exc.status_code == 405:
        allowed = exc.headers.get("allow", "") if exc.headers else ""
        message = f"{asked}: method not allowed" + (f" (allowed: {allowed})" if allowed else "")
    else:
        message = f"{asked}: {exc.detail}"
    response = error_response(ServerError(exc.status_code, message), _is_anthropic(request))
    for name, value in (exc.headers or {}).items():
        response.headers[name] = value
    return response


async def _on_crash(request: Request, exc: Exception) -> Response:
    request_id = getattr(request.state, "request_id", "-")
    log.exception("unhandled error on %s (%s)", request.url.path, request_id, exc_info=exc)
    return error_response(ServerError(500, "internal server error"), _is_anthropic(request))


class _RequestId:
    """Every HTTP response names its request in `x-request-id` (OpenAI's header, and vLLM's), and
    in `request-id` where the error body would be Anthropic's (its SDKs read that one): the
    client's own `X-Request-Id` where it sent a usable one, as vLLM echoes it, else a new id.
    The SDKs expose it (`_request_id`, `request_id`); an unhandled error's log line names it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"")
        usable = 0 < len(given) <= 128 and all(0x21 <= c <= 0x7E for c in given)
        request_id = given if usable else f"req_{uuid.uuid4().hex}".encode()
        scope.setdefault("state", {})["request_id"] = request_id.decode()
        added = [(b"x-request-id", request_id)]
        if _anthropic_scope(scope):
            added.append((b"request-id", request_id))

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *added]}
            await send(message)

        await self.app(scope, receive, send_named)


# Open without the API key: the probes of load balancers and orchestrators.
_OPEN_PATHS = frozenset({"/health", "/health/ready"})


class _ApiKey:
    """Every request but the health probes must carry the key, as `Authorization: Bearer` or
    `x-api-key` (/metrics and the API docs included).

    A plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which hides a client's
    disconnect from the endpoint)."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and scope["path"] not in _OPEN_PATHS:
            headers = dict(scope.get("headers") or [])
            offered = headers.get(b"x-api-key", b"")
            bearer = headers.get(b"authorization", b"")
            if not offered and bearer[:7].lower() == b"bearer ":
                offered = bearer[7:]
            if not hmac.compare_digest(offered, self.key):
                if scope["type"] == "websocket":  # refused before the handshake: a 403
                    await send({"type": "websocket.close", "code": 1008})
                    return
                error = ServerError(401, "invalid or missing API key")
                response = error_response(error, _anthropic_scope(scope))
                await response(scope, _no_receive, send)
                return
        await self.app(scope, receive, send)


class _BodyLimit:
    """Refuse request bodies over `limit` bytes with 413, declared or streamed; a file upload
    (`POST /v1/files`) may be as large as a batch's input file may be (`UPLOAD_MAX_BYTES`)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit
        if scope["method"] == "POST" and scope["path"] == "/v1/files":
            limit = max(limit, UPLOAD_MAX_BYTES)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(scope, send, limit)
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, counting_receive, send)
        except _TooLarge:
            await self._refuse(scope, send, limit)

    async def _refuse(self, scope: Scope, send: Send, limit: int) -> None:
        error = ServerError(413, f"request body is larger than {limit} bytes")
        response = error_response(error, _anthropic_scope(scope))
        await response(scope, _no_receive, send)


class _TooLarge(Exception):
    pass


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}
