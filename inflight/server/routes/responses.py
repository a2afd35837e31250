"""OpenAI Responses API routes: create, retrieve (a streamed background response's events
replayed too), cancel and delete responses; list a response's input items; compact a
conversation; count a request's input tokens."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from inflight.protocol.request import GenerationRequest
from inflight.server import compaction, responses
from inflight.server.conversations import Conversation, ConversationStore
from inflight.server.errors import ServerError, invalid_request, openai_error_payload
from inflight.server.protocol import ignored_fields
from inflight.server.responses import ResponseStore
from inflight.server.responses_protocol import (
    CompactRequest,
    InputTokensRequest,
    ResponsesRequest,
    conversation_id,
    refusal,
)
from inflight.server.routes import READ, app_store
from inflight.server.routes.conversations import Conversations, Page
from inflight.server.routes.openai import SSE_HEADERS, ignored_headers, started
from inflight.server.state import ServerState, State, check_body

router = APIRouter()


Store = Annotated[ResponseStore, Depends(app_store("responses"))]


def _held(
    body: ResponsesRequest | InputTokensRequest, conversations: ConversationStore
) -> Conversation | None:
    """The conversation the request names, if any (a 404 naming `conversation` if none)."""
    if body.conversation is None:
        return None
    return conversations.get(conversation_id(body.conversation), "conversation")


async def _reply(
    body: ResponsesRequest,
    state: ServerState,
    store: ResponseStore,
    conversations: ConversationStore,
) -> tuple[responses.ResponseReply, GenerationRequest, dict[str, str]]:
    """A request's reply, its prepared generation and the headers naming what it ignored (a
    ServerError for what cannot be served)."""
    lora_name = check_body(state, body, body.model)
    refused = refusal(body)
    if refused is not None:
        raise refused
    client, chat = state.client, state.chat
    held = _held(body, conversations)
    turn = responses.chat_turn(body, chat, store, held)
    params = chat.reply_params(
        responses.sampling_params(body, client.llm.get_default_sampling_params(), turn)
    )
    prepared = await responses.prepare(
        client,
        turn.messages,
        params,
        truncate=body.truncation == "auto" or turn.compacts,  # a summary is of what fits
        params_of=turn.params_of,
        **chat.template_args(
            turn.messages, turn.choice, body.chat_template_kwargs, turn.template_kwargs
        ),
        lora_name=lora_name,
        priority=body.priority,
    )
    reply = responses.ResponseReply(
        body,
        lora_name or state.settings.served_model_name,
        params,
        turn,
        chat.reader(turn.choice, client.llm.tokenizer, prepared.prompt_token_ids),
        client.llm.tokenizer,
        store,
        held,
    )
    # Here `store` keeps the response and `metadata` is kept and echoed with it: both served.
    served = ("store", "metadata")
    ignored = [f for f in ignored_fields(body) if f not in served]
    return reply, prepared, ignored_headers(ignored + turn.ignored)


@router.post("/v1/responses")
async def create_response(
    body: ResponsesRequest,
    request: Request,
    state: State,
    store: Store,
    conversations: Conversations,
) -> Response:
    client = state.client
    reply, prepared, headers = await _reply(body, state, store, conversations)
    if body.background:
        # Started here, so that a full server is a 429 now rather than a failed job later.
        job = responses.BackgroundJob(await started(client.run(prepared)))
        if body.stream:
            job.events = responses.EventLog()
        queued = reply.queued(job)
        store.jobs[reply.id] = job
        job.task = asyncio.create_task(_background(reply, job, store))
        if job.events is not None:
            # The stream follows the job's log: a client that drops it stops nothing.
            return _event_stream(job.events, None, headers)
        return JSONResponse(queued, headers=headers)
    if body.stream:
        run = await started(client.run(prepared))
        return StreamingResponse(
            reply.stream(run), media_type="text/event-stream", headers={**SSE_HEADERS, **headers}
        )
    output = await client.generate(prepared, request.is_disconnected)
    return JSONResponse(reply.whole(output), headers=headers)


async def _background(
    reply: responses.ResponseReply, job: responses.BackgroundJob, store: ResponseStore
) -> None:
    try:
        await reply.background(job)
    finally:
        store.jobs.pop(reply.id, None)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, store: Store) -> dict[str, Any]:
    """Stop a background response (one that already ended is returned as it is)."""
    stored = store.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    if not stored.body.get("background"):
        raise ServerError(400, "only background responses can be cancelled", "response_id")
    job = store.jobs.get(response_id)
    if job is not None:
        await job.cancel()
    stored = store.get(response_id)
    assert stored is not None
    return stored.body


@router.websocket("/v1/responses")
async def responses_socket(socket: WebSocket) -> None:
    """The Responses API over one WebSocket (OpenAI's WebSocket mode, which the Codex CLI tries
    first on the OpenAI provider and the SDKs open with `responses.connect()`): each
    `response.create` frame, a create request's fields, is answered with the response's stream
    events as JSON frames, one response after another in the order asked (events echo the
    frame's `stream_id`); `generate: false` prepares a continuation without generating;
    `response.processed` acknowledgements are read and dropped; a bad frame is answered with
    an `error` frame (`status`, `error`) and the connection stays. Responses made on the
    connection are continued by `previous_response_id` on it whatever their `store`."""
    await socket.accept()
    app = socket.app.state
    store = responses.SocketStore(app.responses)
    while True:
        try:
            frame = await socket.receive_json()
        except WebSocketDisconnect:
            return
        except ValueError:
            await socket.send_json(_socket_error(ServerError(400, "frames are JSON objects")))
            continue
        lane = frame.get("stream_id") if isinstance(frame, dict) else None
        echo = {} if lane is None else {"stream_id": lane}
        reply = _socket_reply(frame, app.inflight, store, app.conversations)
        try:
            async with aclosing(reply) as events:
                async for event in events:
                    await socket.send_json({**event, **echo})
        except ServerError as exc:
            await socket.send_json({**_socket_error(exc), **echo})
        except WebSocketDisconnect:
            return  # the stream closed above: its run is cancelled


async def _socket_reply(
    frame: Any, state: ServerState, store: ResponseStore, conversations: ConversationStore
) -> AsyncIterator[dict[str, Any]]:
    """The events answering one client frame."""
    kind = frame.get("type") if isinstance(frame, dict) else None
    if kind == "response.processed":
        return
    if kind != "response.create":
        raise ServerError(
            400,
            f"frames of type {kind!r} are not served here: send response.create "
            "(response.processed is read and dropped)",
            "type",
        )
    fields = {k: v for k, v in frame.items() if k not in _SOCKET_ONLY}
    try:
        body = ResponsesRequest.model_validate(fields)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
        raise invalid_request(errors, fields) from exc
    if body.background:
        raise ServerError(
            400, "background responses are not served over a WebSocket: POST them", "background"
        )
    reply, prepared, _ = await _reply(body, state, store, conversations)
    if frame.get("generate") is False:
        for event in reply.unanswered(len(prepared.prompt_token_ids)):
            yield event
        return
    run = await started(state.client.run(prepared))
    async with aclosing(reply.events(run)) as events:
        async for event in events:
            yield event


# A response.create frame's fields that are the socket's, not a create request's: the frame's
# type, its lane, whether to generate; `stream`, which a socket always does.
_SOCKET_ONLY = ("type", "stream_id", "generate", "stream")


def _socket_error(exc: ServerError) -> dict[str, Any]:
    error = {**openai_error_payload(exc)["error"], "code": None}
    return {"type": "error", "status": exc.status, "error": error}


@router.post("/v1/responses/compact")
async def compact_response(
    body: CompactRequest,
    request: Request,
    state: State,
    store: Store,
    conversations: Conversations,
) -> Response:
    """The conversation compacted: its user messages, then a compaction item holding the
    model's summary of it, as a response to the same input ended with a compaction trigger
    gives it (`compaction.py`)."""
    reply, prepared, _ = await _reply(body.as_response(), state, store, conversations)
    output = await state.client.generate(prepared, request.is_disconnected)
    response = reply.whole(output)
    users = [i for i in reply.input_items if i["type"] == "message" and i["role"] == "user"]
    # What Codex sends for the model's next turn has no part in a summary.
    unread = [f for f in ("tools", "parallel_tool_calls", "text") if f in body.model_fields_set]
    headers = ignored_headers(unread + ignored_fields(body))
    compacted = compaction.compacted(users, response["output"][0], response["usage"])
    return JSONResponse(compacted, headers=headers)


@router.post("/v1/responses/input_tokens")
async def count_input_tokens(
    body: InputTokensRequest, state: State, store: Store, conversations: Conversations
) -> dict[str, Any]:
    """The tokens of the prompt a response to these fields would run (a previous response's
    conversation, instructions and tools included)."""
    check_body(state, body, body.model)
    request = body.as_response()
    refused = refusal(request)
    if refused is not None:
        raise refused
    chat = state.chat
    turn = responses.chat_turn(request, chat, store, _held(body, conversations))
    template = chat.template_args(
        turn.messages, turn.choice, request.chat_template_kwargs, turn.template_kwargs
    )
    tokens = await state.client.prompt_tokens(turn.messages, **template)
    return {"object": "response.input_tokens", "input_tokens": len(tokens)}


@router.api_route("/v1/responses/{response_id}", methods=READ)
async def retrieve_response(
    response_id: str,
    store: Store,
    stream: bool = False,
    starting_after: Annotated[int | None, Query(ge=-1)] = None,
) -> Response:
    """The stored response; with `stream`, a streamed background response's events after
    `starting_after` (all without it), then the rest as they are written."""
    stored = store.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    if not stream:
        if starting_after is not None:
            raise ServerError(400, "starting_after is read with stream=true only", "starting_after")
        return JSONResponse(stored.body)
    if stored.events is None:
        raise ServerError(
            400,
            "only a response created with background: true and stream: true can be streamed "
            "again (its events are kept); this one is read whole",
            "stream",
        )
    return _event_stream(stored.events, starting_after)


def _event_stream(
    log: responses.EventLog, starting_after: int | None, headers: dict[str, str] | None = None
) -> StreamingResponse:
    return StreamingResponse(
        log.follow(starting_after),
        media_type="text/event-stream",
        headers={**SSE_HEADERS, **(headers or {})},
    )


@router.api_route("/v1/responses/{response_id}/input_items", methods=READ)
async def list_input_items(response_id: str, store: Store, page: Page) -> dict[str, Any]:
    """The input items of a stored response (those its previous response or conversation
    gave included), paged as conversation items are."""
    stored = store.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return page.page(stored.input_items)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, store: Store) -> dict[str, Any]:
    job = store.jobs.get(response_id)
    if job is not None:  # a background response still running stops first
        await job.cancel()
    if not store.delete(response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def _not_found(response_id: str) -> ServerError:
    return ServerError(
        404,
        f"no stored response with id {response_id!r} (unknown, deleted, sent with store: false, "
        "or evicted from the server's store)",
    )
