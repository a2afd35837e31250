"""Anthropic Messages API: request mapping, the response, and its SSE event order."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from inflight.runtime.outputs import CompletionOutput
from inflight.runtime.request import SamplingParams
from inflight.server.client import Run
from inflight.server.errors import ServerError
from inflight.server.protocol import (
    AnthropicMessage,
    AnthropicMessagesRequest,
    AnthropicTextBlock,
)

_ANTHROPIC_ERRORS = {400: "invalid_request_error", 429: "overloaded_error", 500: "api_error"}


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
) -> list[dict[str, str]]:
    out = []
    if system:
        out.append({"role": "system", "content": _text(system, "system")})
    for i, m in enumerate(messages):
        out.append({"role": m.role, "content": _text(m.content, f"messages.{i}.content")})
    return out


def sampling_params(body: AnthropicMessagesRequest, defaults: SamplingParams) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=body.max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=defaults.top_p if body.top_p is None else body.top_p,
            top_k=defaults.top_k if body.top_k is None else body.top_k,
            stop=body.stop_sequences or [],
        )
    except ValueError as exc:
        raise ServerError(400, str(exc)) from exc


def _stop_reason(output_reason: str | None, stop: str | int | None) -> str:
    if output_reason == "length":
        return "max_tokens"
    return "stop_sequence" if isinstance(stop, str) else "end_turn"


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class MessageReply:
    def __init__(self, model: str) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model

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

    def whole(self, output: CompletionOutput) -> dict[str, Any]:
        stop = output.stop_reason if isinstance(output.stop_reason, str) else None
        return self._message(
            [{"type": "text", "text": output.text}],
            _stop_reason(output.finish_reason, output.stop_reason),
            stop,
            {"input_tokens": output.prompt_tokens, "output_tokens": len(output.token_ids)},
        )

    async def stream(self, run: Run, prompt_tokens: int) -> AsyncIterator[str]:
        """message_start, content_block_start, ping, text deltas, content_block_stop,
        message_delta (stop reason, usage), message_stop; an error event if it fails."""
        usage = {"input_tokens": prompt_tokens, "output_tokens": 0}
        yield _event("message_start", {"message": self._message([], None, None, usage)})
        yield _event(
            "content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}
        )
        yield _event("ping", {})
        output_tokens, finish = 0, None
        try:
            async for chunk in run:
                output_tokens += len(chunk.token_ids)
                if chunk.text:
                    yield _event(
                        "content_block_delta",
                        {"index": 0, "delta": {"type": "text_delta", "text": chunk.text}},
                    )
                if chunk.finished:
                    finish = chunk.finish_reason
        except ServerError as exc:
            kind = _ANTHROPIC_ERRORS.get(exc.status, "api_error")
            yield _event("error", {"error": {"type": kind, "message": exc.message}})
            return
        stop = run.output.stop_reason if run.output is not None else None
        yield _event("content_block_stop", {"index": 0})
        yield _event(
            "message_delta",
            {
                "delta": {
                    "stop_reason": _stop_reason(finish, stop),
                    "stop_sequence": stop if isinstance(stop, str) else None,
                },
                "usage": {"output_tokens": output_tokens},
            },
        )
        yield _event("message_stop", {})
