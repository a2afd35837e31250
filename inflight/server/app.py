"""The FastAPI app: OpenAI- and Anthropic-compatible endpoints, health and metrics."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inflight.runtime.request import SamplingParams
from inflight.runtime.stepped import CompletionOutput
from inflight.server import anthropic, openai
from inflight.server.client import EngineClient, Run
from inflight.server.errors import ServerError, error_response, openai_error_payload
from inflight.server.protocol import (
    AnthropicCountTokensRequest,
    AnthropicMessagesRequest,
    ChatCompletionRequest,
    CompletionRequest,
    unsupported,
)

log = logging.getLogger("inflight.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "Connection": "keep-alive"}


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024


def build_app(client: EngineClient, settings: ServerSettings) -> FastAPI:
    llm = client.llm

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.close()  # 503 to newcomers, wait for every lease, then drain the engine

    app = FastAPI(title="inflight", lifespan=lifespan)
    app.add_middleware(_BodyLimit, limit=settings.max_body_bytes)
    if settings.api_key:
        app.add_middleware(_ApiKey, key=settings.api_key)

    def is_anthropic(request: Request) -> bool:
        return request.url.path.startswith("/v1/messages")

    @app.exception_handler(ServerError)
    async def on_server_error(request: Request, exc: ServerError) -> Response:
        return error_response(exc, is_anthropic(request))

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = first.get("msg", "invalid request")
        if first.get("type") == "extra_forbidden":
            message = f"unknown field {loc[-1]!r}" if loc else "unknown field"
        param = ".".join(loc) or None
        text = f"{param}: {message}" if param else message
        return error_response(ServerError(400, text, param), is_anthropic(request))

    @app.exception_handler(Exception)
    async def on_crash(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(ServerError(500, "internal server error"), is_anthropic(request))

    def check(body: BaseModel, model: str | None) -> None:
        if model is not None and model != settings.served_model_name:
            raise ServerError(
                404,
                f"model {model!r} is not served here; use {settings.served_model_name!r}",
                "model",
            )
        refusal = unsupported(body)
        if refusal is not None:
            raise ServerError(400, refusal[1], refusal[0])

    # -- OpenAI -------------------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check(body, body.model)
        if (
            body.max_tokens
            and body.max_completion_tokens
            and (body.max_tokens != body.max_completion_tokens)
        ):
            raise ServerError(
                400, "max_tokens and max_completion_tokens differ; send one", "max_tokens"
            )
        params = openai.sampling_params(
            body,
            llm.get_default_sampling_params(),
            max_tokens=body.max_completion_tokens or body.max_tokens,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            skip_special_tokens=body.skip_special_tokens,
        )
        prepared = client.prepare(openai.chat_messages(body.messages), params)
        reply = openai.ChatReply(settings.served_model_name, body.logprobs)
        if body.stream:
            run = await _started(client.run(prepared))
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(
                _openai_events(reply.stream(run, usage)),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        output = await client.generate(prepared, request.is_disconnected)
        return JSONResponse(reply.whole(output))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check(body, body.model)
        prompts = openai.completion_prompts(body.prompt)
        if body.max_tokens == 0 and not body.echo:
            raise ServerError(400, "max_tokens=0 only makes sense with echo", "max_tokens")
        params = openai.sampling_params(
            body,
            llm.get_default_sampling_params(),
            max_tokens=body.max_tokens,
            logprobs=body.logprobs,
            prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None else None,
        )
        if body.echo and body.max_tokens == 0 and params.prompt_logprobs is None:
            params = SamplingParams(**{**vars(params), "prompt_logprobs": 0})
        prepared = [client.prepare(p, params) for p in prompts]
        reply = openai.CompletionReply(settings.served_model_name, llm.tokenizer, body)
        if body.stream:
            runs = []
            try:
                for p in prepared:
                    runs.append(await _started(client.run(p)))
            except ServerError:
                for run in runs:
                    await run.aclose()
                raise
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(
                _openai_events(reply.stream(prepared, runs, usage)),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        outputs = await _gather([client.generate(p, request.is_disconnected) for p in prepared])
        return JSONResponse(reply.whole(prepared, outputs))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": settings.served_model_name,
                    "object": "model",
                    "created": _STARTED,
                    "owned_by": "inflight",
                    "max_model_len": llm.max_model_len,
                }
            ],
        }

    # -- Anthropic ----------------------------------------------------------------------------

    @app.post("/v1/messages")
    async def messages(body: AnthropicMessagesRequest, request: Request) -> Response:
        check(body, body.model)
        messages_ = anthropic.chat_messages(body.system, body.messages)
        params = anthropic.sampling_params(body, llm.get_default_sampling_params())
        prepared = client.prepare(messages_, params)
        reply = anthropic.MessageReply(settings.served_model_name)
        if body.stream:
            run = await _started(client.run(prepared))
            return StreamingResponse(
                reply.stream(run, len(prepared.prompt_token_ids)),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        output = await client.generate(prepared, request.is_disconnected)
        return JSONResponse(reply.whole(output))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: AnthropicCountTokensRequest) -> dict[str, int]:
        check(body, body.model)
        return {
            "input_tokens": client.count_tokens(anthropic.chat_messages(body.system, body.messages))
        }

    # -- operations ---------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> dict[str, Any]:
        scheduling = llm.get_scheduling_metrics()
        return {
            "status": "healthy",
            "model": settings.served_model_name,
            "active_requests": client.gate.active,
            "queued_requests": scheduling["queued"] if scheduling else client.gate.waiting,
            "scheduling": scheduling,
            "context_cache": llm.get_context_cache_metrics(),
            "capabilities": {
                "chat": True,
                "completions": True,
                "input_modalities": ["text"],
                "output_modalities": ["text"],
                "in_flight_batching": llm.in_flight_batching,
                "max_num_seqs": llm.max_batch_size if llm.in_flight_batching else 1,
                "max_model_len": llm.max_model_len,
                "context_reuse": llm.get_context_cache_metrics() is not None,
            },
        }

    @app.get("/health/ready")
    async def ready() -> Response:
        if client.gate.closing:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        return JSONResponse(
            {
                "status": "ready",
                "active_requests": client.gate.active,
                "queued_requests": client.gate.waiting,
            }
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(client.metrics.render(), media_type="text/plain; version=0.0.4")

    return app


_STARTED = int(time.time())


async def _started(run: Run) -> Run:
    await run.start()
    return run


async def _gather(calls: list[Awaitable[CompletionOutput]]) -> list[CompletionOutput]:
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _openai_events(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Server-sent events: one `data:` line per chunk, errors in-band, then `[DONE]`."""
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    except ServerError as exc:
        yield f"data: {json.dumps(openai_error_payload(exc))}\n\n"
    yield "data: [DONE]\n\n"


class _ApiKey:
    """Every /v1/ request must carry the key, as `Authorization: Bearer` or `x-api-key`.

    A plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which hides a client's
    disconnect from the endpoint)."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            headers = dict(scope.get("headers") or [])
            offered = headers.get(b"x-api-key", b"")
            bearer = headers.get(b"authorization", b"")
            if not offered and bearer[:7].lower() == b"bearer ":
                offered = bearer[7:]
            if not hmac.compare_digest(offered, self.key):
                error = ServerError(401, "invalid or missing API key")
                response = error_response(error, scope["path"].startswith("/v1/messages"))
                await response(scope, _no_receive, send)
                return
        await self.app(scope, receive, send)


class _BodyLimit:
    """Refuse request bodies over `limit` bytes with 413, declared or streamed."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, send)
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, counting_receive, send)
        except _TooLarge:
            await self._refuse(scope, send)

    async def _refuse(self, scope: Scope, send: Send) -> None:
        error = ServerError(413, f"request body is larger than {self.limit} bytes")
        response = error_response(error, scope["path"].startswith("/v1/messages"))
        await response(scope, _no_receive, send)


class _TooLarge(Exception):
    pass


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}
