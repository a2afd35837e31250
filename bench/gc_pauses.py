"""The cyclic garbage collector's full passes during the nano-vllm workload: how many, how long.

The engine freezes the heap it starts with (the runtime's model, its imports) out of the
collector while its actor runs; `--thaw` thaws it once the engine has frozen it, as before that
change. Every full (generation 2) pass stops all threads, the engine's steps among them, so
their total is time the batch did not advance.

On the CPU the model is a one-layer random one of a 2,048-token vocabulary (the host, not the
forward, is what a step costs); with `--device cuda` it is `--shape` at full size.

    .venv/bin/python bench/gc_pauses.py [--thaw] [--requests 256]
    python3 bench/gc_pauses.py --device cuda [--shape qwen3-0.6b] [--thaw]
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from gpu_throughput import _submit_all, workload

from inflight.bench import random_model
from inflight.bench.report import report_path, write_report
from inflight.engine import EngineConfig, RequestEngine
from inflight.protocol.deployment import DeploymentOptions
from inflight.runtime.runtime import Runtime


class FullPasses:
    """Times every generation-2 collection from the collector's own callbacks."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif info["generation"] == 2:
            self.seconds.append(time.perf_counter() - self._start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--thaw", action="store_true", help="the heap not frozen (as before)")
    args = parser.parse_args()
    shape = args.shape
    if args.device == "cpu":
        torch.set_num_threads(1)
        shape = "host-step"
    work = workload(args.requests, random_model.SHAPES[shape].vocab_size)
    runtime = Runtime(
        random_model.random_checkpoint(shape, torch.device(args.device)),
        DeploymentOptions(
            device=args.device,
            max_batch_size=args.requests,
            max_model_len=2048 + 16,
            max_num_tokens=8192,
            overlap=True,
        ),
    )
    engine = RequestEngine(
        runtime,
        EngineConfig(
            max_batch_size=args.requests,
            max_pending_requests=len(work) + 8,
            command_queue_capacity=len(work) + 8,
        ),
    )
    _submit_all(engine, [(work[0][0][:32], 8)])  # compiled kernels, the heap frozen
    if args.thaw:
        gc.unfreeze()
    frozen = gc.get_freeze_count()
    passes = FullPasses()
    tok_s = _submit_all(engine, work)
    engine.shutdown()
    pauses = passes.seconds
    print(
        f"{args.device} {shape} ({'thawed' if args.thaw else 'frozen'}: {frozen} objects "
        f"frozen): {tok_s:.0f} output tok/s; {len(pauses)} full collections, "
        f"{sum(pauses) * 1000:.0f} ms in all, the longest {max(pauses, default=0) * 1000:.0f} ms"
    )
    write_report(
        report_path("gc_pauses.json"),
        args=vars(args),
        frozen_objects=frozen,
        output_tok_s=tok_s,
        full_collections=len(pauses),
        full_collection_ms=[p * 1000 for p in pauses],
    )


if __name__ == "__main__":
    main()
