"""OpenAI-compatible routes: chat completions, text completions, models."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from inflight.protocol.outputs import RequestOutput
from inflight.protocol.request import SamplingParams
from inflight.server import infill, openai
from inflight.server.client import Run
from inflight.server.errors import ServerError, openai_error_payload
from inflight.server.protocol import ChatCompletionRequest, CompletionRequest, ignored_fields
from inflight.server.routes import READ
from inflight.server.spoken import AUDIO_PARAMS, SpokenReply, chat_audio
from inflight.server.state import State, check_body, not_served

SSE_HEADERS = {"Cache-Control": "no-cache", "Connection": "keep-alive"}
IGNORED_HEADER = "X-Inflight-Ignored-Fields"
log = logging.getLogger(__name__)
_STARTED = int(time.time())
_STARTED_AT = datetime.fromtimestamp(_STARTED, UTC).isoformat().replace("+00:00", "Z")

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: State) -> Response:
    lora_name = check_body(state, body, body.model)
    client, llm = state.client, state.client.llm
    chat = state.chat
    spoken = chat_audio(body, llm.voice_facts)
    choice = openai.chat_tool_choice(body, chat)
    constraint, ignored = chat.constraint(
        choice,
        openai.structured_outputs(body),
        "structured_outputs" if body.structured_outputs is not None else "response_format",
    )
    ignored = ignored_fields(body) + ignored
    if body.max_completion_tokens is not None and body.max_tokens not in (
        None,
        body.max_completion_tokens,
    ):
        # vLLM's reading: the current field wins, the deprecated one is named back.
        ignored.append("max_tokens")
    asked, thinking = openai.thinking_asked(body), None
    if asked is not None:
        thinking = chat.thinking_switch(asked.enabled, asked.effort)
        if thinking is None:
            ignored.append(asked.field)
        if asked.field != "think" and body.think is not None:
            ignored.append("think")  # under reasoning_effort
    if body.top_logprobs and not body.logprobs:
        # As vLLM refuses it (0 alone passes, as there): alternatives come with the chosen
        # tokens' logprobs only.
        raise ServerError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
    params = openai.sampling_params(
        body,
        llm.get_default_sampling_params(),
        max_tokens=body.max_completion_tokens or body.max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        skip_special_tokens=body.skip_special_tokens,
        constraint=constraint,
    )
    params = chat.reply_params(params)
    messages = openai.chat_messages(body.messages, state.transcripts.recall)
    prepared = await client.prepare_chat(
        messages,
        params,
        params_of={**openai.field_params(body, choice), **(AUDIO_PARAMS if spoken else {})},
        **chat.template_args(
            messages,
            choice,
            body.chat_template_kwargs,
            thinking,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
        ),
        mm_processor_kwargs=body.mm_processor_kwargs,
        lora_name=lora_name,
        save_system_prompt_kv_cache=body.save_system_prompt_kv_cache,
        priority=body.priority,
        generate_audio=None if spoken is None else spoken.reply,
        diffusion=openai.diffusion_params(body),
    )
    reader = chat.reader(choice, llm.tokenizer, prepared.prompt_token_ids)
    audio = None
    if spoken is not None:
        assert llm.voice_facts is not None
        audio = SpokenReply(spoken, llm.voice_facts.sample_rate, state.transcripts)
    reply = openai.ChatReply(
        lora_name or state.settings.served_model_name,
        body.logprobs,
        reader,
        chat.reasoning is not None,
        legacy_functions=body.functions is not None,
        named=choice is not None and choice.mode == "named",
        audio=audio,
        voices=None if spoken is None else llm.voice_facts,
        prompt_token_ids=prepared.prompt_token_ids if body.return_token_ids else None,
    )
    headers = ignored_headers(ignored)
    if body.stream:
        run = await started(client.run(prepared))
        return StreamingResponse(
            openai_events(reply.stream(run, body.stream_options)),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, **headers},
        )
    output = await client.generate(prepared, request.is_disconnected)
    return JSONResponse(reply.whole(output), headers=headers)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: State) -> Response:
    lora_name = check_body(state, body, body.model)
    client, llm = state.client, state.client.llm
    prompts = openai.completion_prompts(body.prompt)
    if body.suffix is not None:
        prompts = infill.infill_prompts(prompts, body.suffix, body.echo, llm.tokenizer)
    if body.max_tokens == 0 and not body.echo:
        raise ServerError(400, "max_tokens=0 only makes sense with echo", "max_tokens")
    params = openai.sampling_params(
        body,
        llm.get_default_sampling_params(),
        max_tokens=body.max_tokens,
        logprobs=body.logprobs,
        prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None else None,
        constraint=openai.structured_outputs(body),
    )
    if body.echo and body.max_tokens == 0 and params.prompt_logprobs is None:
        params = SamplingParams(**{**vars(params), "prompt_logprobs": 0})
    params_of = openai.field_params(body)
    options = {
        "lora_name": lora_name,
        "save_system_prompt_kv_cache": body.save_system_prompt_kv_cache,
        "diffusion": openai.diffusion_params(body),
        "priority": body.priority,
    }
    prepared = [client.prepare(p, params, params_of=params_of, **options) for p in prompts]
    # A prompt list is admitted whole or refused whole: too big ever (400) or busy now (429),
    # before any of it runs; then the engine queues its prompts and seats them as room frees.
    client.gate.check(len(prompts) * params.n, "prompt")
    headers = ignored_headers(ignored_fields(body))
    reply = openai.CompletionReply(
        lora_name or state.settings.served_model_name, llm.tokenizer, body
    )
    if body.stream:
        runs = []
        try:
            for p in prepared:
                runs.append(await started(client.run(p)))
        except ServerError:
            for run in runs:
                await run.aclose()
            raise
        return StreamingResponse(
            openai_events(reply.stream(prepared, runs, body.stream_options)),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, **headers},
        )
    outputs = await gather([client.generate(p, request.is_disconnected) for p in prepared])
    return JSONResponse(reply.whole(prepared, outputs), headers=headers)


@router.api_route("/v1/models", methods=READ)
async def models(state: State) -> dict[str, Any]:
    """The base model, and each LoRA adapter with the base as its parent (in the shape of both
    the OpenAI and the Anthropic Models API: the one's fields beside the other's)."""
    cards = _model_cards(state)
    return {
        "object": "list",
        "data": cards,
        "has_more": False,
        "first_id": cards[0]["id"],
        "last_id": cards[-1]["id"],
    }


# A path: served names may hold slashes ("meta-llama/Llama-3.1-8B").
@router.api_route("/v1/models/{model:path}", methods=READ)
async def retrieve_model(model: str, state: State) -> dict[str, Any]:
    """One model of the list (`client.models.retrieve`); 404 for a name not served here."""
    cards = _model_cards(state)
    card = next((c for c in cards if c["id"] == model), None)
    if card is None:
        raise not_served(model, [c["id"] for c in cards])
    return card


def _model_cards(state: State) -> list[dict[str, Any]]:
    base = state.settings.served_model_name
    llm = state.client.llm
    entry = {
        "object": "model",
        "created": _STARTED,
        "owned_by": "inflight",
        # The Anthropic Models API's fields: a prompt and its output share the context, and
        # each takes a token at least.
        "type": "model",
        "created_at": _STARTED_AT,
        "max_input_tokens": llm.max_model_len - 1,
        "max_tokens": llm.max_model_len - 1,
    }
    return [
        *(
            {
                "id": name,
                "display_name": name,
                **entry,
                "max_model_len": llm.max_model_len,
                "input_modalities": llm.input_modalities,
                "output_modalities": llm.output_modalities,
            }
            for name in state.settings.model_names
        ),
        *(
            {"id": name, "display_name": name, **entry, "parent": base, "root": name}
            for name in llm.lora_adapters
        ),
    ]


def ignored_headers(fields: list[str]) -> dict[str, str]:
    """The response header naming the request's fields that had no effect on it (logged too):
    fields without meaning on this server, and those another field overrides (a format beside
    a forced tool call), so that a client can tell."""
    if not fields:
        return {}
    log.warning("request fields without effect on this request: %s", ", ".join(fields))
    return {IGNORED_HEADER: ", ".join(fields)}


async def started(run: Run) -> Run:
    await run.start()
    return run


async def gather(calls: list[Awaitable[RequestOutput]]) -> list[RequestOutput]:
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def openai_events(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Server-sent events: one `data:` line per chunk, errors in-band, then `[DONE]`."""
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    except ServerError as exc:
        yield f"data: {json.dumps(openai_error_payload(exc))}\n\n"
    yield "data: [DONE]\n\n"
