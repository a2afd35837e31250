"""Int8- and 4-bit-weight CPU matmuls beside the oneDNN-packed float32 one, on SmolLM2-135M's
shapes.

Per shape and batch size M: the best time per call over `--repeats` runs of (a) the float32
path exactly as `PackedLinearMethod` sets it up, (b) the int8 kernel and (c) the 4-bit kernel
(activation quantization included), at torch's thread count. The step estimate sums 30 layers of
qkv + o + gate_up + down and one head; for q4 the head is int8, as `quantization="q4"` runs it.

    .venv/bin/python bench/int8_linear.py [--repeats 10] [--budget 0.05] [--m 1 16 128 1600]
    INFLIGHT_CPU_ISA=avx2 .venv/bin/python bench/int8_linear.py   (a lower kernel variant)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from inflight.bench.report import write_report
from inflight.model.kernels.cpu import native
from inflight.model.kernels.cpu.int8 import int8_linear, quantize_weight
from inflight.model.kernels.cpu.q4 import q4_linear, quantize_q4

LAYERS = 30
# name: (K, N), SmolLM2-135M: hidden 576, intermediate 1536, 9 + 2 * 3 heads of 64, vocab 49152.
SHAPES = {
    "qkv": (576, 960),
    "o": (576, 576),
    "gate_up": (576, 3072),
    "down": (1536, 576),
    "head": (576, 49152),
}


def calls_for(fn, budget: float) -> int:
    """How many calls of `fn` take about `budget` seconds (at least one)."""
    fn()
    start = time.perf_counter()
    fn()
    return max(1, int(budget / max(time.perf_counter() - start, 1e-6)))


def best_times(fns: list, budget: float, repeats: int) -> list[float]:
    """Best mean seconds per call of each of `fns` over `repeats` rounds, the functions taking
    turns within a round so that a noisy neighbour on the shared cores hits them alike."""
    calls = [calls_for(fn, budget) for fn in fns]
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, (fn, n) in enumerate(zip(fns, calls, strict=True)):
            start = time.perf_counter()
            for _ in range(n):
                fn()
            best[i] = min(best[i], (time.perf_counter() - start) / n)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 128, 1600])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--budget", type=float, default=0.05, help="seconds per timed run")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out/int8_linear.json")
    args = parser.parse_args()

    torch.manual_seed(0)
    rows = []
    variant = native.chosen_variant().name
    print(
        f"kernel variant: {variant} (runnable here: {[v.name for v in native.runnable_variants()]})"
    )
    print(
        f"{'shape':>8} {'K':>5} {'N':>6} {'M':>5} {'fp32 ms':>9} {'int8 ms':>9} {'q4 ms':>9} "
        f"{'int8 x':>7} {'q4 x':>7}"
    )
    for name, (k, n) in SHAPES.items():
        weight = torch.randn(n, k) * 0.02
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        quantized, q4 = quantize_weight(weight), quantize_q4(weight)
        for m in args.m:
            x = torch.randn(m, k)
            fp32, int8, four = best_times(
                [
                    lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise(
                        x, p, None, "none", [], ""
                    ),
                    lambda x=x, q=quantized: int8_linear(x, q),
                    lambda x=x, q=q4: q4_linear(x, q),
                ],
                args.budget,
                args.repeats,
            )
            rows.append(
                {
                    "shape": name,
                    "k": k,
                    "n": n,
                    "m": m,
                    "fp32_s": fp32,
                    "int8_s": int8,
                    "q4_s": four,
                }
            )
            print(
                f"{name:>8} {k:>5} {n:>6} {m:>5} {fp32 * 1e3:>9.3f} {int8 * 1e3:>9.3f} "
                f"{four * 1e3:>9.3f} {fp32 / int8:>6.2f}x {fp32 / four:>6.2f}x"
            )

    steps = {}
    for m in args.m:
        per = {r["shape"]: r for r in rows if r["m"] == m}
        step = {
            key: sum(per[s][key] * (1 if s == "head" else LAYERS) for s in SHAPES)
            for key in ("fp32_s", "int8_s")
        }
        step["q4_s"] = per["head"]["int8_s"] + LAYERS * sum(
            per[s]["q4_s"] for s in SHAPES if s != "head"
        )
        steps[m] = step
        print(
            f"30 layers + head at M={m}: fp32 {step['fp32_s'] * 1e3:.2f} ms, "
            f"int8 {step['int8_s'] * 1e3:.2f} ms ({step['fp32_s'] / step['int8_s']:.2f}x), "
            f"q4 {step['q4_s'] * 1e3:.2f} ms ({step['fp32_s'] / step['q4_s']:.2f}x)"
        )

    write_report(
        args.out,
        threads=torch.get_num_threads(),
        variant=variant,
        torch=torch.__version__,
        repeats=args.repeats,
        rows=rows,
        step_matmuls_per_m={str(m): s for m, s in steps.items()},
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
