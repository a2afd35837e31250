"""OpenAI Conversations API routes: conversations and their items (conversations.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query

from inflight.server.conversations import ConversationStore, item_objects, item_page
from inflight.server.responses_protocol import (
    ConversationCreate,
    ConversationItemsCreate,
    ConversationUpdate,
)
from inflight.server.routes import READ, app_store

router = APIRouter()


Conversations = Annotated[ConversationStore, Depends(app_store("conversations"))]


@router.post("/v1/conversations")
async def create_conversation(
    body: ConversationCreate, conversations: Conversations
) -> dict[str, Any]:
    items = item_objects(body.items or [], "items")
    return conversations.create(items, body.metadata or {}).as_object()


@router.api_route("/v1/conversations/{conversation_id}", methods=READ)
async def retrieve_conversation(
    conversation_id: str, conversations: Conversations
) -> dict[str, Any]:
    return conversations.get(conversation_id).as_object()


@router.post("/v1/conversations/{conversation_id}")
async def update_conversation(
    conversation_id: str, body: ConversationUpdate, conversations: Conversations
) -> dict[str, Any]:
    conversation = conversations.get(conversation_id)
    conversation.metadata = body.metadata
    return conversation.as_object()


@router.delete("/v1/conversations/{conversation_id}")
async def delete_conversation(conversation_id: str, conversations: Conversations) -> dict[str, Any]:
    conversations.delete(conversation_id)
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


class PageQuery:
    """The query of a listing of items: `limit` of them in `order` after the item `after`."""

    def __init__(
        self,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
        # Which extra fields items carry (logprobs, say): these items carry what is kept.
        include: Annotated[list[str] | None, Query()] = None,
    ) -> None:
        self.limit, self.order, self.after = limit, order, after

    def page(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        return item_page(items, self.limit, self.order, self.after)


Page = Annotated[PageQuery, Depends()]


@router.api_route("/v1/conversations/{conversation_id}/items", methods=READ)
async def list_items(
    conversation_id: str, conversations: Conversations, page: Page
) -> dict[str, Any]:
    return page.page(conversations.get(conversation_id).items)


@router.post("/v1/conversations/{conversation_id}/items")
async def create_items(
    conversation_id: str, body: ConversationItemsCreate, conversations: Conversations
) -> dict[str, Any]:
    conversation = conversations.get(conversation_id)
    items = item_objects(body.items, "items")
    conversation.add(items)
    return item_page(items, len(items) or 1, "asc", None)


@router.api_route("/v1/conversations/{conversation_id}/items/{item_id}", methods=READ)
async def retrieve_item(
    conversation_id: str, item_id: str, conversations: Conversations
) -> dict[str, Any]:
    return conversations.get(conversation_id).find(item_id)


@router.delete("/v1/conversations/{conversation_id}/items/{item_id}")
async def delete_item(
    conversation_id: str, item_id: str, conversations: Conversations
) -> dict[str, Any]:
    conversation = conversations.get(conversation_id)
    conversation.items.remove(conversation.find(item_id))
    return conversation.as_object()
