"""Prefill attention as the workload's first steps run it, against its launch settings.

One layer's prefill attention over a chunk of ~8,192 prompt tokens (the benchmark's per-step
budget): prompts uniform in [100, 1024], the first continuing a chunk with `--past` tokens
already in the cache, every row's blocks in one run. The figure is the causal work (4 x head
size multiply-adds per query, key pair and head, the keys a query sees) over the kernel's time;
the sweep times queries and keys a program iteration (`block_m`, `block_n`), warps and pipeline
stages, each output compared with the served settings'.

    python3 bench/prefill_attention.py [--shapes llama-3.1-8b qwen3-0.6b] [--tokens 8192]
        [--past 400] [--sweep]   (prints the figures; writes JSON to $OUT or bench/out)
"""

from __future__ import annotations

import argparse
import itertools
import random

import torch
from triton.testing import do_bench

from inflight.bench.report import report_path, write_report
from inflight.model.kernels.triton.attention import prefill_attention
from inflight.model.kernels.triton.plan import PREFILL_BLOCK_M, plan_prefill
from inflight.runtime.device.batch_builder import RowInput, build_ragged_batch

# (query heads, KV heads, head size)
SHAPES = {"qwen3-0.6b": (16, 8, 128), "llama-3.1-8b": (32, 8, 128)}
BLOCK_SIZE = 16


class Chunk:
    """A step's prefill chunks of one layer: queries, caches and the batch's metadata."""

    def __init__(self, shape: str, tokens: int, past: int, dtype: torch.dtype, seed: int = 0):
        heads, kv_heads, dim = SHAPES[shape]
        device = torch.device("cuda")
        rng = random.Random(seed)
        self.lens: list[int] = []
        while sum(self.lens) < tokens:
            self.lens.append(min(rng.randint(100, 1024), tokens - sum(self.lens)))
        self.pasts = [past] + [0] * (len(self.lens) - 1)
        rows, at = [], 0
        for n, p in zip(self.lens, self.pasts, strict=True):
            need = -(-(n + p) // BLOCK_SIZE)
            rows.append(RowInput([1] * n, p, range(at, at + need), True))
            at += need
        self.meta = build_ragged_batch(rows, BLOCK_SIZE, device).forward.attention
        self.q = torch.randn(sum(self.lens), heads, dim, device=device, dtype=torch.bfloat16)
        self.k = torch.randn(at, BLOCK_SIZE, kv_heads, dim, device=device).to(dtype)
        self.v = torch.randn(at, BLOCK_SIZE, kv_heads, dim, device=device).to(dtype)
        self.out = torch.empty_like(self.q)
        # Each query sees its past and the chunk's queries up to itself.
        pairs = sum(n * p + n * (n + 1) / 2 for n, p in zip(self.lens, self.pasts, strict=True))
        self.flops = 4 * dim * heads * pairs

    def run(self, block_m: int = PREFILL_BLOCK_M, **launch) -> torch.Tensor:
        plan = plan_prefill(self.meta.query_lens_host, 0, self.q.device, block_m)
        prefill_attention(
            self.q, self.k, self.v, self.meta, plan, self.out, self.q.shape[-1] ** -0.5, **launch
        )
        return self.out


def timed(chunk: Chunk, reference: torch.Tensor, launch: dict) -> dict:
    try:
        got = chunk.run(**launch).clone()
        ms = min(do_bench(lambda: chunk.run(**launch)) for _ in range(3))
    except Exception as error:  # out of shared memory, for one
        return {**launch, "error": type(error).__name__}
    err = ((got.float() - reference.float()).norm() / reference.float().norm()).item()
    return {**launch, "us": ms * 1000, "tflops": chunk.flops / ms / 1e9, "rel_diff": err}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--past", type=int, default=400)
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    results = []
    for shape, dtype in itertools.product(args.shapes, (torch.bfloat16, torch.float8_e4m3fn)):
        chunk = Chunk(shape, args.tokens, args.past, dtype)
        reference = chunk.run().clone()
        launches = [{}]
        if args.sweep:
            launches += [
                dict(block_m=m, block_n=n, num_warps=w, num_stages=s)
                for m, n, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
            ]
        for launch in launches:
            result = {
                "shape": shape,
                "cache": str(dtype).removeprefix("torch."),
                "prompts": len(chunk.lens),
                **timed(chunk, reference, launch),
            }
            results.append(result)
            settings = " ".join(f"{k}={v}" for k, v in launch.items()) or "served settings"
            if "error" in result:
                print(f"{shape} {result['cache']} {settings}: {result['error']}", flush=True)
            else:
                print(
                    f"{shape} {result['cache']} {settings}: {result['us']:.1f} us, "
                    f"{result['tflops']:.0f} TFLOPS, rel diff {result['rel_diff']:.1e}",
                    flush=True,
                )
    write_report(
        report_path("prefill_attention.json"),
        device=torch.cuda.get_device_name(),
        tokens=args.tokens,
        past=args.past,
        results=results,
    )


if __name__ == "__main__":
    main()
