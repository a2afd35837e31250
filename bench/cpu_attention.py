"""Decode attention on the CPU: the native kernel against the per-row torch reference path.

One layer's decode attention for `--rows` rows of SmolLM2's shape (9 query heads, 3 KV heads,
head dim 64) over scattered paged KV, at several context lengths. Prints ms per layer and writes
JSON to bench/out/cpu_attention.json. `--cold`: each call reads another of 40 layers' caches, so
that the keys and values come from memory, as in a decode step, rather than from cache.

    .venv/bin/python bench/cpu_attention.py [--rows 16] [--contexts 150 600 1500] [--cold]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from inflight.bench.report import write_report
from inflight.model.attention import TorchAttentionBackend
from inflight.model.attention.cpu import CpuAttentionBackend
from inflight.model.kernels.cpu.attention import paged_attention
from inflight.runtime.device.batch_builder import RowInput, build_ragged_batch


def best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1000


def time_context(rows: int, context: int, repeats: int, cold: bool, seed: int = 0) -> dict:
    """Best-of-`repeats` ms of one layer's decode attention, both paths, for one context."""
    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    need = -(-(context + 1) // block_size)
    blocks = list(range(rows * need))
    random.Random(seed).shuffle(blocks)
    inputs = [RowInput([0], context, blocks[i * need : (i + 1) * need], True) for i in range(rows)]
    meta = build_ragged_batch(inputs, block_size, torch.device("cpu")).forward.attention
    q = torch.randn(rows, heads, dim)
    caches = [
        tuple(torch.randn(kv_heads, len(blocks) * block_size, dim) for _ in range(2))
        for _ in range(40 if cold else 1)
    ]
    out = torch.empty(q.shape)
    lib = CpuAttentionBackend().library

    def reference() -> None:
        for layer in caches:
            TorchAttentionBackend.attend_rows(q, layer, meta, dim**-0.5, out, 0)

    def native() -> None:
        for layer in caches:
            paged_attention(lib, q, layer, meta, dim**-0.5, out)

    torch_ms = best_ms(reference, repeats) / len(caches)
    native_ms = best_ms(native, repeats) / len(caches)
    return {"context": context, "torch_ms": torch_ms, "native_ms": native_ms}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--contexts", type=int, nargs="+", default=[150, 600, 1500])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--cold", action="store_true")
    args = parser.parse_args()
    results = []
    print(f"{'context':>8} {'torch ms':>9} {'native ms':>10} {'speedup':>8}")
    for context in args.contexts:
        r = time_context(args.rows, context, args.repeats, args.cold)
        results.append(r)
        speedup = r["torch_ms"] / r["native_ms"]
        print(f"{context:>8} {r['torch_ms']:>9.2f} {r['native_ms']:>10.2f} {speedup:>7.1f}x")
    write_report(
        "bench/out/cpu_attention.json",
        threads=torch.get_num_threads(),
        rows=args.rows,
        cold=args.cold,
        results=results,
    )


if __name__ == "__main__":
    main()
