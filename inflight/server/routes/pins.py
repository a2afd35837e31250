"""Pinned prefixes of the context cache (`save_system_prompt_kv_cache`, warm-up prompts):
listed, and unpinned by id."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from inflight.server.errors import ServerError
from inflight.server.routes import READ
from inflight.server.state import State

router = APIRouter()


@router.api_route("/v1/pinned_prefixes", methods=READ)
async def pinned_prefixes(state: State) -> Response:
    """Each pinned prefix: its `id`, `tokens` and `hit_tokens` (prompt tokens later requests
    found in it)."""
    return JSONResponse({"object": "list", "data": state.client.llm.pinned_prefixes()})


@router.delete("/v1/pinned_prefixes/{prefix_id}")
async def unpin(prefix_id: str, state: State) -> Response:
    """Let a pinned prefix's KV go (cached, evictable again); 404 for an id not pinned."""
    try:
        state.client.llm.unpin(prefix_id)
    except ValueError as exc:
        raise ServerError(404, str(exc), "prefix_id") from exc
    return JSONResponse({"id": prefix_id, "unpinned": True})
