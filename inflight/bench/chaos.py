"""Chaos and load against a running server: a seeded mix of good, bad and rude clients.

`run_chaos` keeps `clients` concurrent clients busy for `duration` seconds, each picking its next
request kind from KINDS by weight (seeded), and fires a burst beyond the queue every
`burst_every` seconds. Every request ends as one outcome label (an HTTP status, "stream-ended",
"disconnected", ...); a stream that has not ended after `stream_timeout` seconds is "hung". Then
`settle` waits for the server's KV blocks and resident slots to come back and reads the engine's
counters. `ChaosReport.failures()` says what broke a promise: any HTTP 5xx (in a status or in a
stream's error event), any hung stream or connection the server broke, a block or slot still in
use, counters that do not add up (accepted = completed + cancelled + failed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

MESSAGES = [{"role": "user", "content": "Name three rivers and one fact about each."}]
LONG_TEXT = "The history of science is the study of how knowledge about nature grew. " * 60


@dataclass
class Chaos:
    """What one run needs to know about its server."""

    url: str
    model: str
    max_model_len: int
    max_body_bytes: int = 8 * 1024 * 1024
    stream_timeout: float = 120.0
    outcomes: Counter = field(default_factory=Counter)  # (kind, outcome) -> count
    server_errors: list[str] = field(default_factory=list)


async def _post(chaos: Chaos, http: httpx.AsyncClient, path: str, **kwargs) -> str:
    response = await http.post(chaos.url + path, timeout=chaos.stream_timeout, **kwargs)
    if response.status_code >= 500:
        chaos.server_errors.append(f"{path} {response.status_code}: {response.text[:200]}")
    return str(response.status_code)


async def _stream(
    chaos: Chaos,
    http: httpx.AsyncClient,
    path: str,
    body: dict,
    stop_after: int | None = None,
    read_delay: float = 0.0,
) -> str:
    """Read a stream to its end ("stream-ended"), or drop it after `stop_after` events
    ("disconnected"; 0: as soon as the response has begun, while the prompt is computed); an
    error event with a 5xx code is recorded as a server error."""
    try:
        async with asyncio.timeout(chaos.stream_timeout):
            async with http.stream("POST", chaos.url + path, json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    if response.status_code >= 500:
                        chaos.server_errors.append(f"{path} {response.status_code}")
                    return str(response.status_code)
                if stop_after == 0:
                    return "disconnected"
                events = 0
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        return "stream-ended"
                    event = json.loads(line[6:])
                    error = event.get("error")
                    if error is not None:
                        if int(error.get("code") or 500) >= 500:
                            chaos.server_errors.append(f"{path} stream error: {error}")
                        return f"stream-error-{error.get('code')}"
                    events += 1
                    if stop_after is not None and events >= stop_after:
                        return "disconnected"
                    if read_delay:
                        await asyncio.sleep(read_delay)
                return "stream-cut"  # the server closed the stream without [DONE]
    except TimeoutError:
        return "hung"


async def _raw(chaos: Chaos, body: bytes, close_at_once: bool = False) -> str:
    """A hand-made HTTP request (bytes the client libraries will not send); the status, or
    "disconnected" when the client closes before reading anything."""
    host, port = chaos.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    writer.write(head.encode() + body)
    await writer.drain()
    if close_at_once:
        writer.close()
        return "disconnected"
    status = (await asyncio.wait_for(reader.readline(), chaos.stream_timeout)).split()[1]
    writer.close()
    if int(status) >= 500:
        chaos.server_errors.append(f"raw request: {status.decode()}")
    return status.decode()


def _chat(rng: random.Random, chaos: Chaos, **extra) -> dict:
    return {
        "model": chaos.model,
        "messages": MESSAGES,
        "max_tokens": rng.randint(1, 48),
        "temperature": rng.choice([0, 0.7]),
        **extra,
    }


def _completion(rng: random.Random, chaos: Chaos) -> dict:
    return {"model": chaos.model, "prompt": "Once upon a time", "max_tokens": rng.randint(1, 48)}


async def _cancelled(chaos: Chaos, http: httpx.AsyncClient, rng: random.Random) -> str:
    """A request the client gives up on after a random wait (its connection is dropped)."""
    task = asyncio.ensure_future(
        _post(chaos, http, "/v1/chat/completions", json=_chat(rng, chaos, max_tokens=200))
    )
    await asyncio.sleep(rng.uniform(0.02, 1.0))
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return "cancelled"


Kind = Callable[[Chaos, httpx.AsyncClient, random.Random], Awaitable[str]]

# name -> (weight, request)
KINDS: dict[str, tuple[int, Kind]] = {
    "chat": (6, lambda c, h, r: _post(c, h, "/v1/chat/completions", json=_chat(r, c))),
    "chat-stream": (
        6,
        lambda c, h, r: _stream(c, h, "/v1/chat/completions", _chat(r, c, stream=True)),
    ),
    "completion": (4, lambda c, h, r: _post(c, h, "/v1/completions", json=_completion(r, c))),
    "completion-stream": (
        4,
        lambda c, h, r: _stream(c, h, "/v1/completions", {**_completion(r, c), "stream": True}),
    ),
    "drop-before-first-byte": (
        2,
        lambda c, h, r: _raw(c, json.dumps(_chat(r, c)).encode(), close_at_once=True),
    ),
    "drop-mid-stream": (
        3,
        lambda c, h, r: _stream(
            c, h, "/v1/chat/completions", _chat(r, c, stream=True, max_tokens=64), r.randint(1, 8)
        ),
    ),
    "drop-during-prefill": (
        2,
        lambda c, h, r: _stream(
            c,
            h,
            "/v1/completions",
            {"model": c.model, "prompt": LONG_TEXT[:3000], "max_tokens": 8, "stream": True},
            stop_after=0,
        ),
    ),
    "client-cancel": (3, _cancelled),
    "slow-reader": (
        2,
        lambda c, h, r: _stream(
            c, h, "/v1/chat/completions", _chat(r, c, stream=True), read_delay=0.3
        ),
    ),
    "prompt-too-long": (
        1,
        lambda c, h, r: _post(
            c,
            h,
            "/v1/completions",
            json={"model": c.model, "prompt": "word " * (2 * c.max_model_len), "max_tokens": 4},
        ),
    ),
    "body-too-large": (
        1,
        lambda c, h, r: _post(
            c, h, "/v1/completions", content=b"x" * (c.max_body_bytes + 1), headers=_JSON
        ),
    ),
    "malformed-json": (
        1,
        lambda c, h, r: _post(
            c, h, "/v1/chat/completions", content=b'{"messages": [', headers=_JSON
        ),
    ),
    "wrong-types": (
        1,
        lambda c, h, r: _post(
            c, h, "/v1/chat/completions", json={"messages": "hi", "max_tokens": "many"}
        ),
    ),
    "unknown-field": (
        1,
        lambda c, h, r: _post(c, h, "/v1/chat/completions", json=_chat(r, c, bogus_field=1)),
    ),
    "huge-max-tokens": (
        1,
        lambda c, h, r: _post(c, h, "/v1/chat/completions", json=_chat(r, c, max_tokens=10**9)),
    ),
    "invalid-utf8": (
        1,
        lambda c, h, r: _raw(c, b'{"messages": [{"role": "user", "content": "\xff\xfe\xfd"}]}'),
    ),
}
_JSON = {"Content-Type": "application/json"}


@dataclass
class ChaosReport:
    seconds: float
    outcomes: Counter
    server_errors: list[str]
    kv_blocks_used: int
    slots_used: int
    counters: dict[str, float]

    @property
    def sent(self) -> int:
        return sum(self.outcomes.values())

    def count(self, outcome: str) -> int:
        return sum(n for (_, o), n in self.outcomes.items() if o == outcome)

    def failures(self) -> list[str]:
        checks = {
            "HTTP 5xx": len(self.server_errors) == 0,
            "hung streams": self.count("hung") == 0,
            "connections broken by the server": self.count("connection-error") == 0,
            "KV blocks in use after settling": self.kv_blocks_used == 0,
            "resident slots in use after settling": self.slots_used == 0,
            "accepted = completed + cancelled + failed": _add_up(self.counters),
        }
        return [name for name, ok in checks.items() if not ok]

    def table(self) -> str:
        lines = [f"{'kind':<24}{'sent':>6}  outcomes"]
        for kind in [*KINDS, "burst"]:
            outcomes = {o: n for (k, o), n in sorted(self.outcomes.items()) if k == kind}
            if outcomes:
                detail = ", ".join(f"{o} {n}" for o, n in outcomes.items())
                lines.append(f"{kind:<24}{sum(outcomes.values()):>6}  {detail}")
        c = self.counters
        lines += [
            f"requests sent {self.sent} in {self.seconds:.0f} s; HTTP 5xx "
            f"{len(self.server_errors)}; hung streams {self.count('hung')}; broken connections "
            f"{self.count('connection-error')}",
            f"after settling: KV blocks in use {self.kv_blocks_used}, resident slots in use "
            f"{self.slots_used}",
            f"engine: accepted {c['submitted']:.0f} = completed {c['completed']:.0f} + cancelled "
            f"{c['cancelled']:.0f} + failed {c['failed']:.0f}; refused {c['refused']:.0f}",
        ]
        return "\n".join(lines)


async def run_chaos(
    chaos: Chaos,
    duration: float,
    clients: int,
    seed: int,
    burst_every: float = 20.0,
    burst_size: int = 48,
) -> ChaosReport:
    """Drive the server, then settle and report (the server must be idle before the run)."""
    start = time.monotonic()
    deadline = start + duration
    names = list(KINDS)
    weights = [KINDS[n][0] for n in names]
    # Idle connections are dropped after 1 s, well before the server's keep-alive timeout (5 s):
    # a request sent on a connection the server is closing would fail for the client's reason.
    limits = httpx.Limits(max_connections=clients + burst_size + 8, keepalive_expiry=1.0)
    async with httpx.AsyncClient(limits=limits, timeout=chaos.stream_timeout) as http:

        async def client(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            while time.monotonic() < deadline:
                kind = rng.choices(names, weights)[0]
                chaos.outcomes[(kind, await _outcome(KINDS[kind][1](chaos, http, rng)))] += 1

        async def bursts() -> None:
            rng = random.Random(seed)
            while time.monotonic() + burst_every < deadline:
                await asyncio.sleep(burst_every)
                body = _chat(rng, chaos)
                calls = [
                    _post(chaos, http, "/v1/chat/completions", json=body) for _ in range(burst_size)
                ]
                for outcome in await asyncio.gather(*map(_outcome, calls)):
                    chaos.outcomes[("burst", outcome)] += 1

        await asyncio.gather(bursts(), *(client(i) for i in range(clients)))
        seconds = time.monotonic() - start
        kv, slots, counters = await settle(chaos, http)
    return ChaosReport(seconds, chaos.outcomes, chaos.server_errors, kv, slots, counters)


async def _outcome(request: Awaitable[str]) -> str:
    """The request's outcome; "connection-error" where the server broke the connection."""
    try:
        return await request
    except (httpx.TransportError, ConnectionError):
        return "connection-error"


def _add_up(counters: dict[str, float]) -> bool:
    """Whether every request the engine accepted has its outcome."""
    return (
        counters["submitted"] == counters["completed"] + counters["cancelled"] + counters["failed"]
    )


async def settle(chaos: Chaos, http: httpx.AsyncClient, timeout: float = 60.0) -> tuple:
    """Wait until nothing is resident or queued and the counters add up (or `timeout`): the KV
    blocks and resident slots in use, and the engine's counters."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = (await http.get(chaos.url + "/metrics")).text
        gauges = {
            parts[0]: float(parts[1])
            for parts in (line.split() for line in metrics.splitlines() if line[:1] != "#")
            if parts and parts[0] in ("inflight_kv_blocks_used", "inflight_resident_slots_used")
        }
        scheduling = (await http.get(chaos.url + "/health")).json()["scheduling"]
        kv, slots = (
            int(gauges["inflight_kv_blocks_used"]),
            int(gauges["inflight_resident_slots_used"]),
        )
        if (kv == slots == 0 and _add_up(scheduling)) or time.monotonic() > deadline:
            return kv, slots, scheduling
        await asyncio.sleep(0.5)
