"""Chaos and load suite: the real `inflight serve` under a seeded mix of good, bad and rude clients.

Starts `inflight serve` (in-flight batching, context cache on) on the loopback address, then for
`--duration` seconds keeps `--clients` clients busy with the request kinds of
`inflight/bench/chaos.py` (chat and completions, streamed or not; clients that drop the connection
before the first byte, mid-stream or during prefill, or give up on a request; slow readers;
prompts and bodies over the limits, malformed JSON, wrong types, unknown fields, a huge
`max_tokens`, invalid UTF-8) and a burst beyond the queue every `--burst-every` seconds (429s
expected). Then it lets the server settle, prints one table, and stops the server with SIGTERM.
It exits 1 if any promise broke: an HTTP 5xx, a stream that never ended, a KV block or resident
slot still in use, engine counters that do not add up, a server that did not exit cleanly.
Writes JSON (and the server's log, chaos-server.log) to $OUT (or bench/out).

    .venv/bin/python bench/chaos.py [--duration 600] [--clients 12] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys

from inflight.bench.chaos import Chaos, run_chaos
from inflight.bench.online import start_server
from inflight.bench.report import report_path, write_report


def server_flags(args: argparse.Namespace) -> list[str]:
    return [
        *([args.model] if args.model else []),
        "--served-model-name",
        "chaos",
        "--enable-in-flight-batching",
        "--enable-context-reuse",
        "--max-batch-size",
        str(args.max_batch_size),
        "--max-queued-requests",
        str(args.max_queued_requests),
        "--max-model-len",
        str(args.max_model_len),
        "--shutdown-timeout",
        "5",
        "--log-level",
        "error",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--clients", type=int, default=12, help="concurrent clients")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded one)")
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--max-queued-requests", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--burst-every", type=float, default=20.0)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    log = report_path("chaos-server.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as errors:  # the server's log: a traceback says what went wrong
        server, url = start_server(server_flags(args), errors)
    try:
        chaos = Chaos(url, "chaos", args.max_model_len)
        report = asyncio.run(
            run_chaos(chaos, args.duration, args.clients, args.seed, args.burst_every)
        )
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            exit_status = server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            exit_status = None
    failures = report.failures()
    if exit_status != 0:
        failures.append(f"server exit status {exit_status} after SIGTERM")
    print(report.table())
    print(f"server exit status after SIGTERM: {exit_status}")
    for error in report.server_errors[:10]:
        print(f"  5xx: {error}")
    print("FAILED: " + "; ".join(failures) if failures else "every check passed")
    write_report(
        report_path("chaos.json"),
        args=vars(args),
        seconds=report.seconds,
        sent=report.sent,
        outcomes={f"{kind}: {outcome}": n for (kind, outcome), n in report.outcomes.items()},
        server_errors=report.server_errors,
        hung_streams=report.count("hung"),
        broken_connections=report.count("connection-error"),
        kv_blocks_used=report.kv_blocks_used,
        resident_slots_used=report.slots_used,
        counters=report.counters,
        server_exit_status=exit_status,
        failures=failures,
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
