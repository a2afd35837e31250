"""Online serving benchmark: the HTTP server with in-flight batching against the blocking path.

Starts `inflight serve` (once per mode) on a free port with the default model, offers Poisson
arrivals at several rates from streaming clients, and prints output tok/s, time to first token and
inter-token latency (p50/p99) per rate and mode; writes JSON.

    .venv/bin/python bench/serve_load.py [--rates 0.5 1 2] [--requests 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random

from inflight.bench.online import run_load, start_server
from inflight.bench.report import write_report
from inflight.model.checkpoints.loader import open_checkpoint


def _flags(ifb: bool, batch: int) -> list[str]:
    flags = ["--served-model-name", "bench", "--max-batch-size", str(batch)]
    flags += ["--max-queued-requests", "64", "--max-model-len", "1024"]
    flags += ["--log-level", "warning"]
    return flags + (["--enable-in-flight-batching"] if ifb else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", default="bench/out/serve_load.json")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    tokenizer = open_checkpoint().tokenizer
    corpus = tokenizer.encode("The history of science is the study of how knowledge grew. " * 60)
    rng = random.Random(0)
    prompts, outputs = [], []
    for _ in range(args.requests):
        length = rng.randint(64, 128)
        start = rng.randint(0, len(corpus) - length)
        prompts.append(corpus[start : start + length])
        outputs.append(rng.randint(32, 64))

    results: dict[str, list[dict]] = {}
    for mode in ("ifb", "blocking"):
        server, url = start_server(_flags(mode == "ifb", args.batch))
        try:
            asyncio.run(run_load(url, "bench", prompts[:2], [4, 4], rate=10))  # warm-up
            results[mode] = []
            for rate in args.rates:
                r = asyncio.run(run_load(url, "bench", prompts, outputs, rate))
                results[mode].append(r.as_dict())
                print(f"{mode:<9} {r.summary()}", flush=True)
        finally:
            server.terminate()
            server.wait(timeout=60)
    write_report(args.out, requests=args.requests, batch=args.batch, results=results)


if __name__ == "__main__":
    main()
