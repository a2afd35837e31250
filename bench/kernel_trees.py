"""The quantized CPU matmuls of this tree beside another tree's, on the default model's layer
shapes in each GGUF type the kernels run (Q8_0 and Q5_0 in the int8 kernel, Q4_1 and Q4_K in
the 4-bit one, Q6_K in the K-quant one), both built for the variant chosen at run time.

`--against DIR`: a folder holding the other tree's `inflight/model/kernels/cpu` sources (e.g.
from `git archive`). At each M (16: a decode step's rows, each call on the next of `--copies`
copies of the weight so that they stream from memory as a model's do; 608: a short-chat prefill,
one copy), the two trees' outputs are checked for the same bits, then timed in turn: the best
of `--rounds` rounds, ms a call, at torch's thread count.

    .venv/bin/python bench/kernel_trees.py --against DIR [--copies 30] [--rounds 20]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

import torch

from inflight.bench.report import report_path, write_report
from inflight.model.kernels.cpu import blocks, int8, native, q4

sys.path.insert(0, str(Path(__file__).parent))
from k_quant_linear import random_blocks  # noqa: E402

# (K, N) of SmolLM2-135M's layers: q and o, gate and up, down.
SHAPES = [(576, 576), (576, 1536), (1536, 576)]
TYPES = ["Q8_0", "Q5_0", "Q4_1", "Q4_K", "Q6_K"]
# The kernel of each function a weight names, and the build flag of its form.
SOURCES = {"int8_linear": "int8_matmul.c", "q4_linear": "q4_matmul.c", "k8_linear": "k8_matmul.c"}
P, I64 = ctypes.c_void_p, ctypes.c_int64


def weight_of(type_name: str, k: int, n: int, seed: int) -> blocks.BlockWeight:
    if type_name == "Q4_1":
        return q4.quantize_q4(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
    return blocks.block_weight(type_name, random_blocks(type_name, n, k, seed), k)


def other_kernel(folder: Path, weight: blocks.BlockWeight, call: blocks.KernelCall):
    """The other tree's build of the kernel `call` runs, for the same weight form."""
    name = call.kernel.__name__
    flags: tuple[str, ...] = ()
    if getattr(weight, "small", False):
        flags = ("-DINFLIGHT_SMALL_WEIGHTS",)
    if getattr(weight, "centered", False):
        flags = ("-DINFLIGHT_CENTERED",)
    chosen = native.chosen_variant()
    variant = native.Variant(f"{chosen.name} {flags}", (*chosen.flags, *flags), chosen.needs)
    lib = native.build(folder / SOURCES[name], f"{name} of --against", variant)
    fn = getattr(lib, name)
    fn.argtypes = call.kernel.argtypes
    fn.restype = ctypes.c_int
    return fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", type=Path, required=True)
    parser.add_argument("--copies", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    print(f"variant {native.chosen_variant().name}, {torch.get_num_threads()} threads")
    rows = []
    for type_name in TYPES:
        for k, n in SHAPES:
            if type_name in ("Q4_K", "Q6_K") and k % 256:
                continue  # K-quants: whole superblocks of 256
            weights = [weight_of(type_name, k, n, seed) for seed in range(args.copies)]
            calls = [blocks.kernel_call(w, None) for w in weights]
            other = other_kernel(args.against, weights[0], calls[0])
            kernels = {"this": calls[0].kernel, "against": other}
            for m, copies in ((16, args.copies), (608, 1)):
                x = torch.randn(m, k)

                def run(fn, i: int, x=x, k=k, n=n, calls=calls, name=type_name) -> torch.Tensor:
                    return int8.run_kernel(fn, name, x, k, n, calls[i].tensors, None)

                same = torch.equal(run(kernels["this"], 0), run(kernels["against"], 0))
                best = {name: float("inf") for name in kernels}
                for _ in range(args.rounds):
                    for name, fn in kernels.items():
                        start = time.perf_counter()
                        for i in range(copies):
                            run(fn, i)
                        best[name] = min(best[name], (time.perf_counter() - start) / copies)
                row = dict(type=type_name, k=k, n=n, m=m, copies=copies, same_bits=same)
                row |= {f"{name}_ms": 1e3 * t for name, t in best.items()}
                rows.append(row)
                print(
                    f"{type_name} {k}x{n} M={m:<4} this {row['this_ms']:.3f} ms, against "
                    f"{row['against_ms']:.3f} ({best['this'] / best['against']:.2f}x time), "
                    f"same bits: {same}",
                    flush=True,
                )
    path = report_path("kernel_trees.json")
    write_report(
        path,
        variant=native.chosen_variant().name,
        threads=torch.get_num_threads(),
        cpu_flags=sorted(native.cpu_flags()),
        rows=rows,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
