"""Compaction of a Responses conversation: the model writes a summary of the conversation,
returned as an opaque `compaction` item. Asked two ways: `POST /v1/responses/compact` (the
item after the conversation's user messages), or a `/v1/responses` request whose input ends
with a `compaction_trigger` item (the response's one output item; the Codex CLI's way on the
OpenAI provider when a session's context fills up). Sent back as input, the item stands in the
prompt for what it summarized, as a user message holding the summary.

The item's `encrypted_content` is this server's own encoding of the summary (not encrypted:
the client holds the conversation anyway); one written by another service is refused by name.
"""

from __future__ import annotations

import base64
import binascii
import time
import uuid
from typing import Any

from inflight.server.errors import ServerError

# What the model is asked, after the conversation, to write the summary.
SUMMARY_REQUEST = (
    "The conversation above is about to be cut short. Write a summary of it for whoever "
    "continues it without seeing it: the user's requests and goals, what has been done and "
    "found so far (files, commands, results, errors), the decisions made, and what remains to "
    "do. Write only the summary."
)
# How a compaction item's summary opens, where it stands in a later prompt.
SUMMARY_HEADER = "A summary of the conversation before this point:"
# The tokens a summary may take at most.
SUMMARY_MAX_TOKENS = 2048
_PREFIX = "inflight-compaction-v1:"


def encode(summary: str) -> str:
    """A summary as a compaction item's `encrypted_content`."""
    return _PREFIX + base64.b64encode(summary.encode()).decode()


def summary_of(content: str, where: str) -> str:
    """The summary a compaction item carries (a 400 naming `where` for one this server did
    not write)."""
    if content.startswith(_PREFIX):
        try:
            return base64.b64decode(content[len(_PREFIX) :], validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            pass
    raise ServerError(
        400,
        "this compaction item was not written by this server (its content is another "
        "service's, or altered): compact the conversation here (POST /v1/responses/compact)",
        where,
    )


def summary_message(content: str, where: str) -> dict[str, Any]:
    """The chat message a compaction item stands for in a prompt."""
    return {"role": "user", "content": f"{SUMMARY_HEADER}\n\n{summary_of(content, where)}"}


def item(summary: str | None, item_id: str | None = None) -> dict[str, Any]:
    """The compaction item of a summary (None: not yet written, its content empty; `item_id`:
    the id given it before)."""
    return {
        "id": item_id or f"cmp_{uuid.uuid4().hex}",
        "type": "compaction",
        "encrypted_content": "" if summary is None else encode(summary),
    }


def compacted(
    user_messages: list[dict[str, Any]], compaction: dict[str, Any], usage: dict[str, Any]
) -> dict[str, Any]:
    """The compacted response: the conversation's user messages, then the compaction item."""
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response.compaction",
        "created_at": int(time.time()),
        "output": [*user_messages, compaction],
        "usage": usage,
    }
