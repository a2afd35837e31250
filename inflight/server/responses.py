"""The OpenAI Responses API on the chat path: a request becomes a chat conversation (messages,
tools, tool choice, output constraint, sampling), generated and read as a chat completion is;
the reply is rendered as the Responses API's output items, whole or as its typed SSE events.

Responses are kept (unless `store: false`) in a bounded in-memory store, least recently used
first out, so that `previous_response_id` can continue a conversation and `GET` / `DELETE
/v1/responses/{id}` can find them; a restart forgets them.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from pydantic import BaseModel

from inflight.protocol.outputs import LogprobEntry, RequestOutput
from inflight.protocol.request import GenerationRequest, SamplingParams, StructuredOutputs
from inflight.protocol.tokenizer import Tokenizer
from inflight.server import openai
from inflight.server.chat import ChatSetup
from inflight.server.client import EngineClient, Run
from inflight.server.conversations import Conversation, item_object
from inflight.server.errors import ServerError
from inflight.server.parsers import MessageDelta, MessageParser
from inflight.server.protocol import SamplingFields, VllmExtensions
from inflight.server.responses_protocol import (
    INPUT_ITEM,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    FunctionToolSpec,
    InputImage,
    InputText,
    MessageItem,
    NamespaceToolSpec,
    OpenObject,
    OutputText,
    ReasoningConfig,
    ReasoningItem,
    Refusal,
    ResponsesRequest,
    TextFormatJsonObject,
    TextFormatJsonSchema,
    output_logprobs,
)
from inflight.server.tools import FunctionTool, ToolChoice, tool_choice

# How many stored responses the server keeps.
STORE_CAPACITY = 1024

# -- the store ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object, as it was returned
    conversation: list[Any]  # input items a continuation starts from (instructions left out)
    # Its input items as `GET /v1/responses/{id}/input_items` lists them (ids given once).
    input_items: list[dict[str, Any]] = field(default_factory=list)


class ResponseStore:
    """Stored responses by id, at most `capacity`; the least recently used goes first."""

    def __init__(self, capacity: int = STORE_CAPACITY) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, response_id: str, entry: StoredResponse) -> None:
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None


# -- the request as a chat turn ----------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    """A Responses request as the chat path takes it."""

    messages: list[dict[str, Any]]  # the conversation the prompt renders
    conversation: list[Any]  # its input items (instructions left out), which the store keeps
    choice: ToolChoice | None
    constraint: StructuredOutputs | None
    template_kwargs: dict[str, Any] | None  # the chat template's variables (thinking)
    params_of: dict[str, str]  # the HTTP field each request option came from
    ignored: list[str]  # fields accepted without effect (a text.format beside a forced call)
    namespaced: dict[str, tuple[str, str]]  # a function's name as the model sees it: its
    # namespace and its own name (`NamespaceToolSpec`)
    given: list[Any]  # the request's own input items


def chat_turn(
    body: ResponsesRequest,
    chat: ChatSetup,
    store: ResponseStore,
    held: Conversation | None = None,
) -> Turn:
    """The chat turn of a request (400 naming the field for what cannot be served; 400 for a
    previous_response_id that is not stored): its input after `held`'s items where the request
    names a conversation."""
    earlier: list[Any] = []
    earlier_from = "previous_response_id"
    if held is not None:
        earlier, earlier_from = held.input_items(), "conversation"
    elif body.previous_response_id is not None:
        stored = store.get(body.previous_response_id)
        if stored is None:
            raise ServerError(
                400,
                f"previous_response_id {body.previous_response_id!r} is not a stored response "
                "(unknown, deleted, sent with store: false, or evicted from the server's store "
                f"of {store.capacity})",
                "previous_response_id",
            )
        earlier = stored.conversation
    if body.input is None and not earlier:
        raise ServerError(400, "input is required", "input")
    given = body.input or []
    if isinstance(given, str):
        given = [MessageItem(role="user", content=given)]
    conversation = [*earlier, *given]
    messages = chat_messages(body.instructions, conversation, len(earlier), earlier_from)
    choice, namespaced, dropped = responses_tool_choice(body, chat)
    forced = choice is not None and choice.forced
    format_field = "text.format" if body.structured_outputs is None else "structured_outputs"
    constraint, ignored = chat.constraint(choice, text_constraint(body), format_field)
    return Turn(
        messages,
        conversation,
        choice,
        constraint,
        _thinking(body, chat),
        {"structured_outputs": "tool_choice" if forced else format_field},
        dropped + ignored,
        namespaced,
        list(given),
    )


def _thinking(body: ResponsesRequest, chat: ChatSetup) -> dict[str, Any] | None:
    """A reasoning effort sets the template's thinking switch (on, or off for "none") where
    it has one, as on chat completions."""
    effort = body.reasoning.effort if body.reasoning else None
    return None if effort is None else chat.thinking_switch(effort != "none", effort)


def chat_messages(
    instructions: str | None,
    items: list[Any],
    first_input: int,
    earlier_from: str = "previous_response_id",
) -> list[dict[str, Any]]:
    """Chat messages for the template: `instructions` as the system message in front; a
    reply's items (reasoning, text, function calls) as one assistant message, its calls'
    arguments as objects (what templates read); function call outputs as tool messages.
    Items from `first_input` on came with the request, the ones before from the field
    `earlier_from` names (a stored response, or a conversation)."""
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    reasoning: list[str] = []  # for the assistant message that follows
    for i, item in enumerate(items):
        where = f"input.{i - first_input}" if i >= first_input else earlier_from
        if isinstance(item, ReasoningItem):
            reasoning += [c.text for c in item.content or []] or [s.text for s in item.summary]
            continue
        if isinstance(item, MessageItem) and item.role != "assistant":
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _parts(item.content, f"{where}.content")})
        elif isinstance(item, MessageItem):
            out.append(_assistant(_text(item.content, f"{where}.content"), reasoning))
        elif isinstance(item, FunctionCallItem):
            # A call without arguments may send them empty.
            text = item.arguments if item.arguments.strip() else "{}"
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {
                    "name": flat_name(item.namespace, item.name) if item.namespace else item.name,
                    "arguments": openai.call_arguments(text, f"{where}.arguments"),
                },
            }
            # The calls of one reply join the message its text began.
            if not out or out[-1]["role"] != "assistant" or reasoning:
                out.append(_assistant("", reasoning))
            out[-1].setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            content = _text(item.output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": content})
        else:
            raise ServerError(
                400,
                f"input items of type {item.type!r} are not supported; this server reads "
                "message, function_call, function_call_output and reasoning items",
                where,
            )
        reasoning = []
    return out


def _assistant(content: str, reasoning: list[str]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    return message


def _parts(content: str | list[Any], where: str) -> str | list[dict[str, Any]]:
    """A message's content as `LLM.chat` takes it (which joins text parts into its text)."""
    if isinstance(content, str):
        return content
    out: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if isinstance(part, InputImage):
            if part.image_url is None:
                raise ServerError(
                    400,
                    "an input_image needs its image_url (uploaded files are not served)",
                    f"{where}.{j}",
                )
            out.append({"type": "image_url", "image_url": {"url": part.image_url}})
        else:
            out.append({"type": "text", "text": _text([part], f"{where}.{j}")})
    return out


def _text(content: str | list[Any], where: str) -> str:
    if isinstance(content, str):
        return content
    text = []
    for part in content:
        if isinstance(part, InputText | OutputText):
            text.append(part.text)
        elif isinstance(part, Refusal):
            text.append(part.refusal)
        else:
            raise ServerError(
                400,
                f"content of type {part.type!r} is not supported here; send input_text or "
                "output_text (and input_image in user messages)",
                where,
            )
    return "".join(text)


def flat_name(namespace: str, name: str) -> str:
    """A namespaced function's name as the model sees it."""
    return f"{namespace}__{name}"


# Built-in web search, which Codex offers with every request: a hosted service runs it, this
# server cannot, and a model may answer without it, so the tool is left out of the prompt and
# named back (tool_choice naming it stays a 400).
_WEB_SEARCH = ("web_search", "web_search_preview")


def responses_tool_choice(
    body: ResponsesRequest, chat: ChatSetup
) -> tuple[ToolChoice | None, dict[str, tuple[str, str]], list[str]]:
    """The request's function tools and tool choice, checked (a 400 naming the field); the
    flat names of its namespaced functions (see `NamespaceToolSpec`); the tools left out."""
    tools: list[FunctionTool] = []
    namespaced: dict[str, tuple[str, str]] = {}
    dropped: list[str] = []

    def add(tool: FunctionToolSpec, name: str) -> None:
        # The Responses API's function tools are strict unless they say otherwise.
        strict = tool.strict is not False
        tools.append(FunctionTool(name, tool.description, tool.parameters, strict=strict))

    for i, tool in enumerate(body.tools or []):
        if isinstance(tool, FunctionToolSpec):
            add(tool, tool.name)
        elif isinstance(tool, NamespaceToolSpec):
            for j, member in enumerate(tool.tools):
                if not isinstance(member, FunctionToolSpec):
                    raise ServerError(
                        400,
                        f"a namespace holds function tools; got one of type {member.type!r}",
                        f"tools.{i}.tools.{j}",
                    )
                name = flat_name(tool.name, member.name)
                namespaced[name] = (tool.name, member.name)
                add(member, name)
        elif str(tool.type).split("_20")[0] in _WEB_SEARCH:  # dated versions too
            dropped.append(f"tools.{i} ({tool.type})")
        else:
            raise ServerError(
                400,
                f"tools of type {tool.type!r} are not supported; this server serves function "
                "and namespace tools",
                f"tools.{i}",
            )
    choice = body.tool_choice
    if isinstance(choice, OpenObject):
        raise ServerError(
            400,
            f"tool_choice of type {choice.type!r} is not supported; send none, auto, required "
            'or {"type": "function", "name": ...}',
            "tool_choice",
        )
    named = isinstance(choice, FunctionChoice)
    checked = tool_choice(
        tools,
        "named" if named else choice,
        choice.name if named else None,
        body.parallel_tool_calls is not False,
        parser=chat.tool_parser,
    )
    return checked, namespaced, dropped


def sampling_params(
    body: ResponsesRequest, defaults: SamplingParams, constraint: StructuredOutputs | None
) -> SamplingParams:
    """The request's sampling fields over the model's defaults, as a chat completion's."""
    shared = {name: getattr(body, name) for name in VllmExtensions.model_fields}
    fields = SamplingFields(temperature=body.temperature, top_p=body.top_p, **shared)
    return openai.sampling_params(
        fields,
        defaults,
        max_tokens=body.max_output_tokens,
        logprobs=(body.top_logprobs or 0) if output_logprobs(body) else None,
        skip_special_tokens=body.skip_special_tokens,
        constraint=constraint,
    )


def text_constraint(body: ResponsesRequest) -> StructuredOutputs | None:
    """The output constraint of `text.format`, or of vLLM's `structured_outputs` field."""
    spec = body.text.format if body.text else None
    if body.structured_outputs is not None:
        if isinstance(spec, TextFormatJsonObject | TextFormatJsonSchema):
            raise ServerError(
                400, "send text.format or structured_outputs, not both", "structured_outputs"
            )
        return openai.vllm_constraint(body.structured_outputs)
    if isinstance(spec, TextFormatJsonObject):
        return StructuredOutputs(json_object=True)
    if isinstance(spec, TextFormatJsonSchema):
        return StructuredOutputs(json=spec.json_schema, strict=spec.strict is True)
    return None


async def prepare(
    client: EngineClient,
    messages: list[dict[str, Any]],
    params: SamplingParams,
    *,
    truncate: bool,
    **options: Any,
) -> GenerationRequest:
    """`EngineClient.prepare_chat`; with `truncate` (truncation "auto") a conversation too long
    for the context loses its oldest turns until it fits."""
    while True:
        try:
            return await client.prepare_chat(messages, params, **options)
        except ServerError as exc:
            shorter = _without_oldest_turn(messages) if truncate and exc.status == 413 else None
            if shorter is None:
                raise
            messages = shorter


def _without_oldest_turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The conversation less its first message after the system ones, and whatever answered
    it, so that it starts at a user message again; None when only the last turn is left."""
    head = 0
    while head < len(messages) and messages[head]["role"] == "system":
        head += 1
    end = head + 1
    while end < len(messages) and messages[end]["role"] != "user":
        end += 1
    if end >= len(messages):
        return None
    return messages[:head] + messages[end:]


# -- the response ------------------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message(
    text: str, status: str, item_id: str | None = None, logprobs: list | None = None
) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id or _new_id("msg"),
        "role": "assistant",
        "status": status,
        "content": [_output_text(text, logprobs)] if status != "in_progress" else [],
    }


def _output_text(text: str, logprobs: list | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _reasoning(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {
        "type": "reasoning",
        "id": item_id or _new_id("rs"),
        "summary": [],
        "content": content,
        "status": status,
    }


def _function_call(
    name: str, arguments: str, status: str, namespaced: dict[str, tuple[str, str]]
) -> dict[str, Any]:
    """A function call item; one of a namespace's functions (called by its flat name) names
    the namespace and the function apart."""
    item = {
        "type": "function_call",
        "id": _new_id("fc"),
        "call_id": f"call_{uuid.uuid4().hex[:24]}",
        "name": name,
        "arguments": arguments,
        "status": status,
    }
    if name in namespaced:
        item["namespace"], item["name"] = namespaced[name]
    return item


class ResponseReply:
    """A response, whole or streamed; `reader` splits the generated text into reasoning,
    text and function calls, as for a chat completion. A finished response is stored when the
    request asked for it."""

    def __init__(
        self,
        body: ResponsesRequest,
        model: str,
        params: SamplingParams,
        turn: Turn,
        reader: MessageParser,
        tokenizer: Tokenizer,
        store: ResponseStore,
        held: Conversation | None = None,
    ) -> None:
        self.id = _new_id("resp")
        # The conversation the finished response's input and output items are added to.
        self.held = held
        self.given = [item_object(item, f"input.{i}") for i, item in enumerate(turn.given)]
        self.created_at = int(time.time())
        self.reader = reader
        self.tokenizer = tokenizer
        self.conversation = turn.conversation
        self.namespaced = turn.namespaced
        # With `include` asking: the message carries every generated token's logprob (the
        # reasoning's too, as a chat completion's `logprobs.content` does).
        self.logprobs = output_logprobs(body)
        self.store = store if body.store is not False else None
        text_format = body.text.format if body.text else None
        reasoning = body.reasoning or ReasoningConfig()
        # What every state of the response object says the same way: the request's settings.
        self.settings: dict[str, Any] = {
            "model": model,
            "instructions": body.instructions,
            "tools": [t.model_dump() for t in body.tools or []],
            "tool_choice": (
                body.tool_choice.model_dump()
                if isinstance(body.tool_choice, BaseModel)
                else body.tool_choice or "auto"
            ),
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": reasoning.effort, "summary": reasoning.summary},
            "text": {
                "format": (
                    text_format.model_dump(by_alias=True, exclude_none=True)
                    if text_format
                    else {"type": "text"}
                ),
                "verbosity": (body.text.verbosity if body.text else None) or "medium",
            },
            "truncation": body.truncation or "disabled",
            "store": body.store is not False,
            "metadata": body.metadata or {},
            "user": body.user,
            "safety_identifier": body.safety_identifier,
            "prompt_cache_key": body.prompt_cache_key,
            "service_tier": "default",
            "background": False,
            "top_logprobs": body.top_logprobs or 0,
            "max_tool_calls": body.max_tool_calls,
            "conversation": None if held is None else {"id": held.id},
        }

    def _object(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "output": output,
            "usage": usage,
            **self.settings,
        }

    def _finished(self, output: list[dict[str, Any]], result: RequestOutput) -> dict[str, Any]:
        """The response object of a finished generation, kept in the store if asked."""
        reasoning = "".join(
            part["text"]
            for item in output
            if item["type"] == "reasoning"
            for part in item["content"]
        )
        output_tokens = len(result.token_ids)
        usage = {
            "input_tokens": result.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": result.cached_tokens,
                "cache_write_tokens": 0,
            },
            "output_tokens": output_tokens,
            "output_tokens_details": {
                # The reasoning text tokenized again: the tokens the model spent on it.
                "reasoning_tokens": min(
                    output_tokens,
                    len(self.tokenizer.encode(reasoning, add_special_tokens=False))
                    if reasoning
                    else 0,
                ),
            },
            "total_tokens": result.prompt_tokens + output_tokens,
        }
        status = "incomplete" if result.finish_reason == "length" else "completed"
        response = self._object(status, output, usage)
        # A call cut off mid-arguments is no call to send back.
        kept = [
            item
            for item in output
            if not (item["type"] == "function_call" and item["status"] == "incomplete")
        ]
        if self.store is not None:
            conversation = [*self.conversation, *(INPUT_ITEM.validate_python(i) for i in kept)]
            earlier = self.conversation[: len(self.conversation) - len(self.given)]
            inputs = [*(item_object(i, "input") for i in earlier), *self.given]
            self.store.put(self.id, StoredResponse(response, conversation, inputs))
        if self.held is not None:
            self.held.add([*self.given, *kept])
        return response

    def whole(self, result: RequestOutput) -> dict[str, Any]:
        parsed = self.reader.whole(result.text)
        output: list[dict[str, Any]] = []
        if parsed.reasoning:
            output.append(_reasoning(parsed.reasoning, "completed"))
        if parsed.content or not output and not parsed.tool_calls:
            logprobs = None
            if self.logprobs:
                logprobs = [openai.chat_logprob(e) for e in result.logprobs or ()]
            output.append(_message(parsed.content or "", "completed", logprobs=logprobs))
        for call in parsed.tool_calls:
            output.append(_function_call(call.name, call.arguments, "completed", self.namespaced))
        # The item written last was cut off (a call with its arguments as far as written).
        if result.finish_reason == "length":
            output[-1]["status"] = "incomplete"
        return self._finished(output, result)

    async def stream(self, run: Run) -> AsyncIterator[str]:
        """response.created, response.in_progress, the output items as they are written
        (`_ItemStream`), then response.completed (or response.incomplete, cut by
        max_output_tokens); an error ends it with an error event and response.failed."""
        numbers = itertools.count()

        def event(kind: str, data: dict[str, Any]) -> str:
            payload = {"type": kind, **data, "sequence_number": next(numbers)}
            return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

        started = self._object("in_progress", [])
        yield event("response.created", {"response": started})
        yield event("response.in_progress", {"response": started})
        items = _ItemStream(self.namespaced, self.logprobs)
        reading = self.reader.stream()
        finish = None
        try:
            async for chunk in run:
                items.read(chunk.logprobs or ())
                for kind, data in items.events(reading.feed(chunk.text)):
                    yield event(kind, data)
                if chunk.finished:
                    finish = chunk.finish_reason
        except ServerError as exc:
            yield event("error", {"code": str(exc.status), "message": exc.message, "param": None})
            error = {"code": "server_error", "message": exc.message}
            yield event(
                "response.failed", {"response": self._object("failed", items.done, None, error)}
            )
            return
        for kind, data in items.close(reading.finish(), cut=finish == "length"):
            yield event(kind, data)
        assert run.output is not None
        response = self._finished(items.done, run.output)
        yield event(f"response.{response['status']}", {"response": response})


class _ItemStream:
    """Output items opened as their kind of output arrives (reasoning, a message, one per
    function call), each finished when the next opens; a reply without any gets one empty
    message. Yields (event type, event fields) pairs; `done` holds the finished items. With
    `logprobs`, each text delta carries the logprobs of the tokens read since the one before,
    and the message all it was given (the tokens read before it opened and after its last
    text included)."""

    def __init__(self, namespaced: dict[str, tuple[str, str]], logprobs: bool = False) -> None:
        self.namespaced = namespaced
        self.logprobs = logprobs
        self.done: list[dict[str, Any]] = []
        self.item: dict[str, Any] | None = None  # the open item
        self.text = ""  # the open reasoning's or message's text so far
        self.pending: list[dict[str, Any]] = []  # logprobs not yet sent with a text delta
        self.sent: list[dict[str, Any]] = []  # those the open message's deltas carried

    def read(self, entries: Sequence[LogprobEntry]) -> None:
        """The logprobs of the tokens just read."""
        if self.logprobs:
            self.pending += [openai.chat_logprob(e) for e in entries]

    def events(self, delta: MessageDelta) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        if delta.reasoning:
            out += self._open("reasoning", lambda: _reasoning("", "in_progress"))
            out.append(self._text_delta("response.reasoning_text.delta", delta.reasoning))
        for part in delta.parts:
            if isinstance(part, str):
                out += self._open("message", lambda: _message("", "in_progress"))
                out.append(self._text_delta("response.output_text.delta", part, logprobs=[]))
                self._send_logprobs(out[-1][1])
                continue
            if part.name is not None:
                call = partial(_function_call, part.name, "", "in_progress", self.namespaced)
                out += self._open("function_call", call, always=True)
            if part.arguments:
                assert self.item is not None
                self.item["arguments"] += part.arguments
                out.append(
                    (
                        "response.function_call_arguments.delta",
                        {**self._where(), "delta": part.arguments},
                    )
                )
        return out

    def close(self, delta: MessageDelta, cut: bool) -> list[tuple[str, dict[str, Any]]]:
        out = self.events(delta)
        if self.item is None and not self.done:
            out += self._open("message", lambda: _message("", "in_progress"))
        if self.pending and self.item is not None and self.item["type"] == "message":
            # The tokens read after the message's last text (its end token): one more delta.
            out.append(self._text_delta("response.output_text.delta", "", logprobs=[]))
            self._send_logprobs(out[-1][1])
        out += self._finish("incomplete" if cut else "completed")
        return out

    def _send_logprobs(self, delta: dict[str, Any]) -> None:
        delta["logprobs"], self.pending = self.pending, []
        self.sent += delta["logprobs"]

    def _where(self, **more: Any) -> dict[str, Any]:
        assert self.item is not None
        return {"item_id": self.item["id"], "output_index": len(self.done), **more}

    def _text_delta(self, kind: str, text: str, **more: Any) -> tuple[str, dict[str, Any]]:
        self.text += text
        return kind, {**self._where(content_index=0), "delta": text, **more}

    def _open(
        self, kind: str, new: Callable[[], dict[str, Any]], always: bool = False
    ) -> list[tuple[str, dict[str, Any]]]:
        """Open an item of `kind` made by `new`, unless one is open (`always`: a new one)."""
        if self.item is not None and self.item["type"] == kind and not always:
            return []
        out = self._finish("completed")
        self.item = new()
        self.text = ""
        out.append(
            ("response.output_item.added", {"output_index": len(self.done), "item": self.item})
        )
        if kind == "message":
            part = _output_text("")
        elif kind == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
        else:
            return out
        out.append(("response.content_part.added", {**self._where(content_index=0), "part": part}))
        return out

    def _finish(self, status: str) -> list[tuple[str, dict[str, Any]]]:
        item = self.item
        if item is None:
            return []
        out: list[tuple[str, dict[str, Any]]] = []
        if item["type"] == "function_call":
            done = {**item, "status": status}
            out.append(
                (
                    "response.function_call_arguments.done",
                    {**self._where(), "name": item["name"], "arguments": item["arguments"]},
                )
            )
        else:
            if item["type"] == "message":
                logprobs, self.sent = self.sent, []
                done = _message(self.text, status, item["id"], logprobs)
                part = _output_text(self.text, logprobs)
                text_done = (
                    "response.output_text.done",
                    {"text": self.text, "logprobs": logprobs},
                )
            else:
                done = _reasoning(self.text, status, item["id"])
                part = {"type": "reasoning_text", "text": self.text}
                text_done = ("response.reasoning_text.done", {"text": self.text})
            where = self._where(content_index=0)
            out.append((text_done[0], {**where, **text_done[1]}))
            out.append(("response.content_part.done", {**where, "part": part}))
        out.append(("response.output_item.done", {"output_index": len(self.done), "item": done}))
        self.done.append(done)
        self.item = None
        return out
