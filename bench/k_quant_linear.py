"""GGUF K-quant CPU matmuls (Q4_K in the 4-bit kernel, Q5_K and Q6_K in k8_matmul.c) and Q5_0
(llama.cpp's fallback for them: the int8 kernel's build for small weights) beside the
oneDNN-packed float32 one and the int8 kernel, on shapes whose K is a multiple of 256.

Per shape and batch size M: the best time per call over `--repeats` rounds, the kernels taking
turns within a round (the machine's cores are shared: see int8_linear.py). Weights are random
valid blocks; the float32 and int8 paths run the Q4_K weights dequantized. `--copies C`: each
call runs C copies of its weight in turn (time per copy reported), so that the working set
outgrows the caches and the weights stream from memory, as a whole model's do.

    .venv/bin/python bench/k_quant_linear.py [--repeats 10] [--budget 0.05] [--m 1 16 128]
        [--copies 1]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from inflight.model.kernels.cpu import blocks
from inflight.model.kernels.cpu.int8 import int8_linear, quantize_weight

sys.path.insert(0, str(Path(__file__).parent))
from int8_linear import best_times  # noqa: E402

# name: (K, N). SmolLM2-135M's down_proj (K = 1536; its other K, 576, is no multiple of 256),
# and a Llama-3.2-1B-like up projection.
SHAPES = {"down": (1536, 576), "up_1b": (2048, 8192)}
# Q8_0 runs from its blocks in the int8 kernel (its column), Q5_0 in that kernel's build for
# small weights.
K_QUANTS = ("Q5_0", "Q4_K", "Q5_K", "Q6_K")


def random_blocks(type_name: str, rows: int, k: int, seed: int) -> np.ndarray:
    """Valid random rows of `type_name`: random bytes, float16 d (and dmin) about 1e-3."""
    rng = np.random.default_rng(seed)
    values, size = blocks.BLOCK_SHAPES[type_name]
    raw = rng.integers(0, 256, (rows, k // values, size), dtype=np.uint8)
    half = rng.uniform(5e-4, 2e-3, (rows, k // values, 2)).astype(np.float16).view(np.uint8)
    if type_name == "Q6_K":
        raw[..., 208:210] = half[..., :2]
    elif type_name == "Q5_0":
        raw[..., 0:2] = half[..., :2]
    else:
        raw[..., 0:4] = half
    return raw.reshape(rows, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--budget", type=float, default=0.05, help="seconds per timed run")
    parser.add_argument("--copies", type=int, default=1, help="weights per call, in turn")
    args = parser.parse_args()
    types = K_QUANTS
    print(f"{'shape':>6} {'K':>5} {'N':>5} {'M':>4} {'fp32 ms':>8} {'int8 ms':>8}", end="")
    print("".join(f" {t + ' ms':>8}" for t in types))
    for name, (k, n) in SHAPES.items():
        raws = {t: random_blocks(t, n, k, seed=0) for t in types}
        weight = torch.from_numpy(dequantize(raws["Q4_K"], GGMLQuantizationType.Q4_K))
        copies = range(args.copies)
        packed = [torch.ops.mkldnn._reorder_linear_weight(weight.float(), None) for _ in copies]
        quantized = [quantize_weight(weight.float()) for _ in copies]
        runs = {t: [blocks.block_weight(t, raw, k) for _ in copies] for t, raw in raws.items()}
        for m in args.m:
            x = torch.randn(m, k)
            fns = [
                lambda x=x, ps=packed: [
                    torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in ps
                ],
                lambda x=x, qs=quantized: [int8_linear(x, q) for q in qs],
                *(
                    lambda x=x, ws=ws: [blocks.block_linear(x, w) for w in ws]
                    for ws in runs.values()
                ),
            ]
            times = [t / args.copies for t in best_times(fns, args.budget, args.repeats)]
            print(f"{name:>6} {k:>5} {n:>5} {m:>4}" + "".join(f" {t * 1e3:8.3f}" for t in times))


if __name__ == "__main__":
    main()
