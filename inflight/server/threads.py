"""Anthropic message threads: conversations the server holds between turns.

A Messages request with `thread: {"type": "create"}` is served as any other, and its whole
conversation (system prompt, tools, messages and the reply) is kept under the reply's id. A
request with `{"type": "continue", "previous_message_id": id}` sends only the messages after
that reply, without `system` or `tools`: the server rebuilds the conversation before the
prompt is rendered, and keeps the longer one under the new reply's id.

As the API defines them, threads are best-effort and linear: a kept conversation expires
`TTL_S` after it was kept, each reply can be continued once, and only by one request at a
time. The rejections carry the API's `error.details.error_code`, from which the SDKs' thread
helpers recover by sending the whole conversation again under a new thread. The store is in
memory, bounded (least recently used out) and forgotten on restart.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inflight.server.errors import ServerError
from inflight.server.lru import Lru
from inflight.server.protocol import AnthropicMessage, AnthropicMessagesRequest, AnthropicToolSpec

# How long a kept conversation can be continued, counted from when it was kept (the API's 5
# minutes after a thread's last request).
TTL_S = 300.0
# How many kept conversations (and marks of continued replies) the server holds.
CAPACITY = 1024


@dataclass
class _Kept:
    system: Any  # the create request's `system`, as sent
    tools: list[AnthropicToolSpec] | None
    messages: list[AnthropicMessage]  # the whole conversation, the reply last
    kept_at: float
    continued: bool = False  # a continue from this reply was served: the conversation dropped
    in_flight: bool = False  # a continue from this reply is being served


def _rejection(status: int, code: str, message: str) -> ServerError:
    return ServerError(status, message, "thread", details={"error_code": code})


class ThreadStore:
    """Kept conversations by the id of their last reply."""

    def __init__(
        self,
        capacity: int = CAPACITY,
        ttl_s: float = TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: Lru[_Kept] = Lru(capacity)

    def begin(self, body: AnthropicMessagesRequest) -> ThreadTurn | None:
        """The thread turn of a request (None without `thread`); a continue is checked against
        the store (404 `thread_not_found`, 400 `thread_already_continued` or
        `thread_continue_in_flight`) and holds its reply until the turn is kept or released."""
        thread = body.thread
        if thread is None:
            return None
        if thread.type == "create":
            return ThreadTurn(self, None, body.system, body.tools, list(body.messages))
        for field in ("system", "tools"):
            if getattr(body, field) is not None:
                raise ServerError(
                    400,
                    f"a thread's continue takes {field} from the request that created the "
                    f"thread: leave {field} out",
                    field,
                )
        previous = thread.previous_message_id
        kept = self._live(previous)
        if kept is None:
            raise _rejection(
                404,
                "thread_not_found",
                f"no thread is held for previous_message_id {previous!r} (unknown, expired "
                f"{self.ttl_s:.0f} s after it was kept, or evicted from the server's "
                f"{self._entries.capacity}): send the whole conversation with thread type create",
            )
        if kept.continued:
            raise _rejection(
                400,
                "thread_already_continued",
                f"the reply {previous!r} was already continued, and a reply can be continued "
                "once: continue from the thread's latest reply",
            )
        if kept.in_flight:
            raise _rejection(
                400,
                "thread_continue_in_flight",
                f"another request is continuing from {previous!r}: continue from its reply "
                "once it is done",
            )
        kept.in_flight = True
        return ThreadTurn(self, previous, kept.system, kept.tools, [*kept.messages, *body.messages])

    def _live(self, message_id: str) -> _Kept | None:
        kept = self._entries.get(message_id)
        if kept is not None and self._clock() - kept.kept_at > self.ttl_s:
            self._entries.delete(message_id)
            return None
        return kept

    def keep(
        self,
        message_id: str,
        system: Any,
        tools: list[AnthropicToolSpec] | None,
        messages: list[AnthropicMessage],
    ) -> None:
        """Hold a conversation under the id of its last reply."""
        self._entries.put(message_id, _Kept(system, tools, messages, self._clock()))

    def settle(self, previous: str, continued: bool) -> None:
        """End the continue from `previous`: served (it cannot be continued again) or not."""
        kept = self._entries.get(previous)
        if kept is None:
            return
        kept.in_flight = False
        if continued:
            # Only the mark is needed now: the conversation lives on under the new reply.
            kept.continued = True
            kept.messages = []
            kept.tools = None
            kept.system = None


class ThreadTurn:
    """A threaded request being served: the conversation the prompt is rendered from, kept
    with the reply once the reply is whole, or released if it never is."""

    def __init__(
        self,
        store: ThreadStore,
        previous: str | None,
        system: Any,
        tools: list[AnthropicToolSpec] | None,
        messages: list[AnthropicMessage],
    ) -> None:
        self._store = store
        self._previous = previous
        self._settled = False
        self.system = system
        self.tools = tools
        self.messages = messages

    def request(self, body: AnthropicMessagesRequest) -> AnthropicMessagesRequest:
        """`body` with the whole conversation, the thread's system prompt and tools."""
        return body.model_copy(
            update={"system": self.system, "tools": self.tools, "messages": self.messages}
        )

    def keep(self, message_id: str, content: list[dict[str, Any]]) -> None:
        """Keep the conversation with the reply `content` under `message_id`. A reply that
        continues a final assistant message (the API's prefill) extends it."""
        if self._settled:
            return
        self._settled = True
        messages = list(self.messages)
        last = messages[-1] if messages else None
        if last is not None and last.role == "assistant":
            earlier = last.model_dump()["content"]
            if isinstance(earlier, str):
                earlier = [{"type": "text", "text": earlier}]
            content = [*earlier, *content]
            messages.pop()
        messages.append(AnthropicMessage.model_validate({"role": "assistant", "content": content}))
        self._store.keep(message_id, self.system, self.tools, messages)
        if self._previous is not None:
            self._store.settle(self._previous, continued=True)

    def release(self) -> None:
        """The turn ended without a whole reply: the reply it continued from may be continued
        again."""
        if self._settled:
            return
        self._settled = True
        if self._previous is not None:
            self._store.settle(self._previous, continued=False)
