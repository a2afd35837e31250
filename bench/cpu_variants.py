"""The int8 and 4-bit CPU matmuls of every instruction-set variant this machine runs, side by
side (and beside another tree's kernels: `--against DIR`, a folder holding that tree's
`inflight/model/kernels/cpu` sources, e.g. from `git archive`), alternated in rounds; the int8
kernel on weights within -16..15 (Q5_0's) in its general build and in its build for small
weights.

Per kernel, variant and M: the best of `--repeats` calls, ms, at the head's shape of the
default model (49,152 x 576) and its gate_up (3,072 x 576), at torch's thread count.

    .venv/bin/python bench/cpu_variants.py [--m 1 16] [--rounds 2] [--against DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from functools import partial
from pathlib import Path

import torch

from inflight.bench.report import report_path, write_report
from inflight.model.kernels.cpu import int8, native, q4

sys.path.insert(0, str(Path(__file__).parent))
from cpu_attention import best_ms  # noqa: E402

SHAPES = {"head": (576, 49152), "gate_up": (576, 3072)}
P, I64 = ctypes.c_void_p, ctypes.c_int64


def _kernels_of(folder: Path) -> dict[str, ctypes.CDLL]:
    """Another tree's int8 and 4-bit kernels, built for AVX2."""
    i8 = native.build(folder / "int8_matmul.c", "the int8 matmul of --against")
    i8.int8_linear.argtypes = [P, I64, I64, P, P, I64, P, P, ctypes.c_int]
    k4 = native.build(folder / "q4_matmul.c", "the 4-bit matmul of --against")
    k4.q4_linear.argtypes = [P, I64, I64, P, P, P, I64, P, P, ctypes.c_int]
    return {"int8": i8, "q4": k4}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--against", type=Path, help="another tree's kernels/cpu folder")
    args = parser.parse_args()
    # "q5_0": weights within -16..15 (GGUF's Q5_0) in the int8 kernel's build for small weights,
    # beside "int8", the general build, on the same weights.
    libs = {
        v.name: {
            "int8": int8.load_variant(v),
            "q5_0": int8.load_variant(v, small=True),
            "q4": q4.load_variant(v),
        }
        for v in native.runnable_variants()
    }
    if args.against:
        libs["against (avx2)"] = _kernels_of(args.against)
    print(f"CPU variants runnable here: {[v.name for v in native.runnable_variants()]}")
    torch.manual_seed(0)
    rows = []
    for shape, (k, n) in SHAPES.items():
        weight = torch.randn(n, k) * 0.02
        w5 = int8.pack_int8(
            torch.randint(-16, 16, (n, k), dtype=torch.int8), torch.rand(n, k // 32) * 1e-2
        )
        w4 = q4.quantize_q4(weight)
        tensors = {
            "int8": (w5.values, w5.scales),
            "q5_0": (w5.values, w5.scales),
            "q4": (w4.values, w4.scales, w4.mins),
        }
        for m in args.m:
            x = torch.randn(m, k)
            for rnd in range(args.rounds):
                for kind in ("int8", "q5_0", "q4"):
                    for name, lib in libs.items():
                        if kind not in lib:
                            continue
                        fn = lib[kind].q4_linear if kind == "q4" else lib[kind].int8_linear
                        call = partial(int8.run_kernel, fn, kind, x, k, n, tensors[kind], None)
                        ms = best_ms(call, args.repeats)
                        rows.append(
                            dict(shape=shape, m=m, round=rnd, kind=kind, variant=name, ms=ms)
                        )
                        print(f"{shape:>8} M={m:<4} round {rnd} {kind:>5} {name:>16}: {ms:8.3f} ms")
    path = report_path("cpu_variants.json")
    write_report(
        path, threads=torch.get_num_threads(), cpu_flags=sorted(native.cpu_flags()), rows=rows
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
