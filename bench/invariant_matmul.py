"""The batch-invariant matmul's launch shapes against cuBLAS, on the linear layers of a model.

For each tile shape (`matmul.Tiles`) and each layer of `--shapes` (qkv, o, gate_up, down, the
head), the kernel's time at `--m` rows beside `torch.nn.functional.linear`'s, and per shape the
sum a decode step of 256 rows and a prefill step of 8,192 tokens pays over all its layers.
Then whether the bits move: each tile shape's rows at every M against the same rows computed
alone (they must not: that is the mode's promise), and which tile shapes give the same bits as
`DECODE_TILES` (the same sums in the same order): `tiles_for` may only choose among those.

    python3 bench/invariant_matmul.py [--shapes qwen3-0.6b llama-3.1-8b] [--m 1 64 256 8192]
        (prints the figures; writes JSON to $OUT or bench/out)
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from inflight.bench.random_model import SHAPES
from inflight.bench.report import report_path, write_report
from inflight.model.kernels.triton.matmul import (
    DECODE_TILES,
    PREFILL_TILES,
    Tiles,
    invariant_linear,
)

CANDIDATES = [
    DECODE_TILES,
    PREFILL_TILES,
    Tiles(64, 128, 64, 8, 4, 3),
    Tiles(64, 256, 64, 8, 8, 3),
    Tiles(64, 128, 128, 8, 4, 3),
    Tiles(128, 128, 64, 8, 4, 4),
    Tiles(128, 128, 64, 8, 8, 4),
    Tiles(128, 256, 64, 8, 8, 3),
    Tiles(128, 64, 64, 8, 4, 4),
]
DECODE_ROWS, PREFILL_TOKENS = 256, 8192


def _tiled(tiles: Tiles):
    return partial(invariant_linear, tiles=tiles)


def layers(shape: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear layer of `shape` (the projections fused as the loader fuses them)."""
    c = SHAPES[shape]
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {
        "qkv": (q + 2 * kv, c.hidden_size),
        "o": (c.hidden_size, q),
        "gate_up": (2 * c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
        "head": (c.vocab_size, c.hidden_size),
    }


def step_ms(times: dict[tuple[str, int], float], shape: str, m: int) -> float:
    """A step's matmul time: every decoder layer's linears at m rows, the head at 256 (a
    prefill step computes logits for its decode rows and last prompt tokens only)."""
    layer = sum(times[(name, m)] for name in ("qkv", "o", "gate_up", "down"))
    return SHAPES[shape].num_layers * layer + times[("head", DECODE_ROWS)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 64, 256, 8192])
    args = parser.parse_args()
    ms_list = sorted(set(args.m) | {DECODE_ROWS, PREFILL_TOKENS})
    torch.manual_seed(0)
    dev = torch.device("cuda")
    report: dict = {"shapes": {}}
    for shape in args.shapes:
        results: dict[str, dict] = {}
        x_all = torch.randn(max(ms_list), 16384, device=dev, dtype=torch.bfloat16)
        for tiles in [None, *CANDIDATES]:
            label = "cublas" if tiles is None else "x".join(map(str, vars(tiles).values()))
            times: dict[tuple[str, int], float] = {}
            moved, same_as_decode = 0, True
            for name, (n, k) in layers(shape).items():
                w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
                for m in ms_list:
                    x = x_all[:m, :k].contiguous()
                    run = partial(F.linear if tiles is None else _tiled(tiles), x, w)
                    times[(name, m)] = do_bench(run)
                    if tiles is not None:  # rows 0 and m - 1 alone against themselves among m
                        y = run()
                        for r in {0, m - 1}:
                            moved += not torch.equal(_tiled(tiles)(x[r : r + 1], w), y[r : r + 1])
                if tiles is not None:
                    # the bits of 256 rows, against the decode tiles' (same sums, same order?)
                    x = x_all[:DECODE_ROWS, :k].contiguous()
                    same_as_decode &= torch.equal(
                        invariant_linear(x, w, tiles=tiles),
                        invariant_linear(x, w, tiles=DECODE_TILES),
                    )
            entry = {
                "layers_ms": {f"{name}@{m}": round(t, 4) for (name, m), t in times.items()},
                "decode_step_ms": round(step_ms(times, shape, DECODE_ROWS), 3),
                "prefill_step_ms": round(step_ms(times, shape, PREFILL_TOKENS), 3),
            }
            if tiles is not None:
                entry["rows_moved"] = moved
                entry["same_bits_as_decode_tiles"] = same_as_decode
            results[label] = entry
            print(
                f"{shape:14s} {label:22s} decode step {entry['decode_step_ms']:8.3f} ms   "
                f"prefill step {entry['prefill_step_ms']:8.3f} ms   "
                + (
                    ""
                    if tiles is None
                    else f"rows moved {moved}  same bits as decode tiles {same_as_decode}"
                ),
                flush=True,
            )
            for name in layers(shape):
                print(
                    "    "
                    + name.ljust(8)
                    + "  ".join(f"M={m}: {times[(name, m)] * 1000:8.1f} us" for m in ms_list)
                )
        report["shapes"][shape] = results
    path = report_path("invariant_matmul.json")
    write_report(path, **report)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
