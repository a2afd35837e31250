"""A real uvicorn server on loopback, in a background thread, for the server tests."""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import uvicorn

from inflight.bench.online import free_port
from inflight.server.app import ServerSettings, build_app
from inflight.server.client import EngineClient
from inflight.server.metrics import ServerMetrics
from inflight.server.serving import Server


@dataclass
class Running:
    url: str
    client: EngineClient
    server: Server
    thread: threading.Thread
    exit_status: list[int] = field(default_factory=list)  # set once the server has stopped


@contextmanager
def running(
    llm,
    *,
    max_queued_requests=None,
    queue_timeout=30.0,
    max_input_len=None,
    api_key=None,
    lifespan="off",
    name="test-model",
    aliases=(),
    max_body_bytes=8 * 1024 * 1024,
    shutdown_timeout=30.0,
    **chat,
):
    """Serve `llm` as `inflight serve` does (`serving.Server`), in a background thread. With
    lifespan "off" the LLM outlives the server. `chat`: the chat settings of `ServerSettings`
    (chat_template, tool_call_parser, reasoning_parser), as the command line's flags set them.
    `max_queued_requests`: the LLM's own by default, as `inflight serve` has it."""
    client = EngineClient(
        llm,
        max_queued_requests=(
            llm.max_queued_requests if max_queued_requests is None else max_queued_requests
        ),
        queue_timeout=queue_timeout,
        max_input_len=max_input_len,
        metrics=ServerMetrics(llm),
    )
    settings = ServerSettings(
        served_model_name=name,
        model_aliases=aliases,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        **chat,
    )
    app = build_app(client, settings)
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", lifespan=lifespan
    )
    server = Server(config, client, shutdown_timeout)
    handle = Running(f"http://127.0.0.1:{port}", client, server, threading.Thread())
    handle.thread = threading.Thread(
        target=lambda: handle.exit_status.append(asyncio.run(server.run_until_stopped())),
        daemon=True,
    )
    handle.thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield handle
    finally:
        server.should_exit = True
        handle.thread.join(timeout=60)


@contextmanager
def serve(llm, **options):
    """Serve `llm` (see `running`); yields the base URL and the engine client."""
    with running(llm, **options) as handle:
        yield handle.url, handle.client


def prompt_of(usage) -> int:
    """An Anthropic message's prompt tokens: its `input_tokens` leave out those read from the
    context cache, as Anthropic's do (none are written to a cache on request)."""
    assert usage.cache_creation_input_tokens == 0
    return usage.input_tokens + usage.cache_read_input_tokens


@contextmanager
def held_streams(url: str, path: str, body: dict, count: int):
    """Open `count` streaming requests and keep them open (yields their status codes);
    they are read to the end or dropped when the block exits."""
    import httpx

    opened: list[int] = []
    stop = threading.Event()

    def hold() -> None:
        with httpx.stream("POST", url + path, json=body, timeout=120) as response:
            opened.append(response.status_code)
            for _ in response.iter_lines():
                if stop.is_set():
                    break

    threads = [threading.Thread(target=hold) for _ in range(count)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while len(opened) < count:
        assert time.monotonic() < deadline, "streams did not open"
        time.sleep(0.02)
    try:
        yield opened
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
