"""Anthropic-compatible routes: messages (in message threads or not) and token counting."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from inflight.server import anthropic
from inflight.server.protocol import (
    AnthropicCountTokensRequest,
    AnthropicMessagesRequest,
    ignored_fields,
)
from inflight.server.routes import app_store
from inflight.server.routes.openai import SSE_HEADERS, ignored_headers, started
from inflight.server.state import State, check_body
from inflight.server.threads import ThreadStore, ThreadTurn
from inflight.server.tools import ToolChoice

router = APIRouter()


Threads = Annotated[ThreadStore, Depends(app_store("threads"))]


@router.post("/v1/messages")
async def messages(
    body: AnthropicMessagesRequest, request: Request, state: State, threads: Threads
) -> Response:
    lora_name = check_body(state, body, body.model)
    turn = threads.begin(body)
    if turn is None:
        return await _reply(body, lora_name, request, state, None)
    try:
        return await _reply(turn.request(body), lora_name, request, state, turn)
    except BaseException:
        turn.release()
        raise


async def _reply(
    body: AnthropicMessagesRequest,
    lora_name: str | None,
    request: Request,
    state: State,
    turn: ThreadTurn | None,
) -> Response:
    client, chat = state.client, state.chat
    choice = anthropic.messages_tool_choice(body, chat)
    thinking, ignored = anthropic.thinking_switch(body, chat)
    # The thread (if any) keeps the conversation as sent; the model reads it edited.
    count = anthropic.prompt_counter(body, client, chat, choice, thinking)
    edited = await anthropic.edited_messages(body, count)
    messages = body.messages if edited is None else edited.messages
    conversation = anthropic.chat_messages(body.system, messages)
    constraint, overridden = chat.constraint(
        choice,
        anthropic.structured_outputs(body),
        "output_format" if body.output_format is not None else "output_config.format",
    )
    params = anthropic.sampling_params(body, client.llm.get_default_sampling_params(), constraint)
    params = chat.reply_params(params)
    forced = choice is not None and choice.forced
    prepared = await client.prepare_chat(
        conversation,
        params,
        params_of={"structured_outputs": "tools" if forced else "output_config"},
        **anthropic.template_args(chat, conversation, choice, thinking),
        lora_name=lora_name,
        save_system_prompt_kv_cache=body.save_system_prompt_kv_cache,
    )
    # `context_management` is applied (the shared list names the Responses API's, ignored).
    unread = [f for f in ignored_fields(body) if f != "context_management"]
    unread += anthropic.unread_citations(body.messages)
    unread += anthropic.hosted_tools(body)
    if edited is not None:
        unread += edited.ignored
    headers = ignored_headers(unread + ignored + overridden)
    reader = chat.reader(choice, client.llm.tokenizer, prepared.prompt_token_ids)
    reply = anthropic.MessageReply(
        lora_name or state.settings.served_model_name,
        reader,
        None if edited is None else {"applied_edits": edited.applied_edits},
    )
    if body.stream:
        run = await started(client.run(prepared))
        events = reply.stream(run, len(prepared.prompt_token_ids))
        return StreamingResponse(
            events if turn is None else _threaded(events, reply, turn),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, **headers},
        )
    output = await client.generate(prepared, request.is_disconnected)
    message = reply.whole(output)
    if turn is not None:
        turn.keep(reply.id, message["content"])
    return JSONResponse(message, headers=headers)


async def _threaded(
    events: AsyncIterator[str], reply: anthropic.MessageReply, turn: ThreadTurn
) -> AsyncIterator[str]:
    """A threaded reply's events: the conversation is kept once the stream is whole, and the
    turn released if it never is (an error event, a client gone)."""
    try:
        async for event in events:
            yield event
        if reply.streamed is not None:
            turn.keep(reply.id, reply.streamed)
    finally:
        turn.release()


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: AnthropicCountTokensRequest, state: State) -> dict[str, Any]:
    check_body(state, body, body.model)
    # Counting renders the tools whatever the choice would be.
    tools = anthropic.offered_tools(body)
    thinking, _ = anthropic.thinking_switch(body, state.chat)
    choice = ToolChoice(tools, "none") if tools else None
    count = anthropic.prompt_counter(body, state.client, state.chat, choice, thinking)
    edited = await anthropic.edited_messages(body, count)
    if edited is None:
        return {"input_tokens": await count(body.messages)}
    # The count after the edits, and that of the conversation as sent (the same where no edit
    # had it counted: none changed it).
    tokens = await count(edited.messages) if edited.input_tokens is None else edited.input_tokens
    original = tokens if edited.original_input_tokens is None else edited.original_input_tokens
    return {"input_tokens": tokens, "context_management": {"original_input_tokens": original}}
