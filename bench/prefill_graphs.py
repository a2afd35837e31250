"""A step with a prefill chunk, run eagerly against replayed as decode rows of a CUDA graph.

Each step holds 4 decode rows (300 tokens in KV each) and one prefill chunk of n tokens after p
tokens already in KV; it runs as a CUDA runtime runs it, once with the chunk packed whole (an
eager forward: no graph fits a prefill) and once unfolded to one decode row per token (a graph's
replay). Host time around the whole step, the device synchronized after it: medians over
`--repeats`. The keys an unfolded chunk reads (n * p + n * (n + 1) / 2) are what
`cuda_graphs.UNFOLD_KEYS` bounds. Also times building the runtime (its graph capture).
Writes JSON to $OUT (or bench/out).

    python3 bench/prefill_graphs.py --model FILE.gguf
    python3 bench/prefill_graphs.py --shape llama-3.1-8b --tokenizer FILE.gguf
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from inflight.bench.random_model import random_checkpoint
from inflight.bench.report import report_path, write_report
from inflight.model.checkpoints.loader import open_checkpoint
from inflight.protocol.deployment import DeploymentOptions
from inflight.runtime.device.batch_builder import RowInput, build_ragged_batch
from inflight.runtime.device.cuda_graphs import UNFOLD_KEYS
from inflight.runtime.runtime import Runtime

DECODE_PAST = 300


def step_ms(runtime: Runtime, chunk: int, past: int, unfold: bool, repeats: int) -> float:
    runner, block_size = runtime.executor.runner, runtime.plan.block_size
    blocks_each = runtime.max_model_len // block_size
    rows = [
        RowInput([7], DECODE_PAST, range(i * blocks_each, (i + 1) * blocks_each), True)
        for i in range(4)
    ]
    rows.append(RowInput([11] * chunk, past, range(4 * blocks_each, 5 * blocks_each), True))
    times = []
    for _ in range(repeats + 2):  # the first two build kernels of a new shape
        torch.cuda.synchronize()
        start = time.perf_counter()
        batch = build_ragged_batch(rows, block_size, runner.device, unfold)
        runner.logits(runner.execute(batch))
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--shape", default=None, help="a random-weight model of this shape")
    parser.add_argument("--tokenizer", default=None, help="where --shape's tokenizer is")
    parser.add_argument("--chunks", type=int, nargs="+", default=[16, 64, 128, 256, 448])
    parser.add_argument("--pasts", type=int, nargs="+", default=[0, 512, 2048])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    checkpoint = open_checkpoint(args.tokenizer if args.shape else args.model)
    if args.shape:
        checkpoint = random_checkpoint(
            args.shape, torch.device("cuda"), tokenizer=checkpoint.tokenizer
        )
    start = time.perf_counter()
    runtime = Runtime(
        checkpoint,
        DeploymentOptions(
            max_batch_size=8, max_model_len=4096, enable_context_reuse=False, device="cuda"
        ),
    )
    build_s = time.perf_counter() - start
    buckets = runtime.executor.runner.graphs.buckets
    print(f"runtime built in {build_s:.1f} s ({len(buckets)} graphs, up to {buckets[-1]} rows)")
    results = []
    for past in args.pasts:
        for chunk in args.chunks:
            keys = chunk * past + chunk * (chunk + 1) // 2
            eager = step_ms(runtime, chunk, past, False, args.repeats)
            graph = step_ms(runtime, chunk, past, True, args.repeats)
            results.append(dict(chunk=chunk, past=past, keys=keys, eager_ms=eager, graph_ms=graph))
            mark = "" if keys <= UNFOLD_KEYS else "  (over UNFOLD_KEYS: runs eagerly)"
            print(
                f"chunk {chunk:4d} after {past:5d}: {keys:8d} keys, eager {eager:6.2f} ms, "
                f"graph {graph:6.2f} ms{mark}",
                flush=True,
            )
    write_report(
        report_path("prefill_graphs.json"),
        device=torch.cuda.get_device_name(),
        model=args.shape or str(args.model),
        runtime_build_s=build_s,
        graphs=len(buckets),
        unfold_keys=UNFOLD_KEYS,
        results=results,
    )


if __name__ == "__main__":
    main()
