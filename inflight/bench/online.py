"""Online load against a running OpenAI-compatible server: Poisson arrivals, streaming clients.

Each request is a streamed /v1/completions call with a fixed number of output tokens (EOS
ignored, so every run does the same work). Reports output tok/s over the whole run, and time to
first token and inter-token latency percentiles. `start_server` runs `inflight serve` for the
online benchmarks.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import IO

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(flags: list[str], log: IO | None = None) -> tuple[subprocess.Popen, str]:
    """`inflight serve FLAGS` on a free loopback port, once it is ready: the process and its
    base URL. Its stderr goes to `log` (default: nowhere); a server that exits or is not ready
    in 180 s is a RuntimeError."""
    port = free_port()
    command = [sys.executable, "-m", "inflight.server.cli", "serve", "--port", str(port), *flags]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log or subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(url + "/health/ready", timeout=1).is_success:
                return server, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or server.poll() is not None:
            server.kill()
            raise RuntimeError(f"the server did not start: {' '.join(command)}")
        time.sleep(0.5)


@dataclass(frozen=True)
class LoadResult:
    rate: float  # requests per second offered
    requests: int
    ok: int
    output_tokens: int
    seconds: float
    output_tok_s: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        """One line: offered rate, throughput, latency percentiles, successes."""
        return (
            f"rate {self.rate:5.2f}/s  {self.output_tok_s:7.1f} output tok/s  "
            f"TTFT p50 {self.ttft_p50:6.2f}s p99 {self.ttft_p99:6.2f}s  "
            f"ITL p50 {self.itl_p50 * 1000:6.0f}ms p99 {self.itl_p99 * 1000:6.0f}ms  "
            f"({self.ok}/{self.requests} ok)"
        )


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


async def _one(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int
) -> tuple[float, list[float], int] | None:
    """(time to first token, inter-token gaps, tokens) of one streamed request; None on error."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return None
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                stamps.append(time.perf_counter())
    if not stamps:
        return None
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return stamps[0] - start, gaps, tokens


async def run_load(
    url: str,
    model: str,
    prompts: list[list[int]],
    max_tokens: list[int],
    rate: float,
    seed: int = 0,
) -> LoadResult:
    """Send every prompt, spaced by exponential gaps of mean 1/rate, and wait for all."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        tasks = []
        start = time.perf_counter()
        for prompt, n in zip(prompts, max_tokens, strict=True):
            tasks.append(asyncio.create_task(_one(client, url, model, prompt, n)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        seconds = time.perf_counter() - start
    done = [r for r in results if r is not None]
    ttft = [r[0] for r in done]
    itl = [gap for r in done for gap in r[1]]
    tokens = sum(r[2] for r in done)
    return LoadResult(
        rate=rate,
        requests=len(prompts),
        ok=len(done),
        output_tokens=tokens,
        seconds=seconds,
        output_tok_s=tokens / seconds,
        ttft_p50=percentile(ttft, 50),
        ttft_p99=percentile(ttft, 99),
        itl_p50=percentile(itl, 50),
        itl_p99=percentile(itl, 99),
    )
