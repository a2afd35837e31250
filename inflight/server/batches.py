"""Batches: many requests run offline, as OpenAI's Batch API and Anthropic's Message Batches
API take them, by one runner.

Each request of a batch is posted, in process, to the server's own route (`POST
/v1/chat/completions`, `/v1/completions`, `/v1/responses`, `/v1/messages`), so that it is
validated and answered exactly as the same request sent alone would be. All batches together
run at most the engine's batch size of requests at once: enough to keep a batch full under
in-flight batching (a request joins as another leaves), while the admission gate keeps room for
requests sent directly; a 429 all the same (the gate full of those) is retried.

A cancel runs none of the requests not started and cancels those running the way a client that
goes away cancels its request; what finished is kept. A server that closes its admission gate
(a shutdown) starts no more requests either, and its drain waits only for those running, as for
any request. A batch still running past its 24-hour window runs no more requests: expired.
Batches are kept in memory, at most CAPACITY (the oldest ended batch goes first); a restart
forgets them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from starlette.types import ASGIApp, Message

from inflight.server.client import EngineClient
from inflight.server.errors import ServerError, error_response
from inflight.server.files import FileStore

log = logging.getLogger(__name__)

# How many batches the server keeps.
CAPACITY = 1024
# The completion window, "24h": the only one either API offers.
WINDOW = 24 * 3600
# The most requests one batch may hold (OpenAI's and Anthropic's limits).
MAX_OPENAI_REQUESTS = 50_000
MAX_ANTHROPIC_REQUESTS = 100_000
# The most input-file errors a failed batch reports (a file of bad lines gives one a line).
MAX_REPORTED_ERRORS = 100
# The longest wait before a request refused with a 429 is sent again.
_RETRY_MAX = 1.0

ENDED = ("completed", "failed", "expired", "cancelled")


@dataclass
class Line:
    """One request of a batch and, once it ran, the route's answer."""

    custom_id: str
    body: dict[str, Any]
    status_code: int | None = None  # None: not run (yet, or ever: cancelled or expired)
    response: Any = None  # the answer's JSON body
    request_id: str = ""
    stop: asyncio.Event | None = None  # set to cancel the request while it runs

    @property
    def succeeded(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


# The usage fields of chat and completions answers, and those of the Responses API's.
_CHAT_USAGE = (
    "prompt_tokens",
    "completion_tokens",
    "prompt_tokens_details",
    "completion_tokens_details",
)
_RESPONSES_USAGE = (
    "input_tokens",
    "output_tokens",
    "input_tokens_details",
    "output_tokens_details",
)


@dataclass
class BatchUsage:
    """The tokens of a batch's answers, whichever endpoint's usage fields they come in."""

    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0

    def add(self, answer: Any) -> None:
        """Count an answer's usage: chat and completions' `prompt_tokens` and
        `completion_tokens`, or the Responses API's `input_tokens` and `output_tokens`."""
        usage = answer.get("usage") if isinstance(answer, dict) else None
        if not isinstance(usage, dict):
            return
        names = _CHAT_USAGE if "prompt_tokens" in usage else _RESPONSES_USAGE
        inputs, outputs, input_details, output_details = (usage.get(n) for n in names)
        self.input_tokens += inputs or 0
        self.output_tokens += outputs or 0
        self.cached_tokens += (input_details or {}).get("cached_tokens") or 0
        self.reasoning_tokens += (output_details or {}).get("reasoning_tokens") or 0

    def as_object(self) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": self.input_tokens + self.output_tokens,
        }


@dataclass
class Batch:
    """A batch of either API. `status` takes OpenAI's names (validating, in_progress,
    finalizing, completed, failed, expired, cancelling, cancelled); `times` holds when each
    was reached. An Anthropic batch is never validating (its requests are checked as they
    run) nor finalizing (it writes no files)."""

    id: str
    api: str  # "openai" or "anthropic"
    endpoint: str  # the route its requests are posted to
    lines: list[Line]
    status: str
    created_at: float = field(default_factory=time.time)
    times: dict[str, float] = field(default_factory=dict)
    cancel_asked: bool = False
    expired: bool = False
    task: asyncio.Task[None] | None = None
    # OpenAI's: the input file (its content until it is read), what the batch was created with,
    # what validating the input found wrong, and the files the batch wrote.
    input_file_id: str | None = None
    input: bytes = b""
    metadata: dict[str, str] | None = None
    output_expires_after: int | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)
    output_file_id: str | None = None
    error_file_id: str | None = None
    # The tokens its answered requests used, as OpenAI's batch `usage` counts them: added as
    # each answer comes (a poll of a large batch reads no lines).
    usage: BatchUsage = field(default_factory=BatchUsage)

    @property
    def ended(self) -> bool:
        return self.status in ENDED

    @property
    def expires_at(self) -> float:
        return self.created_at + WINDOW

    def reach(self, status: str) -> None:
        self.status = status
        self.times[status] = time.time()

    def result_type(self, line: Line) -> str:
        """How a request ended, in Anthropic's words."""
        if line.status_code is not None:
            return "succeeded" if line.succeeded else "errored"
        if self.status == "failed":
            return "errored"
        return "expired" if self.expired else "canceled"


# -- reading an OpenAI batch's input file ------------------------------------------------------


def read_openai_input(content: bytes, endpoint: str) -> tuple[list[Line], list[dict[str, Any]]]:
    """The requests of an input file, or the errors of its lines (1-based line numbers).

    Like OpenAI, a file with any bad line is not run at all: the batch fails with its errors
    (the create request itself succeeds, as the file is read after it, while validating), so
    that a fixed file can be sent whole rather than its good half being run and billed."""
    lines: list[Line] = []
    errors: list[dict[str, Any]] = []
    seen: dict[str, int] = {}

    def error(number: int | None, code: str, message: str, param: str | None = None) -> None:
        errors.append({"code": code, "message": message, "param": param, "line": number})

    for number, raw in enumerate(content.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            request = json.loads(raw)
        except ValueError:
            error(number, "invalid_json_line", f"line {number} is not valid JSON")
            continue
        if not isinstance(request, dict):
            error(number, "invalid_json_line", f"line {number} is not a JSON object")
            continue
        missing = [k for k in ("custom_id", "method", "url", "body") if k not in request]
        custom_id, url = request.get("custom_id"), request.get("url")
        if missing:
            error(
                number,
                "missing_required_parameter",
                f"line {number} has no {missing[0]!r}: each line holds custom_id, method, url "
                "and body",
                missing[0],
            )
        elif not isinstance(custom_id, str) or not custom_id:
            error(number, "invalid_request", f"line {number}: custom_id is a string", "custom_id")
        elif custom_id in seen:
            error(
                number,
                "duplicate_custom_id",
                f"line {number}: custom_id {custom_id!r} is line {seen[custom_id]}'s too; each "
                "request of a batch has its own",
                "custom_id",
            )
        elif request["method"] != "POST":
            method = request["method"]
            message = f"line {number}: method {method!r} is not POST"
            error(number, "invalid_request", message, "method")
        elif not isinstance(url, str) or _path(url) != endpoint:
            error(
                number,
                "invalid_url",
                f"line {number}: url {url!r} is not the batch's endpoint {endpoint!r}",
                "url",
            )
        elif not isinstance(request["body"], dict):
            error(number, "invalid_request", f"line {number}: body is a JSON object", "body")
        else:
            seen[custom_id] = number
            lines.append(Line(custom_id, request["body"]))
    if not lines and not errors:
        error(None, "empty_file", "the input file holds no requests")
    if len(lines) > MAX_OPENAI_REQUESTS:
        error(
            None,
            "too_many_tasks",
            f"the input file holds {len(lines)} requests; a batch holds at most "
            f"{MAX_OPENAI_REQUESTS}",
        )
    return lines, errors


def _path(url: str) -> str:
    return "/" + url.lstrip("/")


# -- the batches and their runner --------------------------------------------------------------


class BatchStore:
    """The batches of both APIs by id (at most `capacity`), and the runner of their requests:
    `app` is the server's own app, whose routes answer them."""

    def __init__(
        self,
        app: ASGIApp,
        client: EngineClient,
        files: FileStore,
        api_key: str | None,
        capacity: int = CAPACITY,
    ) -> None:
        self.capacity = capacity
        self._app = app
        self._client = client
        self._files = files
        self._headers = [(b"content-type", b"application/json")]
        if api_key:  # the routes behind the API key check it on these requests too
            self._headers.append((b"authorization", f"Bearer {api_key}".encode()))
        self._concurrency = client.gate.batch
        # Shared by every batch: requests of batches running at once.
        self._slots = asyncio.Semaphore(self._concurrency)
        self._batches: dict[str, Batch] = {}  # oldest first

    def start(self, batch: Batch) -> None:
        """Keep `batch` and start running it; a 429 where the store is full of running ones,
        a 503 while the server shuts down (it would run none of its requests)."""
        if self._client.gate.closing:
            raise ServerError(503, "server is shutting down")
        if len(self._batches) >= self.capacity:
            oldest = next((b for b in self._batches.values() if b.ended), None)
            if oldest is None:
                raise ServerError(
                    429, f"{self.capacity} batches are running, as many as this server keeps"
                )
            del self._batches[oldest.id]
        self._batches[batch.id] = batch
        batch.times[batch.status] = batch.created_at
        batch.task = asyncio.create_task(self._run(batch))

    def get(self, batch_id: str, api: str) -> Batch:
        """The batch of `api` (a 404 naming the id where none is kept)."""
        batch = self._batches.get(batch_id)
        if batch is None or batch.api != api:
            raise ServerError(
                404,
                f"no batch with id {batch_id!r} (unknown, deleted, or evicted from the "
                f"server's store of {self.capacity})",
                "batch_id",
            )
        return batch

    def listed(self, api: str) -> list[Batch]:
        """The batches of `api`, oldest first."""
        return [b for b in self._batches.values() if b.api == api]

    def delete(self, batch: Batch) -> None:
        del self._batches[batch.id]

    def cancel(self, batch: Batch) -> None:
        """Start none of its requests still waiting, and cancel those running; the batch ends
        cancelled once they have stopped (at once for those, a step or two for these)."""
        if batch.ended or batch.cancel_asked:
            return
        batch.cancel_asked = True
        batch.reach("cancelling")
        for line in batch.lines:
            if line.stop is not None:
                line.stop.set()

    # -- running ---------------------------------------------------------------------------------

    async def _run(self, batch: Batch) -> None:
        try:
            if batch.status == "validating":
                read = await asyncio.to_thread(read_openai_input, batch.input, batch.endpoint)
                batch.input = b""
                batch.lines, errors = read
                if errors:
                    batch.lines = []
                    batch.errors = errors[:MAX_REPORTED_ERRORS]
                    batch.reach("failed")
                    return
                if not batch.cancel_asked:
                    batch.reach("in_progress")
            pending = iter(batch.lines)
            workers = [self._work(batch, pending) for _ in range(self._concurrency)]
            await asyncio.gather(*workers)
            stopped = batch.cancel_asked or self._client.gate.closing
            if batch.api == "openai":
                if not stopped:
                    batch.reach("finalizing")
                self._write_files(batch)
            if stopped:
                batch.reach("cancelled")
            else:
                batch.reach("expired" if batch.expired else "completed")
        except Exception:
            log.exception("batch %s failed", batch.id)
            message = "the batch failed on an internal error (the server's log says which)"
            batch.errors = [{"code": "internal_error", "message": message, "param": None}]
            batch.reach("failed")

    async def _work(self, batch: Batch, pending: Iterator[Line]) -> None:
        """Run the batch's requests one after another, while it may run more."""
        for line in pending:
            async with self._slots:
                if self._halted(batch):
                    return
                await self._answer(batch, line)

    def _halted(self, batch: Batch) -> bool:
        if batch.cancel_asked or self._client.gate.closing:
            return True
        if time.time() >= batch.expires_at:
            batch.expired = True
        return batch.expired

    async def _answer(self, batch: Batch, line: Line) -> None:
        """Run one request: its answer in `line`, none where it was cancelled first."""
        anthropic = batch.api == "anthropic"
        refusal = _refusal(batch, line.body)
        if refusal is not None:
            line.request_id = f"req_{uuid.uuid4().hex}"
            line.status_code, line.response = refusal.status, _error_body(refusal, anthropic)
            return
        body = json.dumps(line.body).encode()
        wait = 0.05
        while True:
            line.request_id = f"req_{uuid.uuid4().hex}"
            line.stop = asyncio.Event()
            try:
                status, answer = await call_route(
                    self._app, batch.endpoint, body, self._headers, line.stop
                )
            except Exception as exc:  # the app's handler answered and logged it already
                error = ServerError(500, f"internal server error: {type(exc).__name__}")
                status, answer = 500, _error_body(error, anthropic)
            if status not in (429, 529):  # 529: Anthropic's name for the gate's 429
                break
            await asyncio.sleep(wait)  # the gate full of requests sent directly: wait for room
            wait = min(2 * wait, _RETRY_MAX)
            if self._halted(batch):
                return
        # 499: cancelled by the batch's cancel (the route's "client disconnected"); 503 while
        # the gate is closing: refused or cancelled by the shutdown. Neither is an answer.
        if status == 499 and line.stop.is_set():
            return
        if status == 503 and self._client.gate.closing:
            return
        line.status_code, line.response = status, answer
        if line.succeeded:
            batch.usage.add(answer)

    def _write_files(self, batch: Batch) -> None:
        """OpenAI's output file (the requests answered 2xx) and error file (the others, and
        those the batch's window expired before they ran), each only where it has lines."""
        output: list[dict[str, Any]] = []
        errors: list[dict[str, Any]] = []
        for line in batch.lines:
            entry = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id}
            if line.status_code is not None:
                response = {
                    "status_code": line.status_code,
                    "request_id": line.request_id,
                    "body": line.response,
                }
                (output if line.succeeded else errors).append(
                    {**entry, "response": response, "error": None}
                )
            elif batch.expired:
                error = {
                    "code": "batch_expired",
                    "message": "the request was not run before the batch's completion window "
                    "expired",
                }
                errors.append({**entry, "response": None, "error": error})
        for kept, kind in ((output, "output"), (errors, "error")):
            if not kept:
                continue
            content = "".join(json.dumps(e) + "\n" for e in kept).encode()
            name = f"{batch.id}_{kind}.jsonl"
            written = self._files.add(
                content, name, "batch_output", batch.output_expires_after, written=True
            )
            if kind == "output":
                batch.output_file_id = written.id
            else:
                batch.error_file_id = written.id


def _refusal(batch: Batch, body: dict[str, Any]) -> ServerError | None:
    """What a batch cannot run that its route would: a stream (nobody reads it) or a background
    response (nobody polls it)."""
    if body.get("stream"):
        return ServerError(
            400, "stream is not served inside a batch: its requests are answered whole", "stream"
        )
    if batch.endpoint == "/v1/responses" and body.get("background"):
        return ServerError(
            400,
            "background is not served inside a batch: the batch is itself run in the background",
            "background",
        )
    return None


def _error_body(error: ServerError, anthropic: bool) -> Any:
    return json.loads(error_response(error, anthropic).body)


async def call_route(
    app: ASGIApp,
    path: str,
    body: bytes,
    headers: list[tuple[bytes, bytes]],
    stop: asyncio.Event,
) -> tuple[int, Any]:
    """POST `body` to `path` on `app`, in process (middleware, validation and error bodies
    as over HTTP): its status and JSON body. Once `stop` is set the route finds its client gone,
    which cancels its generation inside the engine as an HTTP client's leaving does (cancelling
    the task instead would leave the engine's request running to its end: httpx's ASGI
    transport has no other way to tell the route, hence this small call of our own)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [*headers, (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }
    sent_body = False
    status = 500
    chunks: list[bytes] = []

    async def receive() -> Message:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await stop.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    try:
        await app(scope, receive, send)
    except Exception:
        # Starlette raises again an error it answered with a 500 (for the server to log).
        if not chunks:
            raise
    text = b"".join(chunks)
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text.decode(errors="replace")


# -- the objects of both APIs ------------------------------------------------------------------


def openai_object(batch: Batch) -> dict[str, Any]:
    """The batch as OpenAI's Batch object."""

    def at(status: str) -> int | None:
        when = batch.times.get(status)
        return None if when is None else int(when)

    answered = [line for line in batch.lines if line.status_code is not None]
    succeeded = sum(line.succeeded for line in answered)
    failed = len(answered) - succeeded
    if batch.expired:  # those not run are in the error file too
        failed += len(batch.lines) - len(answered)
    model = next((line.body.get("model") for line in batch.lines), None)
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "model": model if isinstance(model, str) else None,
        "errors": {"object": "list", "data": batch.errors} if batch.errors else None,
        "input_file_id": batch.input_file_id,
        "completion_window": "24h",
        "status": batch.status,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "created_at": int(batch.created_at),
        "in_progress_at": at("in_progress"),
        "expires_at": int(batch.expires_at),
        "finalizing_at": at("finalizing"),
        "completed_at": at("completed"),
        "failed_at": at("failed"),
        "expired_at": at("expired"),
        "cancelling_at": at("cancelling"),
        "cancelled_at": at("cancelled"),
        "request_counts": {
            "total": len(batch.lines),
            "completed": succeeded,
            "failed": failed,
        },
        "usage": batch.usage.as_object(),
        "metadata": batch.metadata,
    }


def anthropic_object(batch: Batch, results_url: str) -> dict[str, Any]:
    """The batch as Anthropic's Message Batch object; `results_url` given once it has ended.
    As Anthropic's, the request counts are all `processing` until then."""
    counts = dict.fromkeys(("processing", "succeeded", "errored", "canceled", "expired"), 0)
    ended_at = None
    if batch.ended:
        for line in batch.lines:
            counts[batch.result_type(line)] += 1
        ended_at = batch.times[batch.status]
        status = "ended"
    else:
        counts["processing"] = len(batch.lines)
        status = "canceling" if batch.cancel_asked else "in_progress"
    return {
        "id": batch.id,
        "type": "message_batch",
        "processing_status": status,
        "request_counts": counts,
        "ended_at": _rfc3339(ended_at),
        "created_at": _rfc3339(batch.created_at),
        "expires_at": _rfc3339(batch.expires_at),
        "archived_at": None,
        "cancel_initiated_at": _rfc3339(batch.times.get("cancelling")),
        "results_url": results_url if batch.ended else None,
    }


def anthropic_results(batch: Batch) -> list[dict[str, Any]]:
    """The lines of an ended batch's results file, in the order of its requests."""
    out = []
    for line in batch.lines:
        kind = batch.result_type(line)
        result: dict[str, Any] = {"type": kind}
        if kind == "succeeded":
            result["message"] = line.response
        elif kind == "errored":
            result["error"] = line.response or _error_body(
                ServerError(500, "the batch failed before this request ran"), True
            )
        out.append({"custom_id": line.custom_id, "result": result})
    return out


def _rfc3339(when: float | None) -> str | None:
    if when is None:
        return None
    return datetime.fromtimestamp(when, UTC).isoformat().replace("+00:00", "Z")
