"""Offline jobs: OpenAI's Files and Batch APIs and Anthropic's Message Batches API, run by the
one batch runner (`batches.py`) through the server's own routes; files in `files.py`."""

from __future__ import annotations

import asyncio
import json
import uuid
from email import policy
from email.message import Message
from email.parser import BytesHeaderParser
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from pydantic import Field

from inflight.server.batches import (
    MAX_ANTHROPIC_REQUESTS,
    Batch,
    BatchStore,
    Line,
    anthropic_object,
    anthropic_results,
    openai_object,
)
from inflight.server.conversations import item_page
from inflight.server.errors import ServerError
from inflight.server.files import (
    BATCH_FILE_SECONDS,
    EXPIRY_RANGE,
    FileStore,
    check_purpose,
)
from inflight.server.protocol import Strict
from inflight.server.routes import READ, app_store

router = APIRouter()

Files = Annotated[FileStore, Depends(app_store("files"))]
Batches = Annotated[BatchStore, Depends(app_store("batches"))]

# The endpoints an OpenAI batch may run: those of OpenAI's list this server serves.
OPENAI_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")

# -- files -------------------------------------------------------------------------------------


def _openai_files(request: Request) -> None:
    """The file routes serve OpenAI's Files API. Anthropic's Files API has the same paths and
    other objects (its SDKs' `beta.files`, litellm's Anthropic files): told by the
    `anthropic-version` header its clients send, it is refused by name rather than answered
    with objects its clients cannot read."""
    if "anthropic-version" in request.headers:
        raise ServerError(
            400,
            "Anthropic's Files API is not served (its files feed the Messages API's document "
            "and image blocks by file_id, which this server does not take); /v1/files here is "
            "OpenAI's Files API, for the input and output files of OpenAI batches",
        )


_FILES_API = [Depends(_openai_files)]


@router.post("/v1/files", dependencies=_FILES_API)
async def upload_file(request: Request, files: Files) -> dict[str, Any]:
    """A file from a multipart form: `file`, `purpose`, and optionally `expires_after[anchor]`
    and `expires_after[seconds]` (as the OpenAI SDKs send `expires_after`)."""
    kind = request.headers.get("content-type", "")
    if not kind.startswith("multipart/form-data"):
        raise ServerError(
            400, "POST /v1/files takes a multipart/form-data body (file, purpose)", "file"
        )
    form = await asyncio.to_thread(_form, kind, await request.body())
    purpose = check_purpose(_text(form, "purpose"))
    filename, content = form.get("file", (None, b""))
    if filename is None:
        raise ServerError(400, "file is required: the file as a form part with a filename", "file")
    expires_after = _expires_after(form)
    if expires_after is None and purpose == "batch":
        expires_after = BATCH_FILE_SECONDS
    return files.add(content, filename, purpose, expires_after).as_object()


def _form(kind: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """A multipart form's parts by name: each its filename (None for a plain field) and its
    content. Split at its boundaries here, each part's headers read by the standard library's
    header parser (python-multipart, which FastAPI's own forms need, is no dependency of this
    package): a part's content is copied once, where the email package's parser of the whole
    body took seven times a file's size and a second for each 35 MB."""
    header = Message()
    header["content-type"] = kind
    boundary = header.get_param("boundary")
    if not isinstance(boundary, str) or not boundary:
        raise ServerError(400, "the multipart form has no boundary", "file")
    unreadable = ServerError(400, "the multipart form could not be read", "file")
    dash = b"--" + boundary.encode("latin-1")
    delimiter = b"\r\n" + dash  # each delimiter after the first ends the part before it
    at = 0 if body.startswith(dash) else body.find(delimiter) + 2  # where "--boundary" starts
    if at < 2 and not body.startswith(dash):
        raise unreadable
    parts: dict[str, tuple[str | None, bytes]] = {}
    while not body.startswith(b"--", at + len(dash)):  # up to the closing delimiter
        start = body.find(b"\r\n", at + len(dash)) + 2  # the part's headers
        headers_end = body.find(b"\r\n\r\n", start - 2) if start >= 2 else -1
        end = body.find(delimiter, headers_end + 4) if headers_end >= 0 else -1
        if end < 0:
            raise unreadable
        part = _HEADERS.parsebytes(body[start : headers_end + 4])
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str):
            parts[name] = (part.get_filename(), body[headers_end + 4 : end])
        at = end + 2
    return parts


_HEADERS = BytesHeaderParser(policy=policy.HTTP)


def _text(form: dict[str, tuple[str | None, bytes]], name: str) -> str | None:
    part = form.get(name)
    return None if part is None else part[1].decode(errors="replace")


def _expires_after(form: dict[str, tuple[str | None, bytes]]) -> int | None:
    anchor, seconds = _text(form, "expires_after[anchor]"), _text(form, "expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise ServerError(400, "expires_after.anchor is 'created_at'", "expires_after.anchor")
    low, high = EXPIRY_RANGE
    if seconds is None or not seconds.isdigit() or not low <= int(seconds) <= high:
        raise ServerError(
            400,
            f"expires_after.seconds is a whole number of seconds from {low} to {high}",
            "expires_after.seconds",
        )
    return int(seconds)


@router.api_route("/v1/files", methods=READ, dependencies=_FILES_API)
async def list_files(
    files: Files,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> dict[str, Any]:
    return files.page(purpose, limit, order, after)


@router.api_route("/v1/files/{file_id}", methods=READ, dependencies=_FILES_API)
async def retrieve_file(file_id: str, files: Files) -> dict[str, Any]:
    return files.get(file_id).as_object()


@router.api_route("/v1/files/{file_id}/content", methods=READ, dependencies=_FILES_API)
async def file_content(file_id: str, files: Files) -> Response:
    return Response(files.get(file_id).content, media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}", dependencies=_FILES_API)
async def delete_file(file_id: str, files: Files) -> dict[str, Any]:
    files.delete(file_id)
    return {"id": file_id, "object": "file", "deleted": True}


# -- OpenAI batches ----------------------------------------------------------------------------


class ExpiresAfter(Strict):
    anchor: Literal["created_at"]
    seconds: Annotated[int, Field(ge=EXPIRY_RANGE[0], le=EXPIRY_RANGE[1])]


class BatchCreate(Strict):
    """POST /v1/batches."""

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: (
        Annotated[
            dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
            Field(max_length=16),
        ]
        | None
    ) = None
    output_expires_after: ExpiresAfter | None = None


@router.post("/v1/batches")
async def create_batch(body: BatchCreate, files: Files, batches: Batches) -> dict[str, Any]:
    """Answered at once as validating: the input file is read after (a bad line fails the
    batch, its errors naming the line)."""
    if body.endpoint not in OPENAI_ENDPOINTS:
        raise ServerError(
            400,
            f"endpoint {body.endpoint!r} is not served in a batch here; served: "
            + ", ".join(OPENAI_ENDPOINTS),
            "endpoint",
        )
    if body.completion_window != "24h":
        raise ServerError(400, "completion_window is '24h', the only window", "completion_window")
    stored = files.get(body.input_file_id, "input_file_id")
    if stored.purpose != "batch":
        raise ServerError(
            400,
            f"file {stored.id!r} has purpose {stored.purpose!r}; a batch reads a file uploaded "
            "with purpose 'batch'",
            "input_file_id",
        )
    expires = body.output_expires_after
    batch = Batch(
        f"batch_{uuid.uuid4().hex}",
        "openai",
        body.endpoint,
        [],
        "validating",
        input_file_id=stored.id,
        input=stored.content,
        metadata=body.metadata,
        output_expires_after=None if expires is None else expires.seconds,
    )
    batches.start(batch)
    return openai_object(batch)


@router.api_route("/v1/batches", methods=READ)
async def list_batches(
    batches: Batches,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: str | None = None,
) -> dict[str, Any]:
    """The batches, newest first."""
    listed = [openai_object(b) for b in batches.listed("openai")]
    return item_page(listed, limit, "desc", after)


@router.api_route("/v1/batches/{batch_id}", methods=READ)
async def retrieve_batch(batch_id: str, batches: Batches) -> dict[str, Any]:
    return openai_object(batches.get(batch_id, "openai"))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, batches: Batches) -> dict[str, Any]:
    """The batch cancelling (cancelled once its running requests stopped); one that ended is
    returned as it is."""
    batch = batches.get(batch_id, "openai")
    batches.cancel(batch)
    return openai_object(batch)


# -- Anthropic message batches -----------------------------------------------------------------


class MessageBatchRequest(Strict):
    custom_id: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    params: dict[str, Any]  # a /v1/messages body, checked by that route as the request runs


class MessageBatchCreate(Strict):
    """POST /v1/messages/batches."""

    requests: Annotated[
        list[MessageBatchRequest], Field(min_length=1, max_length=MAX_ANTHROPIC_REQUESTS)
    ]


@router.post("/v1/messages/batches")
async def create_message_batch(
    body: MessageBatchCreate, request: Request, batches: Batches
) -> dict[str, Any]:
    seen: dict[str, int] = {}
    for i, item in enumerate(body.requests):
        if item.custom_id in seen:
            raise ServerError(
                400,
                f"requests.{i}.custom_id: {item.custom_id!r} is requests.{seen[item.custom_id]}'s "
                "too; each request of a batch has its own",
                f"requests.{i}.custom_id",
            )
        seen[item.custom_id] = i
    lines = [Line(item.custom_id, item.params) for item in body.requests]
    batch = Batch(f"msgbatch_{uuid.uuid4().hex}", "anthropic", "/v1/messages", lines, "in_progress")
    batches.start(batch)
    return anthropic_object(batch, _results_url(request, batch))


@router.api_route("/v1/messages/batches", methods=READ)
async def list_message_batches(
    request: Request,
    batches: Batches,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
    after_id: str | None = None,
    before_id: str | None = None,
) -> dict[str, Any]:
    """The batches, newest first: `limit` of them after `after_id` or before `before_id`."""
    if after_id is not None and before_id is not None:
        raise ServerError(400, "send after_id or before_id, not both", "after_id")
    newest = [anthropic_object(b, _results_url(request, b)) for b in batches.listed("anthropic")]
    newest.reverse()
    ids = [b["id"] for b in newest]
    cursor = after_id if after_id is not None else before_id
    if cursor is not None and cursor not in ids:
        raise ServerError(404, f"no message batch {cursor!r} to list from", "after_id")
    if after_id is not None:
        rest = newest[ids.index(after_id) + 1 :]
        shown = rest[:limit]
    elif before_id is not None:
        rest = newest[: ids.index(before_id)]
        shown = rest[-limit:]
    else:
        rest = newest
        shown = rest[:limit]
    return {
        "data": shown,
        "has_more": len(rest) > limit,
        "first_id": shown[0]["id"] if shown else None,
        "last_id": shown[-1]["id"] if shown else None,
    }


@router.api_route("/v1/messages/batches/{batch_id}", methods=READ)
async def retrieve_message_batch(
    batch_id: str, request: Request, batches: Batches
) -> dict[str, Any]:
    batch = batches.get(batch_id, "anthropic")
    return anthropic_object(batch, _results_url(request, batch))


@router.post("/v1/messages/batches/{batch_id}/cancel")
async def cancel_message_batch(batch_id: str, request: Request, batches: Batches) -> dict[str, Any]:
    """The batch canceling (ended once its running requests stopped); one that ended is
    returned as it is."""
    batch = batches.get(batch_id, "anthropic")
    batches.cancel(batch)
    return anthropic_object(batch, _results_url(request, batch))


@router.delete("/v1/messages/batches/{batch_id}")
async def delete_message_batch(batch_id: str, batches: Batches) -> dict[str, Any]:
    batch = batches.get(batch_id, "anthropic")
    if not batch.ended:
        raise ServerError(
            400,
            f"message batch {batch_id!r} is still processing: cancel it first, then delete it "
            "once it has ended",
        )
    batches.delete(batch)
    return {"id": batch_id, "type": "message_batch_deleted"}


@router.api_route("/v1/messages/batches/{batch_id}/results", methods=READ)
async def message_batch_results(batch_id: str, batches: Batches) -> Response:
    """The results, a JSON line per request, once the batch has ended."""
    batch = batches.get(batch_id, "anthropic")
    if not batch.ended:
        raise ServerError(
            400, f"message batch {batch_id!r} is still processing: its results come once ended"
        )
    text = "".join(json.dumps(r) + "\n" for r in anthropic_results(batch))
    return Response(text, media_type="application/x-jsonl")


def _results_url(request: Request, batch: Batch) -> str:
    """Where the batch's results are read: an absolute URL, which Anthropic's SDKs follow."""
    return f"{request.base_url}v1/messages/batches/{batch.id}/results"
