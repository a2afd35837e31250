"""Tensor parallelism on the device: each `--sizes` rank count in one call, on a random-weight
model of `--shape` (Llama-3.1-8B's by default), bf16.

For each size: output tok/s on the nano-vllm workload of gpu_throughput.py (`--requests`
requests handed over at once), and batch-1 decode latency: one request of a 128-token prompt,
timed for 1 and for 1 + `--decode-tokens` output tokens; ms per token is the difference over
`--decode-tokens`. Prints a table; writes JSON to $OUT (or bench/out).

    python3 bench/tp_throughput.py [--sizes 1 2] [--requests 256]
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from gpu_throughput import _submit_all, workload

from inflight.bench.random_model import SHAPES, random_checkpoint
from inflight.bench.report import report_path, write_report
from inflight.engine import EngineConfig, RequestEngine
from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.runtime.runtime import Runtime


def _seconds(engine: RequestEngine, prompt: list[int], tokens: int) -> float:
    start = time.perf_counter()
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    assert len(engine.submit(GenerationRequest(prompt, params)).get().token_ids) == tokens
    return time.perf_counter() - start


def run(size: int, work: list[tuple[list[int], int]], args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    runtime = Runtime(
        random_checkpoint(args.shape, torch.device("cuda")),
        DeploymentOptions(
            device="cuda",
            max_batch_size=args.batch,
            max_model_len=2048 + 16,
            max_num_tokens=args.max_num_tokens,
            tensor_parallel_size=size,
        ),
    )
    built_s = time.perf_counter() - start
    engine = RequestEngine(
        runtime,
        EngineConfig(
            max_batch_size=args.batch,
            max_pending_requests=len(work) + 8,
            command_queue_capacity=len(work) + 8,
        ),
    )
    try:
        _submit_all(engine, [(work[0][0][:32], 8)])  # warm-up: compiles the kernels
        prompt = work[0][0][:128]
        _seconds(engine, prompt, 16)
        first = min(_seconds(engine, prompt, 1) for _ in range(3))
        whole = min(_seconds(engine, prompt, 1 + args.decode_tokens) for _ in range(3))
        tok_s = _submit_all(engine, work)
    finally:
        engine.shutdown()
        runtime.close()
    return {
        "build_s": built_s,
        "output_tok_s": tok_s,
        "batch1_decode_ms_per_token": (whole - first) * 1000 / args.decode_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--max-num-tokens", type=int, default=8192)
    parser.add_argument("--decode-tokens", type=int, default=256)
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.cuda.device_count(), torch.__version__, flush=True)
    work = workload(args.requests, SHAPES[args.shape].vocab_size)
    results = {}
    for size in args.sizes:
        results[size] = run(size, work, args)
        print(f"tp={size}", results[size], flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    print(f"\n{'tp':<4}{'tok/s':>10}{'batch-1 ms/token':>18}")
    for size, r in results.items():
        print(f"{size:<4}{r['output_tok_s']:10.0f}{r['batch1_decode_ms_per_token']:18.2f}")
    write_report(
        report_path("tp_throughput.json"),
        device=torch.cuda.get_device_name(),
        gpus=torch.cuda.device_count(),
        args=vars(args),
        results=results,
    )


if __name__ == "__main__":
    main()
