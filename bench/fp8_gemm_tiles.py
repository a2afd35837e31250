"""Triton FP8 (e4m3) GEMMs against cuBLASLt at 64-256 rows, on Llama-3.1-8B's decoder linears
(`--dtype bf16`: the same kernels on bf16 operands with scales of 1, against cuBLAS's `F.linear`).

Every candidate computes `fp8_matmul`'s formula, y = (xq * xs) @ (w * ws)^T in bf16 from xq
[M, K], w [N, K] in e4m3 and scales xs [M, 1], ws [N, 1] in float32, summing in float32 with
the tensor cores' FP8 sums moved into it every `PROMOTE` of K, transposed as the few-rows kernel
is (weight rows on the MMA's long side). Kinds: `tiled` (a program a tile of weight rows x
activation rows, pointer loads, `num_stages` in flight; the M tiles of one weight tile are
launched side by side so the weight is read from memory once), `tma` (the same, loaded through
host-made tensor descriptors), `splitk` (K split over a third grid axis into float32 partials,
added and scaled by a second kernel: o, qkv and down only), `persistent` (optional: one TMA
program a multiprocessor looping over tiles). References: `torch._scaled_mm` (cuBLASLt) and
at <= 64 rows the product's few-rows kernel. Times as `fp8_linear.py` takes them (CUDA-graph
replays cycling over weight copies larger than L2); error: the largest difference from the
float64 formula over its largest magnitude (above ERROR_LIMIT: flagged, not a winner). The
tiles are searched in phases (`_measure`): ~800 timings in all, ~6-7 min on an H200; --quick
~250, ~2 min. Each layer and row count's figures are written as they come.

    PYTHONPATH=.:bench python3 bench/fp8_gemm_tiles.py [--m 64 128 192 256]
        [--layers qkv o gate_up down] [--kinds tiled tma splitk persistent] [--quick]
        [--dtype fp8 | bf16]
        (prints the figures; writes JSON to $OUT or bench/out)
    --interpret-check: small cases of each kind on the CPU, in Triton's interpreter.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
import triton
import triton.language as tl
from fp8_linear import ROTATE_BYTES, _us
from triton.tools.tensor_descriptor import TensorDescriptor

from inflight.bench.report import report_path, write_report
from inflight.model.kernels.triton.fp8_matmul import PROMOTE, fp8_few_rows_linear
from inflight.model.kernels.triton.plan import multiprocessors
from inflight.model.layers.quantization import fp8_rows

# Bytes of K a step loads of each row: 128 float8 or 64 bf16 values.
STEP_BYTES = 128
SHARED_BYTES = 220 * 1024  # loads in flight a program may keep (the H200 has 227 KB)
ERROR_LIMIT = 5e-3
LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SPLIT_LAYERS = ("qkv", "o", "down")
KINDS = ("tiled", "tma", "splitk", "persistent")


@triton.jit
def _store(acc, Y, XS, WS, rows, cols, M, N, split, SPLIT: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] (weight rows x activation rows) into Y [M, N]: scaled to bf16,
    or with SPLIT > 1 unscaled into split `split`'s float32 partial [SPLIT, M, N]."""
    inside = (rows[None, :] < M) & (cols[:, None] < N)
    offsets = rows[None, :] * N + cols[:, None]
    if SPLIT == 1:
        acc = acc * tl.load(WS + cols, mask=cols < N, other=0.0)[:, None]
        acc = acc * tl.load(XS + rows, mask=rows < M, other=0.0)[None, :]
        tl.store(Y + offsets, acc.to(Y.dtype.element_ty), mask=inside)
    else:
        tl.store(Y + split * M * N + offsets, acc, mask=inside)


@triton.jit
def _tiled_kernel(
    X, XS, W, WS, Y, M, N, K, k_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr, PROMOTE: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    k = tl.arange(0, BLOCK_K)
    w_ptrs = W + cols[:, None].to(tl.int64) * K + k[None, :]
    x_ptrs = X + rows[None, :] * K + k[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for step in range(0, k_split, BLOCK_K):
        start = split * k_split + step  # the last split's last step may run past K
        if EVEN_K:
            w = tl.load(w_ptrs + start, mask=cols[:, None] < N, other=0.0)
            x = tl.load(x_ptrs + start, mask=rows[None, :] < M, other=0.0)
        else:
            inside = start + k < K
            w = tl.load(w_ptrs + start, mask=(cols[:, None] < N) & inside[None, :], other=0.0)
            x = tl.load(x_ptrs + start, mask=(rows[None, :] < M) & inside[:, None], other=0.0)
        acc = tl.dot(w, x, acc, max_num_imprecise_acc=PROMOTE)
    _store(acc, Y, XS, WS, rows, cols, M, N, split, SPLIT)


@triton.jit
def _tma_kernel(
    x_desc, XS, w_desc, WS, Y, M, N, K, k_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    PROMOTE: tl.constexpr,
):  # fmt: skip
    m0 = tl.program_id(0) * BLOCK_M
    n0 = tl.program_id(1) * BLOCK_N
    split = tl.program_id(2)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for step in range(0, k_split, BLOCK_K):
        start = split * k_split + step  # the last split's last step may run past K
        w = w_desc.load([n0, start])  # past K or N: zeros
        x = x_desc.load([m0, start])
        acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=PROMOTE)
    rows = m0 + tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    _store(acc, Y, XS, WS, rows, cols, M, N, split, SPLIT)


@triton.jit
def _persistent_kernel(
    x_desc, XS, w_desc, WS, Y, M, N, K, programs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PROMOTE: tl.constexpr,
):  # fmt: skip
    m_tiles = tl.cdiv(M, BLOCK_M)
    for tile in tl.range(tl.program_id(0), m_tiles * tl.cdiv(N, BLOCK_N), programs, flatten=True):
        m0 = (tile % m_tiles) * BLOCK_M  # a weight tile's M tiles on neighbouring programs
        n0 = (tile // m_tiles) * BLOCK_N
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for start in range(0, K, BLOCK_K):
            w = w_desc.load([n0, start])
            x = x_desc.load([m0, start])
            acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=PROMOTE)
        rows = m0 + tl.arange(0, BLOCK_M)
        cols = n0 + tl.arange(0, BLOCK_N)
        _store(acc, Y, XS, WS, rows, cols, M, N, 0, 1)


@triton.jit
def _reduce_kernel(P, XS, WS, Y, M, N, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """Y [M, N] bf16 = the sum of the float32 partials P [SPLIT, M, N], scaled."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < M * N
    acc = tl.load(P + offsets, mask=inside, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(P + s * M * N + offsets, mask=inside, other=0.0)
    acc *= tl.load(XS + offsets // N, mask=inside, other=0.0)
    acc *= tl.load(WS + offsets % N, mask=inside, other=0.0)
    tl.store(Y + offsets, acc.to(Y.dtype.element_ty), mask=inside)


@dataclass(frozen=True)
class Config:
    kind: str
    block_n: int
    block_m: int
    warps: int
    stages: int
    split: int = 1
    tma: bool = False  # splitk: loads through descriptors

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.block_n, self.block_m, self.warps

    def name(self) -> str:
        tail = f" split{self.split}{' tma' if self.tma else ''}" if self.kind == "splitk" else ""
        return f"{self.kind} {self.block_n}x{self.block_m} w{self.warps} s{self.stages}{tail}"


def block_k_of(dtype: torch.dtype) -> int:
    return STEP_BYTES // dtype.itemsize


def operands(
    rows: int, k: int, dtype: str, device: str = "cuda"
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random [rows, k] operand and its float32 scales [rows, 1]: e4m3 rows scaled to their
    largest magnitude, or bf16 with scales of 1 (`--dtype bf16`)."""
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    if dtype == "fp8":
        return fp8_rows(x)
    return x, torch.ones(rows, 1, device=device)


def gemm(cfg: Config, xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
         programs: int = 0) -> torch.Tensor:  # fmt: skip
    """y [M, N] bf16 by `cfg` (xs, ws: [M, 1], [N, 1] float32, contiguous); `programs`: the
    persistent kernel's (default: one a multiprocessor)."""
    (m, k), n = xq.shape, w.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16, device=xq.device)
    bm, bn, split = cfg.block_m, cfg.block_n, cfg.split
    launch = {"num_warps": cfg.warps, "num_stages": cfg.stages, "PROMOTE": PROMOTE}
    block_k = block_k_of(xq.dtype)
    blocks = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": block_k}
    if triton.cdiv(k, block_k) % split:
        raise ValueError(f"K {k}: {triton.cdiv(k, block_k)} steps of {block_k}, not {split} parts")
    k_split = triton.cdiv(k, block_k) // split * block_k
    out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=xq.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    if cfg.kind in ("tma", "persistent") or cfg.tma:
        x_d = TensorDescriptor.from_tensor(xq, [bm, block_k])
        w_d = TensorDescriptor.from_tensor(w, [bn, block_k])
        if cfg.kind == "persistent":
            sms = programs or multiprocessors(xq.device)
            grid = (min(sms, grid[0] * grid[1]),)
            _persistent_kernel[grid](x_d, xs, w_d, ws, y, m, n, k, grid[0], **blocks, **launch)
            return y
        _tma_kernel[grid](x_d, xs, w_d, ws, out, m, n, k, k_split, **blocks, SPLIT=split, **launch)
    else:
        _tiled_kernel[grid](xq, xs, w, ws, out, m, n, k, k_split, **blocks, SPLIT=split,
                            EVEN_K=k % block_k == 0, **launch)  # fmt: skip
    if split > 1:
        block = 1024
        _reduce_kernel[(triton.cdiv(m * n, block),)](out, xs, ws, y, m, n, SPLIT=split, BLOCK=block)
    return y


QUICK_SHAPES = ((128, 64, 4), (128, 128, 8), (64, 128, 4), (256, 64, 8))
SPLIT_SHAPES = ((64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 128, 8))


def _shapes(m: int, quick: bool, of: tuple = ()) -> list[tuple[int, int, int]]:
    """(block_n, block_m, warps) worth timing at m rows (`of`: those, block_m capped at m).
    Compiled for sm_90 with Triton 3.6, up to 128 accumulator values a thread fit in registers,
    not with 256 activation rows: so 16-128 (32 with 8 warps; 64 at 256 rows), and two
    warpgroups only for >= 128 weight rows."""
    bm_max = max(16, triton.next_power_of_2(m))
    if quick or of:
        return sorted({(bn, min(bm, bm_max), w) for bn, bm, w in of or QUICK_SHAPES})
    return [
        (bn, bm, warps)
        for bn, bm, warps in itertools.product((64, 128, 256), (16, 32, 64, 128, 256), (4, 8))
        if (bm <= bm_max and (bm >= 32 or bm == bm_max) and (warps == 4 or bn >= 128)
            and (16 if warps == 4 else 32) <= bn * bm // (32 * warps) <= (128 if bm <= 128 else 64))
    ]  # fmt: skip


def _stages(shape: tuple[int, ...]) -> list[int]:
    """Stage counts that fit in shared memory, the first tried first: the most within 128 KB."""
    stage = (shape[0] + shape[1]) * STEP_BYTES
    fits = [s for s in (3, 4, 5, 6) if s * stage <= SHARED_BYTES]
    first = max([s for s in fits if s * stage <= 128 * 1024] or fits[:1])
    return [first] + [s for s in (3, 4, 6) if s in fits and s != first]


def _error(y: torch.Tensor, exact: torch.Tensor) -> float:
    return (y.double() - exact).abs().max().item() / exact.abs().max().item()


def _exact(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    return (xq.double() * xs.double()) @ (w.double() * ws.double()).t()


def _measure(
    layer: str, m: int, weights: list, kinds: list[str], quick: bool, dtype: str
) -> list[dict]:
    """The us and error of each candidate for `layer` at m rows, references first. A search in
    phases: each shape at its first stage count, then the best two at the others (not with
    --quick); persistent on the best TMA shapes; split-K with the faster loader."""
    (w0, ws0), k = weights[0], weights[0][0].shape[1]
    xq, xs = operands(m, k, dtype)
    exact = _exact(xq, xs, w0, ws0)
    rows: list[dict] = []

    def timed(name: str, info: dict, fn: Callable[[int], torch.Tensor]) -> None:
        try:
            error = _error(fn(0), exact)
            rows.append({"name": name, **info, "us": _us(fn, len(weights)), "error": error})
        except Exception as exc:  # out of shared memory, an unsupported shape: reported, skipped
            print(f"    {name}: failed ({type(exc).__name__}: {str(exc)[:160]})", flush=True)
            rows.append({"name": name, **info, "failed": f"{type(exc).__name__}: {exc}"[:400]})

    def run(cfgs: list[Config]) -> None:
        for c in dict.fromkeys(c for c in cfgs if c.name() not in {r["name"] for r in rows}):
            timed(c.name(), asdict(c), lambda i, c=c: gemm(c, xq, xs, *weights[i]))

    def ranked(*of: str) -> list[Config]:
        ok = [r for r in rows if r["kind"] in of and r.get("error", 1) <= ERROR_LIMIT]
        return [Config(**{f: r[f] for f in Config.__dataclass_fields__})
                for r in sorted(ok, key=lambda r: r["us"])]  # fmt: skip

    def refine(*of: str) -> None:  # the best two at their other stage counts
        if not quick:
            run([replace(c, stages=s) for c in ranked(*of)[:2] for s in _stages(c.shape)])

    def scaled(i: int) -> torch.Tensor:
        w, ws = weights[i]
        return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16)

    def few(i: int) -> torch.Tensor:
        return fp8_few_rows_linear(xq, xs, *weights[i], None, torch.bfloat16)

    def linear(i: int) -> torch.Tensor:
        return torch.nn.functional.linear(xq, weights[i][0])

    if dtype == "bf16":
        timed("cublas", {"kind": "cublas"}, linear)
    else:
        timed("cublaslt", {"kind": "cublaslt"}, scaled)
    if m <= 64 and dtype == "fp8":
        timed("few_rows", {"kind": "few_rows"}, few)
    for kind in ("tiled", "tma"):
        if kind in kinds:
            run([Config(kind, *s, _stages(s)[0]) for s in _shapes(m, quick)])
            refine(kind)
    if "persistent" in kinds:
        shapes = list(dict.fromkeys(c.shape for c in ranked("tma")))[:2] or _shapes(m, True)
        stages = (3,) if quick else (3, 4)
        run([Config("persistent", *s, st) for s in shapes for st in stages if st in _stages(s)])
    if "splitk" in kinds and layer in SPLIT_LAYERS:
        tma = [c.kind for c in ranked("tiled", "tma")][:1] == ["tma"]
        splits = [sp for sp in (2, 4, 8) if triton.cdiv(k, block_k_of(xq.dtype)) % sp == 0]
        shapes = _shapes(m, quick, SPLIT_SHAPES[:: 3 if quick else 1])
        run([Config("splitk", *s, _stages(s)[0], sp, tma) for s in shapes for sp in splits])
        refine("splitk")
    return rows


def benchmark(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    start, layers = time.perf_counter(), "+".join(args.layers)
    report: dict = {"args": vars(args), "layers": {}, "sums_us": {}}
    library = "cublas" if args.dtype == "bf16" else "cublaslt"
    path = report_path(f"{args.dtype}_gemm_tiles.json")
    for layer in args.layers:
        n, k = LAYERS[layer]
        size = n * k * (2 if args.dtype == "bf16" else 1)
        weights = [operands(n, k, args.dtype) for _ in range(max(1, ROTATE_BYTES // size))]
        for m in args.m:
            rows = _measure(layer, m, weights, args.kinds, args.quick, args.dtype)
            best: dict[str, dict] = {}  # each kind's fastest, fastest first
            for r in sorted((r for r in rows if r.get("error", 1) <= ERROR_LIMIT),
                            key=lambda r: r["us"]):  # fmt: skip
                best.setdefault(r["kind"], r)
            report["layers"][f"{layer}@{m}"] = {"best": best, "candidates": rows}
            write_report(path, **report)  # so far, if cut short
            bad = [r["name"] for r in rows if not r.get("error", 0) <= ERROR_LIMIT]  # NaN too
            note = f"; error > {ERROR_LIMIT}, rejected: {bad}" if bad else ""
            print(f"{layer} ({n}x{k}) m={m}: {len(rows)} timed, {time.perf_counter() - start:.0f} "
                  f"s in{note}")  # fmt: skip
            ref = best.get(library, {}).get("us", math.nan)
            for kind, b in best.items():
                us = b["us"]
                print(f"  {kind:10s} {us:7.1f} us {2 * m * n * k / us / 1e6:5.0f} TFLOPS "
                      f"{size / us / 1e6:4.2f} TB/s err {b['error']:.1e} x{ref / us:.2f} "
                      f" {b['name']}", flush=True)  # fmt: skip
    print(f"\nus a call: {library} -> the fastest other [its kind]; the sum over {layers}")
    missing = {"us": math.nan, "kind": "-"}
    for m in args.m:
        bests = [report["layers"][f"{ly}@{m}"]["best"] for ly in args.layers]
        kinds = {kd for b in bests for kd in b}
        sums = {kd: sum(b[kd]["us"] for b in bests) for kd in kinds if all(kd in b for b in bests)}
        ours = [next((r for kd, r in b.items() if kd != library), missing) for b in bests]
        sums["best"] = sum(o["us"] for o in ours)
        report["sums_us"][m] = sums
        cells = [f"{ly} {b.get(library, missing)['us']:5.1f} -> {o['us']:5.1f} [{o['kind']}]"
                 for ly, b, o in zip(args.layers, bests, ours, strict=True)]  # fmt: skip
        ref = sums.get(library, math.nan)
        print(f"m={m:3d} | " + " | ".join(cells) + f" | sum {ref:.1f} -> {sums['best']:.1f} "
              f"(x{ref / sums['best']:.2f}); by kind: "
              + ", ".join(f"{kd} {v:.1f}" for kd, v in sorted(sums.items())))  # fmt: skip
    write_report(path, **report)


def interpret_check() -> None:
    """Each kind on small shapes on the CPU (Triton's interpreter) against the float64 formula."""
    torch.manual_seed(0)
    errors = []
    cases = itertools.product(("fp8", "bf16"), ((40, 192, 512), (40, 192, 448), (16, 64, 128)))
    for dtype, (m, n, k) in cases:
        xq, xs = operands(m, k, dtype, "cpu")
        w, ws = operands(n, k, dtype, "cpu")
        if dtype == "bf16":  # numpy has no bf16: the interpreter would multiply its bits
            xq, w = xq.float(), w.float()
        exact = _exact(xq, xs, w, ws)
        for cfg in (
            Config("tiled", 64, 32, 4, 3), Config("tiled", 128, 64, 4, 3),
            Config("tma", 64, 32, 4, 3), Config("tma", 64, 64, 4, 3),
            Config("splitk", 64, 32, 4, 3, split=2), Config("splitk", 64, 64, 4, 3, split=4),
            Config("splitk", 64, 32, 4, 3, split=2, tma=True),
            Config("persistent", 64, 32, 4, 3), Config("persistent", 128, 64, 4, 3),
        ):  # fmt: skip
            if triton.cdiv(k, block_k_of(xq.dtype)) % cfg.split == 0:
                errors.append(error := _error(gemm(cfg, xq, xs, w, ws, programs=4), exact))
                print(f"{dtype} M={m} N={n} K={k} {cfg.name():32s} error {error:.2e}")
    # The interpreter truncates float32 to bf16 (the GPU rounds): up to 2**-7 of the largest
    # magnitude, where an indexing or masking fault is of the order of 1.
    passed = all(e <= 2**-7 for e in errors)  # NaN fails
    print(f"worst {max(errors):.2e} (bound 2**-7 = 7.8e-3): {'PASS' if passed else 'FAIL'}")
    sys.exit(0 if passed else 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", type=int, nargs="+", default=[64, 128, 192, 256])
    parser.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtype", default="fp8", choices=["fp8", "bf16"])
    parser.add_argument("--interpret-check", action="store_true")
    args = parser.parse_args()
    if args.interpret_check and os.environ.get("TRITON_INTERPRET") != "1":
        # The interpreter is chosen when a kernel is decorated: start again with it on.
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    if args.interpret_check:
        interpret_check()
    else:
        benchmark(args)


if __name__ == "__main__":
    main()
