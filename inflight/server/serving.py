"""Running the app under uvicorn until a signal stops it or its engine fails.

SIGTERM or SIGINT drains: the admission gate closes (a new request is a 503 with Retry-After;
the listener stays open, so a load balancer is told, not refused), running requests get up to
`shutdown_timeout` seconds to finish, and the ones still running then are cancelled (their
clients get a 503, or an error event where the response is a stream); then the server exits 0.
A second signal exits at once. An engine that stopped on an internal error (every request it
held failed, `/health` and `/health/ready` answer 503) makes the server exit 1 instead of
answering errors on; it answers 503s naming the fault for `_FAULT_LINGER` seconds first, so that a
prober polling readiness learns why rather than only meeting a refused connection.
"""

from __future__ import annotations

import asyncio
import logging
from types import FrameType

import uvicorn

from inflight.server.client import EngineClient

log = logging.getLogger("inflight.server")

# How often the engine's health is looked at, and how long requests cancelled at the end of a
# drain get to end (a cancel ends a request within two steps), and how long a failed engine's
# 503s are served before the exit.
_WATCH_INTERVAL = 0.25
_CANCEL_GRACE = 10.0
_FAULT_LINGER = 1.0


class Server(uvicorn.Server):
    def __init__(
        self, config: uvicorn.Config, client: EngineClient, shutdown_timeout: float
    ) -> None:
        super().__init__(config)
        self.client = client
        self.shutdown_timeout = shutdown_timeout
        self.failed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def run_until_stopped(self) -> int:
        """Serve; the process's exit status: 0 after a shutdown, 1 after an engine failure."""
        self._loop = asyncio.get_running_loop()
        watcher = asyncio.create_task(self._watch_engine())
        try:
            await self.serve()
        finally:
            watcher.cancel()
        return 1 if self.failed else 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or self.should_exit or self._loop is None:
            super().handle_exit(sig, frame)  # a second signal: out now
            return
        self._draining = True
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.drain()))

    async def drain(self) -> None:
        """Stop admitting, give running requests `shutdown_timeout` seconds, cancel the rest,
        then let uvicorn shut down."""
        gate = self.client.gate
        log.info("draining: %d request(s) running", gate.active)
        try:
            await asyncio.wait_for(gate.close(), self.shutdown_timeout)
        except TimeoutError:
            count = self.client.cancel_all()
            log.warning("shutdown timeout: cancelled %d running request(s)", count)
            try:
                await asyncio.wait_for(gate.wait_idle(), _CANCEL_GRACE)
            except TimeoutError:
                log.error("%d request(s) did not end after their cancel", gate.active)
        self.should_exit = True

    async def _watch_engine(self) -> None:
        while not self.should_exit:
            fault = self.client.llm.engine_fault
            if fault is not None:
                log.error("the engine stopped on an internal error (%s); shutting down", fault)
                self.failed = True
                await asyncio.sleep(_FAULT_LINGER)
                self.should_exit = True
                return
            await asyncio.sleep(_WATCH_INTERVAL)
