"""The OpenAI Conversations API: conversations the server holds, whose items a response reads.

A conversation is a list of items (messages, function calls and their outputs, reasoning,
compactions), each with an id, created empty or with items, added to by `POST .../items` and by
every response whose request names it (`conversation`): the response is generated from the
conversation's items followed by its own input, and once it finishes its input and output items
are appended.
Conversations are kept in a bounded in-memory store (least recently used out); a restart
forgets them.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from inflight.server.errors import ServerError
from inflight.server.lru import Lru
from inflight.server.responses_protocol import (
    CompactionItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningItem,
)

# How many conversations the server keeps.
CAPACITY = 1024
# Items one request may add (the API's limit).
MAX_ITEMS = 20

_PREFIXES = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
    "compaction": "cmp",
}
_KEPT = (MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem, CompactionItem)


@dataclass
class Conversation:
    id: str
    created_at: int
    metadata: dict[str, str]
    items: list[dict[str, Any]] = field(default_factory=list)  # item objects, oldest first

    def as_object(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "conversation",
            "created_at": self.created_at,
            "metadata": self.metadata,
        }

    def add(self, items: list[dict[str, Any]]) -> None:
        self.items += items

    def find(self, item_id: str) -> dict[str, Any]:
        """The item `item_id` (a 404 where the conversation has none)."""
        found = next((item for item in self.items if item["id"] == item_id), None)
        if found is None:
            raise ServerError(404, f"conversation {self.id!r} has no item {item_id!r}", "item_id")
        return found


def item_object(item: Any, where: str) -> dict[str, Any]:
    """An input item as the conversation keeps and lists it: with an id (its own or a new one)
    and a status (but a compaction, which has none), a message's text as content parts; a 400
    for an item of another type."""
    if not isinstance(item, _KEPT):
        raise ServerError(
            400,
            f"items of type {getattr(item, 'type', None)!r} are not supported; this server keeps "
            "message, function_call, function_call_output, reasoning and compaction items",
            where,
        )
    kept = item.model_dump(exclude_none=True, by_alias=True)
    kept["type"] = item.type
    kept.setdefault("id", f"{_PREFIXES[item.type]}_{uuid.uuid4().hex}")
    if not isinstance(item, CompactionItem):
        kept.setdefault("status", "completed")
    if isinstance(item, MessageItem) and isinstance(item.content, str):
        part = "output_text" if item.role == "assistant" else "input_text"
        kept["content"] = [{"type": part, "text": item.content}]
    return kept


def item_objects(items: list[Any], where: str) -> list[dict[str, Any]]:
    """`item_object` of each of `items` (at most MAX_ITEMS: a 400 past it)."""
    if len(items) > MAX_ITEMS:
        raise ServerError(400, f"at most {MAX_ITEMS} items can be added at a time", where)
    return [item_object(item, f"{where}.{i}") for i, item in enumerate(items)]


class ConversationStore:
    """Conversations by id, at most `capacity`; the least recently used goes first."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._entries: Lru[Conversation] = Lru(capacity)

    def create(self, items: list[dict[str, Any]], metadata: dict[str, str]) -> Conversation:
        conversation = Conversation(f"conv_{uuid.uuid4().hex}", int(time.time()), metadata)
        conversation.add(items)
        self._entries.put(conversation.id, conversation)
        return conversation

    def get(self, conversation_id: str, param: str = "conversation_id") -> Conversation:
        """The conversation (a 404 naming `param` where none is kept under that id)."""
        conversation = self._entries.get(conversation_id)
        if conversation is None:
            raise ServerError(
                404,
                f"no conversation with id {conversation_id!r} (unknown, deleted, or evicted "
                f"from the server's store of {self._entries.capacity})",
                param,
            )
        return conversation

    def delete(self, conversation_id: str) -> None:
        self.get(conversation_id)
        self._entries.delete(conversation_id)


def item_page(
    items: list[dict[str, Any]], limit: int, order: str, after: str | None
) -> dict[str, Any]:
    """A page of `items` (oldest first) as the API lists them: `order` "desc" newest first,
    from the item after `after` (a 404 naming `after` where there is none), `limit` of them."""
    items = list(reversed(items)) if order == "desc" else list(items)
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if at is None:
            raise ServerError(404, f"no item {after!r} to list after", "after")
        items = items[at + 1 :]
    shown = items[:limit]
    return {
        "object": "list",
        "data": shown,
        "first_id": shown[0]["id"] if shown else None,
        "last_id": shown[-1]["id"] if shown else None,
        "has_more": len(items) > limit,
    }
