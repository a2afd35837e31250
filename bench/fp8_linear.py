"""FP8 linear layers against bf16 ones, by row count, on the decoder layers of a model.

For each linear layer of `--shapes` (qkv, o, gate_up, down: the layers FP8 mode quantizes) at
each of `--m` rows: bf16 `F.linear`; cuBLASLt's FP8 path in parts (the activations' per-row
quantization, `torch._scaled_mm`) and whole; and at <= `fp8_matmul.MAX_ROWS` rows the few-rows
kernel, whole (quantization included) and alone. Times are CUDA-graph replays (a decode step
runs in one) cycling over copies of the weight larger than L2 together, as a step's layers
read theirs. Bandwidth: the FP8 weight's bytes over the time. Then the sums over a step's
decoder layers (`fp8_product`: what `Fp8LinearMethod` runs, the kernel where
`fp8_matmul.takes` the call, else cuBLASLt), and each FP8 path's largest error against the
float64 value of the same quantized operands (relative to the output's largest magnitude).
Every row count also times cuBLASLt's tensorwise GEMM with the scaling kernel after it
(`fp8_tensorwise`), quantization included.
`--sweep`: the few-rows kernel's tiles of activation rows and cuts of K at each layer and row
count. `--library`: other ways to call the library at each layer and row count, each timed alone
and named by the CUDA kernels it launches (which GEMM `_scaled_mm` picks is the library's
choice by shape): `_scaled_mm` as shipped; the transposed problem, y^T = w @ xq^T with the
scales swapped, then copied back to [M, N] (another tile and cluster dispatch of the same
rowwise GEMM); per-tensor scales of 1 (cuBLASLt's tensorwise path) with a bf16 and a float32
output, the time a GEMM whose row and column scales were applied by the next kernel would take.

    python3 bench/fp8_linear.py [--shapes qwen3-0.6b llama-3.1-8b] [--m 1 4 16 32 64 128 256]
        [--sweep] [--library]   (prints the figures; writes JSON to $OUT or bench/out)
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from invariant_matmul import layers
from triton.testing import do_bench_cudagraph

from inflight.bench.random_model import SHAPES
from inflight.bench.report import report_path, write_report
from inflight.model.kernels.triton import fp8_matmul, fp8_tensorwise
from inflight.model.kernels.triton import ops as triton_ops
from inflight.model.kernels.triton.plan import multiprocessors
from inflight.model.layers.quantization import FP8_MAX, fp8_rows

DECODER_LAYERS = ("qkv", "o", "gate_up", "down")


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return triton_ops.fp8_rows(x, FP8_MAX)


# Bytes of weights a timed call cycles through, above the H200's 50 MB L2, so that each call
# reads its weight from memory as a step's layers do (one copy would stay in L2).
ROTATE_BYTES = 256 * 2**20
# A multiprocessor's shared memory for a program's loads in flight (the H200's 227 KB, less
# what Triton keeps for itself).
SHARED_BYTES = 220 * 1024


def _us(fn, copies: int) -> float:
    """Microseconds a call of fn(i) takes, i cycling over the weight's copies."""
    return do_bench_cudagraph(lambda: [fn(i) for i in range(copies)], rep=30) * 1000 / copies


def _sweep(m: int, time_it) -> list[tuple[float, dict]]:
    """The kernel's candidates at m rows, fastest first: every tile of activation rows and cut
    of K, on the default launch shape (the best or within 6 % of it at 1-64 rows before the
    cuts existed: `bench/RESULTS.md`)."""
    default = fp8_matmul.Fp8Tiles()
    candidates = [
        dataclasses.replace(default, block_m=bm, split=split)
        for bm, split in itertools.product((16, 32, 64, 128), (1, 2, 4))
        if bm <= fp8_matmul.row_tile(m)
        and (default.block_n + bm) * default.block_k * default.stages <= SHARED_BYTES
    ]
    return sorted(((time_it(c), vars(c)) for c in candidates), key=lambda s: s[0])


def _kernels(fn) -> list[str]:
    """The CUDA kernels one call of fn launches, by name."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.key for e in prof.key_averages() if e.self_device_time_total > 0})


def _library(
    rowwise: Callable[[int], torch.Tensor],
    fp8: list[tuple[torch.Tensor, torch.Tensor]],
    xq: torch.Tensor,
    xs: torch.Tensor,
    exact: torch.Tensor,
    copies: int,
) -> dict:
    """`--library`'s candidates at one layer and row count (see the module's docstring);
    `rowwise(i)`: `_scaled_mm` as shipped on the i-th weight copy."""
    one = torch.ones((), device=xq.device)

    def transposed(i: int) -> torch.Tensor:
        wq, ws = fp8[i]
        yt = torch._scaled_mm(wq, xq.t(), scale_a=ws, scale_b=xs.t(), out_dtype=torch.bfloat16)
        return yt.t().contiguous()

    def tensorwise(i: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch._scaled_mm(xq, fp8[i][0].t(), scale_a=one, scale_b=one, out_dtype=dtype)

    candidates = {"rowwise": rowwise}
    if xq.shape[0] % 16 == 0:  # `_scaled_mm` takes a second operand of whole 16s only
        candidates["transposed"] = transposed
    candidates["tensorwise_bf16"] = tensorwise
    candidates["tensorwise_f32"] = lambda i: tensorwise(i, torch.float32)
    top = exact.abs().max().item()
    out = {}
    for name, fn in candidates.items():
        out[name] = {"us": _us(fn, copies), "kernels": _kernels(lambda fn=fn: fn(0))}
        if name in ("rowwise", "transposed"):
            out[name]["error"] = (fn(0).double() - exact).abs().max().item() / top
    return out


def _measure(weight: torch.Tensor, m: int, sweep: bool, library: bool) -> dict:
    """One layer's figures at m rows (see the module's docstring)."""
    n, k = weight.shape
    copies = max(1, ROTATE_BYTES // (n * k))
    weights = [weight] + [torch.randn_like(weight) * 0.02 for _ in range(copies - 1)]
    fp8 = [fp8_rows(w) for w in weights]
    x = torch.randn(m, k, device=weight.device, dtype=torch.bfloat16)
    xq, xs = _quantize(x)
    wq, ws = fp8[0]
    exact = (xq.double() * xs.double()) @ (wq.double() * ws.double()).t()
    top = exact.abs().max().item()

    def scaled(i: int, xq: torch.Tensor = xq, xs: torch.Tensor = xs) -> torch.Tensor:
        wq, ws = fp8[i]
        return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16)

    row = {
        "bf16_us": _us(lambda i: F.linear(x, weights[i]), copies),
        "quantize_us": _us(lambda i: _quantize(x), copies),
        "scaled_mm_us": _us(scaled, copies),
        "fp8_shipped_us": _us(lambda i: scaled(i, *_quantize(x)), copies),
        "scaled_mm_error": (scaled(0).double() - exact).abs().max().item() / top,
    }

    one = torch.ones((), device=weight.device)

    def tensorwise(i: int, xq: torch.Tensor = xq, xs: torch.Tensor = xs) -> torch.Tensor:
        wq, ws = fp8[i]
        return fp8_tensorwise.fp8_tensorwise_linear(xq, xs, wq, ws, None, torch.bfloat16, one=one)

    row["tensorwise_taken"] = fp8_tensorwise.takes(m, n, k)
    row["fp8_tensorwise_us"] = _us(lambda i: tensorwise(i, *_quantize(x)), copies)
    row["tensorwise_error"] = (tensorwise(0).double() - exact).abs().max().item() / top
    if library:
        row["library"] = _library(scaled, fp8, xq, xs, exact, copies)
        for name, fig in row["library"].items():
            error = f", error {fig['error']:.1e}" if "error" in fig else ""
            print(f"  library {n}x{k} m={m} {name}: {fig['us']:.1f} us{error}; kernels "
                  f"{' | '.join(fig['kernels'])}")  # fmt: skip
    if m > fp8_matmul.MAX_ROWS:
        return row

    def few(
        i: int, tiles: fp8_matmul.Fp8Tiles, xq: torch.Tensor = xq, xs: torch.Tensor = xs
    ) -> torch.Tensor:
        return fp8_matmul.fp8_few_rows_linear(xq, xs, *fp8[i], None, torch.bfloat16, tiles)

    tiles = fp8_matmul.Fp8Tiles()
    sms = multiprocessors(weight.device)
    row["plan"] = "/".join(map(str, fp8_matmul.plan(m, n, k, tiles, sms)))
    row["taken"] = fp8_matmul.takes(m, n, sms)
    row["few_rows_us"] = _us(lambda i: few(i, tiles), copies)
    row["fp8_few_rows_us"] = _us(lambda i: few(i, tiles, *_quantize(x)), copies)
    row["few_rows_error"] = (few(0, tiles).double() - exact).abs().max().item() / top
    if sweep:
        swept = _sweep(m, lambda c: _us(lambda i: few(i, c), copies))
        row["sweep_best"] = swept[:5]
        row["sweep_plans"] = {f"{t['block_m']}/{t['split']}": us for us, t in swept}
        plans = ", ".join(f"{p} {us:.1f}" for p, us in row["sweep_plans"].items())
        print(f"  sweep {n}x{k} m={m}: shipped {row['few_rows_us']:.1f} us (block_m/split "
              f"{row['plan']}); block_m/split: {plans}")  # fmt: skip
    return row


def _line(row: dict, gb: float) -> str:
    def bw(us: float) -> str:
        return f"{gb / (us / 1e6):.0f} GB/s"

    line = (
        f"bf16 {row['bf16_us']:.1f} us; fp8 shipped {row['fp8_shipped_us']:.1f} (quantize "
        f"{row['quantize_us']:.1f}, scaled_mm {row['scaled_mm_us']:.1f} = "
        f"{bw(row['scaled_mm_us'])}, error {row['scaled_mm_error']:.1e}); tensorwise + scales "
        f"{row['fp8_tensorwise_us']:.1f} (error {row['tensorwise_error']:.1e}"
        f"{', taken' if row['tensorwise_taken'] else ''})"
    )
    if "few_rows_us" in row:
        line += (
            f"; few-rows {row['fp8_few_rows_us']:.1f} (alone {row['few_rows_us']:.1f} = "
            f"{bw(row['few_rows_us'])}, error {row['few_rows_error']:.1e}, block_m/split "
            f"{row['plan']})"
        )
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128, 256])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--library", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    report: dict = {"shapes": {}}
    for shape in args.shapes:
        per_layer: dict[str, dict] = {}
        for name in DECODER_LAYERS:
            n, k = layers(shape)[name]
            weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            for m in args.m:
                row = per_layer[f"{name}@{m}"] = _measure(weight, m, args.sweep, args.library)
                print(f"{shape} {name} ({n}x{k}) m={m}: {_line(row, n * k / 1e9)}", flush=True)
        sums = {}
        for m in args.m:
            rows = [per_layer[f"{nm}@{m}"] for nm in DECODER_LAYERS]
            for row in rows:  # what `Fp8LinearMethod` runs
                taken = "fp8_tensorwise_us" if row["tensorwise_taken"] else "fp8_shipped_us"
                row["fp8_product_us"] = row["fp8_few_rows_us" if row.get("taken") else taken]
            keys = ["bf16_us", "fp8_shipped_us", "fp8_product_us"]
            layers_ms = {key: sum(row[key] for row in rows) / 1000 for key in keys}
            sums[m] = {key: SHAPES[shape].num_layers * v for key, v in layers_ms.items()}
            figures = ", ".join(f"{key[:-3]} {v:.3f}" for key, v in sums[m].items())
            print(f"{shape}: a step's decoder linears at {m} rows, ms: {figures}")
        report["shapes"][shape] = {"layers": per_layer, "step_ms": sums}
    write_report(report_path("fp8_linear.json"), **report)


if __name__ == "__main__":
    main()
