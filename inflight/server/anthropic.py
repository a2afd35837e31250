"""Anthropic Messages API: request mapping, the response, and its SSE event order."""

from __future__ import annotations

import base64
import hashlib
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from inflight.protocol.outputs import RequestOutput
from inflight.protocol.request import SamplingParams, StructuredOutputs
from inflight.server import context_edits, documents
from inflight.server.chat import ChatSetup
from inflight.server.client import EngineClient, Run
from inflight.server.errors import ServerError
from inflight.server.parsers import MessageDelta, MessageParser
from inflight.server.parsers.json_scan import arguments_object
from inflight.server.protocol import (
    AnthropicCountTokensRequest,
    AnthropicDocumentBlock,
    AnthropicImageBlock,
    AnthropicMessage,
    AnthropicMessagesRequest,
    AnthropicTextBlock,
    AnthropicThinkingBlock,
    AnthropicTool,
    AnthropicToolResultBlock,
    AnthropicToolUseBlock,
    AnthropicWebSearchTool,
)
from inflight.server.tools import FunctionTool, ToolChoice, ToolMode, tool_choice

_ANTHROPIC_ERRORS = {400: "invalid_request_error", 429: "overloaded_error", 500: "api_error"}
_TOOL_MODES: dict[str, ToolMode] = {
    "auto": "auto",
    "any": "required",
    "tool": "named",
    "none": "none",
}


def _text(content: str | list[Any], where: str) -> str:
    if isinstance(content, str):
        return content
    for block in content:
        if not isinstance(block, AnthropicTextBlock):
            raise ServerError(
                400, f"content blocks of type {block.type!r} are not supported; send text", where
            )
    return "".join(block.text for block in content)


def chat_messages(
    system: str | list[AnthropicTextBlock] | None, messages: list[AnthropicMessage]
) -> list[dict[str, Any]]:
    """Chat messages for the template: an assistant's `tool_use` blocks become its tool calls
    (and `thinking` its reasoning), a user's `tool_result` blocks tool messages, in order."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _text(system, "system")})
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    for i, m in enumerate(messages):
        where = f"messages.{i}.content"
        if m.clear_at is not None and m.role != "system":
            raise ServerError(400, "clear_at is only permitted on system messages", where)
        if m.clear_at == "next_user_message" and i < last_user:
            continue  # its turn is over: kept in the array, no longer shown
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "system":
            out.append({"role": "system", "content": _marked_text(m.content, where, _change_line)})
        elif m.role == "assistant":
            out.append(_assistant(m.content, where))
        else:
            out += _user(m.content, where)
    return out


def _assistant(blocks: list[Any], where: str) -> dict[str, Any]:
    text, calls, reasoning = [], [], []
    for block in blocks:
        if isinstance(block, AnthropicToolUseBlock):
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": block.input},
                }
            )
        elif isinstance(block, AnthropicThinkingBlock):
            reasoning.append(block.thinking)
        elif block.type == "redacted_thinking":
            # Thinking Anthropic's API encrypted, which clients must send back as it came: none
            # of it is readable here, so it is left out of the prompt rather than refused.
            continue
        else:
            text.append(_text([block], where))
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    return message


def _user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    # The content parts of the user message being gathered (`LLM.chat` joins their text).
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        media = _media_part(block, where, j)
        if media is not None:
            parts.append(media)
            continue
        if not isinstance(block, AnthropicToolResultBlock):
            parts.append({"type": "text", "text": _text([block], where)})
            continue
        if parts:
            out.append({"role": "user", "content": parts})
            parts = []
        result = _result(block.content or "", f"{where}.{j}.content")
        if block.is_error:  # the error said in words, as templates know no error results
            result = f"Error: {result}" if isinstance(result, str) else [_ERROR, *result]
        out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": result})
    if parts or not out:
        out.append({"role": "user", "content": parts})
    return out


_ERROR = {"type": "text", "text": "Error: "}


def _result(content: str | list[Any], where: str) -> str | list[dict[str, Any]]:
    """A tool result as a tool message's content: its text; with images or documents, parts
    (the text, the images, and the documents, which are read to text as the prompt is
    prepared), as Claude Code sends an image file its Read tool opened."""
    if isinstance(content, str) or not any(isinstance(b, _MEDIA_BLOCKS) for b in content):
        return _marked_text(content, where, _loaded_line)
    return [
        _media_part(b, where, j)
        or {"type": "text", "text": _marked_text([b], f"{where}.{j}", _loaded_line)}
        for j, b in enumerate(content)
    ]


_MEDIA_BLOCKS = (AnthropicImageBlock, AnthropicDocumentBlock)


def _media_part(block: Any, where: str, index: int) -> dict[str, Any] | None:
    """An image or document block as a message's content part (None for another block)."""
    if isinstance(block, AnthropicImageBlock):
        return {"type": "image_url", "image_url": {"url": _image_url(block, where, index)}}
    if isinstance(block, AnthropicDocumentBlock):
        return documents.part(_document(block, f"{where}.{index}"))
    return None


def _document(block: AnthropicDocumentBlock, where: str) -> documents.Document:
    """A document block's file: a PDF or text by value (base64, text, or text blocks) or by
    URL."""
    source, where = block.source, f"{where}.source"
    named = {"name": block.title, "context": block.context}
    if source.type in ("base64", "text") and source.data is None:
        raise ServerError(400, f"a {source.type} document source needs its data", where)
    if source.type == "base64":
        return documents.Document(where, base64=source.data, media_type=source.media_type, **named)
    if source.type == "text":
        data = (source.data or "").encode()
        return documents.Document(where, data=data, media_type="text/plain", **named)
    if source.type == "content":
        content = source.content if source.content is not None else ""
        if not isinstance(content, str):
            content = "\n".join(_text([b], f"{where}.content.{k}") for k, b in enumerate(content))
        return documents.Document(where, data=content.encode(), media_type="text/plain", **named)
    if source.type == "url":
        if not source.url:
            raise ServerError(400, "a url document source needs its url", where)
        return documents.Document(f"{where}.url", url=source.url, **named)
    raise ServerError(
        400,
        "Anthropic's Files API is not served here, so a document cannot name a file_id; send "
        "the PDF as base64 or the text as a text source",
        where,
    )


def unread_citations(messages: list[AnthropicMessage]) -> list[str]:
    """The documents asking for citations, which replies do not give (named as ignored)."""
    found = []
    for i, m in enumerate(messages):
        for j, block in enumerate(m.content if isinstance(m.content, list) else []):
            inner = block.content if isinstance(block, AnthropicToolResultBlock) else None
            nested = enumerate(inner if isinstance(inner, list) else [])
            for at, b in [(str(j), block), *((f"{j}.content.{k}", b) for k, b in nested)]:
                if isinstance(b, AnthropicDocumentBlock) and (b.citations or {}).get("enabled"):
                    found.append(f"messages.{i}.content.{at}.citations")
    return found


def _marked_text(
    content: str | list[Any], where: str, line: Callable[[Any, str], str | None]
) -> str:
    """The text of `content`; where `line` reads some of its blocks as lines of their own (a
    tool change, a tool loaded: `offered_tools`), the blocks' texts one a line."""
    if isinstance(content, str):
        return content
    lines = [line(b, f"{where}.{j}") for j, b in enumerate(content)]
    if not any(lines):
        return _text(content, where)
    return "\n".join(
        read or _text([b], f"{where}.{j}")
        for j, (b, read) in enumerate(zip(content, lines, strict=True))
    )


def _change_line(block: Any, where: str) -> str | None:
    """A system message's `tool_addition` / `tool_removal` block as the change it makes."""
    change = _tool_change(block, where)
    return None if change is None else f"Tool {'added' if change[0] else 'removed'}: {change[1]}"


def _loaded_line(block: Any, where: str) -> str | None:
    """A tool result's `tool_reference` block (a tool search's answer) as the tool it loads."""
    name = _referenced_tool(block)
    return None if name is None else f"Tool loaded: {name}"


def _tool_change(block: Any, where: str) -> tuple[bool, str, AnthropicTool | None] | None:
    """(added, the tool's name, its definition where the block gives one) of a tool_addition
    or tool_removal block, None for another block; a 400 naming what cannot be served."""
    kind = getattr(block, "type", None)
    if kind not in ("tool_addition", "tool_removal"):
        return None
    tool = getattr(block, "tool", None)
    kind_of_tool = tool.get("type") if isinstance(tool, dict) else None
    if kind_of_tool == "tool_reference" and isinstance(tool.get("name"), str):
        return kind == "tool_addition", tool["name"], None
    if kind == "tool_addition" and kind_of_tool == "tool_definition":
        try:
            definition = AnthropicTool.model_validate(tool.get("definition"))
        except ValueError as exc:
            raise ServerError(
                400, f"a tool_definition needs a custom tool's definition: {exc}", where
            ) from exc
        return True, definition.name, definition
    raise ServerError(
        400,
        f"a {kind} block's tool must be a tool_reference by name"
        + (" or a tool_definition" if kind == "tool_addition" else "")
        + f" (MCP tools are not served); got {kind_of_tool!r}",
        where,
    )


def _referenced_tool(block: Any) -> str | None:
    """The tool a `tool_reference` block names, or None for another block."""
    if getattr(block, "type", None) != "tool_reference":
        return None
    name = getattr(block, "tool_name", None)
    if not isinstance(name, str) or not name:
        raise ServerError(400, "a tool_reference block needs the tool_name it loads", "messages")
    return name


def _loaded_tools(messages: list[AnthropicMessage]) -> set[str]:
    """The tools named by `tool_reference` blocks in the conversation's tool results."""
    loaded = set()
    for m in messages:
        if isinstance(m.content, str):
            continue
        for block in m.content:
            if isinstance(block, AnthropicToolResultBlock) and isinstance(block.content, list):
                loaded.update(n for b in block.content if (n := _referenced_tool(b)))
    return loaded


def _image_url(block: AnthropicImageBlock, where: str, index: int) -> str:
    source = block.source
    if source.type == "url":
        if not source.url:
            raise ServerError(400, "an image source of type url needs its url", f"{where}.{index}")
        return source.url
    if not source.data or not (source.media_type or "").startswith("image/"):
        raise ServerError(
            400,
            "a base64 image source needs data and an image/* media_type",
            f"{where}.{index}",
        )
    return f"data:{source.media_type};base64,{source.data}"


def offered_tools(body: AnthropicCountTokensRequest) -> list[FunctionTool]:
    """The tools the model is shown and may call: a deferred tool (`defer_loading`) only once
    a `tool_reference` in a tool result has loaded it, as the API's tool search does; then
    the `tool_addition` / `tool_removal` blocks of system messages in order (a tool named by
    reference must be the request's or defined by an earlier addition: a 400 otherwise).
    `input_examples` are shown after the description."""
    tools = [t for t in body.tools or [] if isinstance(t, AnthropicTool)]
    changes = [
        change
        for i, m in enumerate(body.messages)
        if m.role == "system" and not isinstance(m.content, str)
        for j, block in enumerate(m.content)
        if (change := _tool_change(block, f"messages.{i}.content.{j}"))
    ]
    declared = {t.name: t for t in tools} | {c[1]: c[2] for c in changes if c[2] is not None}
    loaded = _loaded_tools(body.messages)
    named = sorted((loaded | {c[1] for c in changes}) - declared.keys())
    if named:
        raise ServerError(
            400,
            f"{named[0]!r} is referenced but is not one of the request's tools",
            "messages",
        )
    offered = {t.name: t for t in tools if not t.defer_loading or t.name in loaded}
    # The system messages' changes in order: the last one for a tool stands at the reply.
    for added, name, _ in changes:
        if added:
            offered[name] = declared[name]
        else:
            offered.pop(name, None)
    return [
        FunctionTool(t.name, _described(t), t.input_schema, strict=t.strict)
        for t in offered.values()
    ]


def hosted_tools(body: AnthropicCountTokensRequest) -> list[str]:
    """The hosted tools left out of the prompt (web search), named as ignored."""
    return [
        f"tools.{i} ({tool.type})"
        for i, tool in enumerate(body.tools or [])
        if isinstance(tool, AnthropicWebSearchTool)
    ]


def _described(tool: AnthropicTool) -> str | None:
    if not tool.input_examples:
        return tool.description
    examples = "\n".join(json.dumps(e, ensure_ascii=False) for e in tool.input_examples)
    return f"{tool.description or ''}\n\nInput examples:\n{examples}".lstrip()


def messages_tool_choice(body: AnthropicCountTokensRequest, chat: ChatSetup) -> ToolChoice | None:
    """The request's tools and tool_choice, checked (a 400 naming the field)."""
    tools = offered_tools(body)
    choice = body.tool_choice
    if choice is not None and choice.type == "tool" and not choice.name:
        raise ServerError(400, 'tool_choice of type "tool" needs the tool\'s name', "tool_choice")
    return tool_choice(
        tools,
        _TOOL_MODES[choice.type] if choice else None,
        choice.name if choice else None,
        not (choice and choice.disable_parallel_tool_use),
        parser=chat.tool_parser,
    )


def structured_outputs(body: AnthropicCountTokensRequest) -> StructuredOutputs | None:
    """The JSON schema of `output_config.format` (or the beta's `output_format`) as the
    output constraint."""
    config_format = body.output_config.format if body.output_config else None
    if config_format is not None and body.output_format is not None:
        raise ServerError(
            400, "send output_config.format or output_format, not both", "output_format"
        )
    chosen = config_format or body.output_format
    return None if chosen is None else StructuredOutputs(json=chosen.schema_)


def template_args(
    chat: ChatSetup,
    conversation: list[dict[str, Any]],
    choice: ToolChoice | None,
    thinking: dict[str, Any] | None,
) -> dict[str, Any]:
    """The chat-template arguments of a conversation: one that ends with an assistant message
    is continued from its text (the API's prefill), as a new reply is opened otherwise. As the
    API does, a prefill may not end with whitespace (a 400): the reply's first token would
    carry it."""
    prefill = conversation[-1]["role"] == "assistant"
    text = conversation[-1].get("content") or ""
    if prefill and text != text.rstrip():
        raise ServerError(
            400,
            "final assistant content cannot end with trailing whitespace",
            "messages",
        )
    return chat.template_args(
        conversation,
        choice,
        thinking=thinking,
        add_generation_prompt=not prefill,
        continue_final_message=prefill,
    )


def thinking_switch(
    body: AnthropicCountTokensRequest, chat: ChatSetup
) -> tuple[dict[str, Any] | None, list[str]]:
    """The chat-template switch of `thinking` (enabled or adaptive: on; disabled: off) and
    `output_config.effort`, and those of the two fields that have no effect on this model's
    template."""
    kind = (body.thinking or {}).get("type")
    enabled = None if kind is None else kind != "disabled"
    effort = body.output_config.effort if body.output_config else None
    if enabled is None and effort is None:
        return None, []
    switch = chat.thinking_switch(enabled, effort)
    if switch is not None:
        return switch, []
    return None, [name for name, v in (("thinking", kind), ("output_config.effort", effort)) if v]


def prompt_counter(
    body: AnthropicCountTokensRequest,
    client: EngineClient,
    chat: ChatSetup,
    choice: ToolChoice | None,
    thinking: dict[str, Any] | None,
) -> context_edits.Count:
    """The prompt tokens of the body's conversation with other messages (the edits'), rendered
    and tokenized as the prompt of `choice` and `thinking` is."""

    async def count(messages: list[AnthropicMessage]) -> int:
        conversation = chat_messages(body.system, messages)
        template = template_args(chat, conversation, choice, thinking)
        return len(await client.prompt_tokens(conversation, **template))

    return count


async def edited_messages(
    body: AnthropicCountTokensRequest, count: context_edits.Count
) -> context_edits.Edited | None:
    """The conversation with the edits of `context_management` applied (None: none asked; a
    400 naming a bad edit). The tools offered stay those of the conversation as sent: a cleared
    tool result does not unload the tool it loaded."""
    if body.context_management is None:
        return None
    config, ignored = context_edits.parse(body.context_management)
    try:
        edited = await context_edits.apply(config, body.messages, count)
    except ServerError as exc:
        if exc.code != "context_length_exceeded":
            raise
        # The edits count the conversation as sent, which must fit the model's context.
        prefix = "context_management counts the conversation as sent, before its edits: "
        raise ServerError(
            exc.status,
            prefix + exc.message,
            exc.param,
            code=exc.code,
            anthropic_message=prefix + (exc.anthropic_message or exc.message),
        ) from exc
    edited.ignored = ignored
    return edited


def sampling_params(
    body: AnthropicMessagesRequest,
    defaults: SamplingParams,
    constraint: StructuredOutputs | None = None,
) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=body.max_tokens,
            min_tokens=body.min_tokens or 0,
            ignore_eos=body.ignore_eos,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=defaults.top_p if body.top_p is None else body.top_p,
            top_k=defaults.top_k if body.top_k is None else body.top_k,
            repetition_penalty=defaults.repetition_penalty,
            stop=body.stop_sequences or [],
            structured_outputs=constraint,
        )
    except ValueError as exc:
        raise ServerError(400, str(exc)) from exc


def _stop_reason(output_reason: str | None, stop: str | int | None, called: bool) -> str:
    if output_reason == "length":
        return "max_tokens"
    if called:
        return "tool_use"
    return "stop_sequence" if isinstance(stop, str) else "end_turn"


def _usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, int]:
    """A message's usage as Anthropic counts it: the prompt tokens read from the context cache
    apart from `input_tokens` (which they would otherwise be part of); none are written to a
    cache on request (`cache_control` is not read), so `cache_creation_input_tokens` is 0."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
        "output_tokens": output_tokens,
    }


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def signed(thinking: str) -> str:
    """A thinking block's `signature`: opaque to clients, who send it back with the block (this
    server reads none it is sent); not empty, which the AI SDK's Anthropic provider takes for a
    missing one; a digest of the thinking, so that the stream and the whole reply agree."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


class MessageReply:
    """A message, whole or streamed; `reader` splits the generated text into thinking, text
    and tool_use blocks."""

    def __init__(
        self,
        model: str,
        reader: MessageParser,
        context_management: dict[str, Any] | None = None,
    ) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.reader = reader
        # The edits applied to the conversation (`{"applied_edits": [...]}`), where it asked
        # for any: on the message, and streamed on message_delta.
        self.context_management = context_management
        # The content blocks of a stream that ended with message_stop (a thread keeps them).
        self.streamed: list[dict[str, Any]] | None = None

    def _message(
        self, content: list[dict], stop_reason: str | None, stop: str | None, usage: dict[str, int]
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop,
            "usage": usage,
        }

    def _edits(self) -> dict[str, Any]:
        """The message's `context_management` field, where the request asked for edits."""
        if self.context_management is None:
            return {}
        return {"context_management": self.context_management}

    def whole(self, output: RequestOutput) -> dict[str, Any]:
        stop = output.stop_reason if isinstance(output.stop_reason, str) else None
        parsed = self.reader.whole(output.text)
        content: list[dict[str, Any]] = []
        if parsed.reasoning:
            thinking = parsed.reasoning
            content.append(
                {"type": "thinking", "thinking": thinking, "signature": signed(thinking)}
            )
        # An empty text block only where there is no other (as the stream gives it).
        if parsed.content or not (parsed.tool_calls or parsed.reasoning):
            content.append({"type": "text", "text": parsed.content or ""})
        for call in parsed.tool_calls:
            content.append(
                {
                    "type": "tool_use",
                    "id": tool_use_id(),
                    "name": call.name,
                    # A call cut by max_tokens: its input as far as written.
                    "input": arguments_object(call.arguments),
                }
            )
        return (
            self._message(
                content,
                _stop_reason(output.finish_reason, output.stop_reason, bool(parsed.tool_calls)),
                stop,
                _usage(output.prompt_tokens, output.cached_tokens, len(output.token_ids)),
            )
            | self._edits()
        )

    def _start(self, prompt_tokens: int, cached_tokens: int) -> str:
        usage = _usage(prompt_tokens, cached_tokens, 0)
        return _event("message_start", {"message": self._message([], None, None, usage)})

    async def stream(self, run: Run, prompt_tokens: int) -> AsyncIterator[str]:
        """message_start, the content blocks (content_block_start, ping after the first, its
        deltas, content_block_stop), message_delta (stop reason, usage), message_stop; an error
        event if it fails."""
        blocks = _BlockStream()
        reading = self.reader.stream()
        output_tokens, finish, started = 0, None, False
        try:
            async for chunk in run:
                if not started:
                    # The first chunk knows what the context cache held: message_start gives
                    # the split, as Anthropic's does (LangChain.js reads cache reads only there).
                    started = True
                    yield self._start(prompt_tokens, chunk.cached_tokens)
                output_tokens += len(chunk.token_ids)
                for event in blocks.events(reading.feed(chunk.text)):
                    yield event
                if chunk.finished:
                    finish = chunk.finish_reason
        except ServerError as exc:
            if not started:
                yield self._start(prompt_tokens, 0)
            kind = _ANTHROPIC_ERRORS.get(exc.status, "api_error")
            yield _event("error", {"error": {"type": kind, "message": exc.message}})
            return
        cached = run.output.cached_tokens if run.output is not None else 0
        if not started:
            yield self._start(prompt_tokens, cached)
        for event in blocks.close(reading.finish()):
            yield event
        stop = run.output.stop_reason if run.output is not None else None
        yield _event(
            "message_delta",
            {
                "delta": {
                    "stop_reason": _stop_reason(finish, stop, reading.calls_made > 0),
                    "stop_sequence": stop if isinstance(stop, str) else None,
                },
                # Cumulative, as Anthropic's (langchain reads the usage only here).
                "usage": _usage(prompt_tokens, cached, output_tokens),
                **self._edits(),
            },
        )
        yield _event("message_stop", {})
        self.streamed = blocks.content()


class _BlockStream:
    """Content blocks opened as their kind of output arrives (thinking, text, one per tool
    call), each closed when the next opens; a message without any gets one empty text block.
    The blocks are also gathered whole, as `MessageReply.whole` would give them."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None
        self.blocks: list[dict[str, Any]] = []
        self.arguments: dict[int, str] = {}  # a tool_use block's streamed input JSON, by index

    def content(self) -> list[dict[str, Any]]:
        """The blocks whole (a tool call cut by max_tokens with its input as far as written)."""
        for index, text in self.arguments.items():
            self.blocks[index]["input"] = arguments_object(text)
        return self.blocks

    def events(self, delta: MessageDelta) -> list[str]:
        out: list[str] = []
        if delta.reasoning:
            out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        for part in delta.parts:
            if isinstance(part, str):
                out += self._open("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": part}))
                continue
            if part.name is not None:
                block = {"type": "tool_use", "id": tool_use_id(), "name": part.name, "input": {}}
                out += self._open("tool_use", block, always=True)
            if part.arguments:
                out.append(
                    self._delta({"type": "input_json_delta", "partial_json": part.arguments})
                )
        return out

    def close(self, delta: MessageDelta) -> list[str]:
        out = self.events(delta)
        if self.kind is None:
            out += self._open("text", {"type": "text", "text": ""})
        return out + self._stop()

    def _stop(self) -> list[str]:
        """The open block's end: a thinking block's signature first, as Anthropic's streams
        give it (the AI SDK sends a streamed thinking block back only with one)."""
        out = []
        block = self.blocks[self.index]
        if self.kind == "thinking":
            block["signature"] = signed(block["thinking"])
            delta = {"type": "signature_delta", "signature": block["signature"]}
            out.append(_event("content_block_delta", {"index": self.index, "delta": delta}))
        out.append(_event("content_block_stop", {"index": self.index}))
        return out

    def _open(self, kind: str, block: dict[str, Any], always: bool = False) -> list[str]:
        if self.kind == kind and not always:
            return []
        out = []
        if self.kind is not None:
            out += self._stop()
        self.index += 1
        self.kind = kind
        out.append(_event("content_block_start", {"index": self.index, "content_block": block}))
        self.blocks.append(dict(block))
        if self.index == 0:
            out.append(_event("ping", {}))
        return out

    def _delta(self, delta: dict[str, Any]) -> str:
        block = self.blocks[self.index]
        if delta["type"] == "text_delta":
            block["text"] += delta["text"]
        elif delta["type"] == "thinking_delta":
            block["thinking"] += delta["thinking"]
        else:
            self.arguments[self.index] = self.arguments.get(self.index, "") + delta["partial_json"]
        return _event("content_block_delta", {"index": self.index, "delta": delta})
