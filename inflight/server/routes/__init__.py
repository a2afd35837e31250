"""The server's routes, one router per API: OpenAI, Anthropic, and operations."""

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request

# The methods of a route that reads: HEAD wherever GET, as HTTP asks of a server (aiperf probes
# /metrics so); uvicorn sends a HEAD reply's headers without its body.
READ = ["GET", "HEAD"]


def app_store(name: str) -> Callable[[Request], Awaitable[Any]]:
    """A FastAPI dependency giving the store `build_app` put on the app as `name` (async, so
    that FastAPI runs it on the loop)."""

    async def store(request: Request) -> Any:
        return getattr(request.app.state, name)

    return store
