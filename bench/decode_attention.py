"""Decode attention against the H200's memory bandwidth: bytes of KV read / kernel time.

One layer's decode attention over a paged cache, as a step of the nano-vllm workload sees it:
`--rows` rows whose contexts are a prompt uniform in [100, 1024] plus a part, uniform, of an
output uniform in [100, 1024] (mean ~840 tokens); their blocks scattered over the cache as after
churn, or (`--blocks runs`) each row's blocks one run, the rows' runs in random order, as the
engine's first-fit allocation lays out the workload's requests (admitted at once, nothing
after). The bytes counted are the keys and values each row reads (its context x KV heads x head
size x 2); the ceilings beside them are a device-to-device copy (bytes read + written) and a
kernel that only reads the same blocks through the same block tables. Each case is timed by
`do_bench` (the L2 flushed before each launch) and back to back in a CUDA graph
(`do_bench_cudagraph`, as `fp8_linear.py` times), as a step's layers run.

The figures are the kernel as the backend launches it (its rows longest first, as
`plan.decode_order` gives them; a float8 cache through the CUDA kernel of `kernels/cuda` where
it was built, Triton's beside it); the sweep times its launch settings (keys per iteration, warps,
pipeline stages), key splits, the rows in order or longest first and the head's keys and values
read whole or in two halves (`halves`, the FP8 cache's default), over the token-major cache
layout the backend uses ([blocks, block_size, KV heads, head size]) and a head-major one
([blocks, KV heads, block_size, head size], read through a permuted view).

    python3 bench/decode_attention.py [--shapes qwen3-0.6b llama-3.1-8b] [--rows 256 64 16]
        [--blocks scattered|runs] [--sweep]   (prints the figures; writes JSON to $OUT or bench/out)
    python3 bench/decode_attention.py --splits [ROWS ...] [--splits-cache bf16|fp8]
        (key splits by row count only)
"""

from __future__ import annotations

import argparse
import itertools
import random

import torch
import triton
import triton.language as tl
from triton.testing import do_bench, do_bench_cudagraph

from inflight.bench.report import report_path, write_report
from inflight.model.kernels.triton.attention import decode_attention
from inflight.model.kernels.triton.plan import decode_splits

# (query heads, KV heads, head size)
SHAPES = {"qwen3-0.6b": (16, 8, 128), "llama-3.1-8b": (32, 8, 128)}
BLOCK_SIZE = 16
PEAK_TBS = 4.8  # the H200's HBM3e bandwidth by its datasheet


def contexts(rows: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(100, 1024) + rng.randint(0, rng.randint(100, 1024)) for _ in range(rows)]


def block_tables(lens: list[int], runs: bool, seed: int = 1) -> torch.Tensor:
    """Rows' block tables over a cache of exactly their blocks (zeros past a row's last):
    every block placed at random, or (`runs`) each row's blocks consecutive, the runs in a
    random order."""
    need = [-(-n // BLOCK_SIZE) for n in lens]
    rng = random.Random(seed)
    if runs:
        order = list(range(len(need)))
        rng.shuffle(order)
        starts, at = {}, 0
        for row in order:
            starts[row] = at
            at += need[row]
        blocks = [b for row, n in enumerate(need) for b in range(starts[row], starts[row] + n)]
    else:
        blocks = list(range(sum(need)))
        rng.shuffle(blocks)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    at = 0
    for row, n in enumerate(need):
        table[row, :n] = torch.tensor(blocks[at : at + n])
        at += n
    return table


class Case:
    """One layer's caches, queries and block tables for `rows` rows of the given contexts."""

    def __init__(
        self, shape: str, lens: list[int], dtype: torch.dtype, head_major: bool, runs: bool = False
    ):
        heads, kv_heads, dim = SHAPES[shape]
        device = torch.device("cuda")
        self.block_tables = block_tables(lens, runs).to(device)
        blocks = sum(-(-n // BLOCK_SIZE) for n in lens)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        self.order = torch.argsort(self.seq_lens, descending=True)
        self.q = torch.randn(len(lens), heads, dim, device=device, dtype=torch.bfloat16)
        self.out = torch.empty_like(self.q)

        def cache() -> torch.Tensor:
            if head_major:
                c = torch.randn(blocks, kv_heads, BLOCK_SIZE, dim, device=device)
                return c.to(dtype).permute(0, 2, 1, 3)
            return torch.randn(blocks, BLOCK_SIZE, kv_heads, dim, device=device).to(dtype)

        self.k, self.v = cache(), cache()
        self.bytes = sum(lens) * kv_heads * dim * 2 * self.k.element_size()
        self.rows = len(lens)

    def run(self, **launch) -> torch.Tensor:
        decode_attention(
            self.q, self.k, self.v, self.block_tables, self.seq_lens, self.out, self.rows,
            self.q.shape[-1] ** -0.5, **launch,
        )  # fmt: skip
        return self.out


@triton.jit
def _read_kernel(
    K, V, Out, block_tables, seq_lens, stride_kb, stride_ks, stride_kh, stride_bt,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The decode kernel's loads alone: a row's keys and values of one KV head, summed."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens + row)
    d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        tok = start + tl.arange(0, BLOCK_N)
        valid = tok < seq_len
        block = tl.load(block_tables + row * stride_bt + tok // BLOCK_SIZE, mask=valid, other=0)
        offs = block.to(tl.int64) * stride_kb + (tok % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
        k = tl.load(K + offs[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(V + offs[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        acc += tl.sum(k.to(tl.float32) + v.to(tl.float32), 0)
    tl.store(Out + (row * tl.num_programs(1) + kv_head) * HEAD_DIM + d, acc)


def read_only_ms(case: Case) -> float:
    kv_heads, dim = case.k.shape[2], case.k.shape[3]
    out = torch.empty(case.rows, kv_heads, dim, device="cuda")
    k = case.k
    return do_bench(
        lambda: _read_kernel[(case.rows, kv_heads)](
            k,
            case.v,
            out,
            case.block_tables,
            case.seq_lens,
            k.stride(0),
            k.stride(1),
            k.stride(2),
            case.block_tables.stride(0),
            HEAD_DIM=dim,
            BLOCK_SIZE=BLOCK_SIZE,
            BLOCK_N=64,
        )  # fmt: skip
    )


def copy_tbs() -> float:
    x = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x))
    return 2 * x.numel() * x.element_size() / ms / 1e9


def tbs(case: Case, ms: float) -> float:
    return case.bytes / ms / 1e9


def _timed(case: Case, reference: torch.Tensor, launch: dict) -> dict:
    shown = {k: v for k, v in launch.items() if k != "order"}
    try:
        got = case.run(**launch).clone()
        ms = do_bench(lambda: case.run(**launch))
    except Exception as error:  # out of shared memory, for one
        return {**shown, "error": type(error).__name__}
    err = ((got.float() - reference.float()).norm() / reference.float().norm()).item()
    return {**shown, "ms": ms, "tbs": tbs(case, ms), "rel_diff": err}


def sweep(case: Case, reference: torch.Tensor) -> list[dict]:
    """The Triton kernel's launch settings, key splits, the rows longest first, the head read
    whole or in halves."""
    results = []
    for n, w, s, splits, ordered, halves in itertools.product(
        (32, 64, 128), (4, 8), (2, 3), (1, 2), (False, True), (False, True)
    ):
        launch = dict(block_n=n, num_warps=w, num_stages=s, splits=splits, halves=halves)
        launch["native"] = False  # the Triton kernel's settings
        result = _timed(case, reference, dict(launch, order=case.order if ordered else None))
        results.append({**result, "order": ordered})
    return results


def splits_sweep(
    shapes: list[str], rows_list: list[int], runs: bool, dtype: torch.dtype
) -> list[dict]:
    """Each row count's time with its keys in 1, 2 and 4 parts (keys an iteration as the kernel
    takes them for that many), at the workload's contexts and at 1.5x them (a step late in the
    run holds the longer requests), beside the parts `plan.decode_splits` picks; over a cache of
    `dtype` (float8: the CUDA kernel where it was built)."""
    results = []
    for shape, rows, stretch in itertools.product(shapes, rows_list, (1.0, 1.5)):
        lens = [int(n * stretch) for n in contexts(rows)]
        case = Case(shape, lens, dtype, False, runs)
        reference = case.run().clone()
        picked = decode_splits(
            rows, case.k.shape[2], torch.cuda.get_device_properties(0).multi_processor_count
        )
        timed = {
            splits: _timed(case, reference, dict(splits=splits, order=case.order))
            for splits in (1, 2, 4)
        }
        best = min(timed, key=lambda n: timed[n].get("ms", float("inf")))
        us = {n: round(t["ms"] * 1e3, 1) for n, t in timed.items() if "ms" in t}
        entry = dict(shape=shape, rows=rows, stretch=stretch, picked=picked, best=best, us=us)
        print(f"  splits {entry}", flush=True)
        results.append(entry)
        del case
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    parser.add_argument("--rows", nargs="+", type=int, default=[256, 64, 16])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument(
        "--blocks",
        choices=["scattered", "runs"],
        default="scattered",
        help="each block of the rows at random in the cache, or each row's blocks in one run",
    )
    parser.add_argument(
        "--splits", nargs="*", type=int, help="only time key splits at these row counts"
    )
    parser.add_argument(
        "--splits-cache", choices=["bf16", "fp8"], default="bf16", help="the cache --splits reads"
    )
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    runs = args.blocks == "runs"
    if args.splits is not None:
        rows = args.splits or [32, 64, 96, 128, 192]
        dtype = torch.float8_e4m3fn if args.splits_cache == "fp8" else torch.bfloat16
        sweep = splits_sweep(args.shapes, rows, runs, dtype)
        record = {"blocks": args.blocks, "cache": args.splits_cache, "splits": sweep}
        write_report(report_path("decode_splits.json"), **record)
        return
    record: dict = {"copy_tbs": copy_tbs(), "blocks": args.blocks, "cases": []}
    print(f"device-to-device copy: {record['copy_tbs']:.2f} TB/s (read + written)", flush=True)
    for shape, rows in itertools.product(args.shapes, args.rows):
        lens = contexts(rows)
        for kv, layout in itertools.product(("bf16", "fp8"), ("token-major", "head-major")):
            dtype = torch.bfloat16 if kv == "bf16" else torch.float8_e4m3fn
            case = Case(shape, lens, dtype, layout == "head-major", runs)
            reference = case.run(native=False).clone()
            ms = do_bench(lambda case=case: case.run(order=case.order))
            # Back to back in a CUDA graph, as a step runs its layers: do_bench's L2 flush before
            # each launch also leaves its dirty lines to be written back during it (~10 us at 256
            # rows on an H100, bench/RESULTS.md); the caches outgrow the L2 either way.
            in_step = do_bench_cudagraph(lambda case=case: case.run(order=case.order))
            read = read_only_ms(case)
            entry = {
                "shape": shape, "rows": rows, "kv": kv, "layout": layout,
                "mean_context": sum(lens) / rows, "bytes": case.bytes,
                "ms": ms, "tbs": tbs(case, ms), "back_to_back_ms": in_step,
                "back_to_back_tbs": tbs(case, in_step), "read_only_tbs": tbs(case, read),
            }  # fmt: skip
            line = (
                f"{shape} rows {rows} {kv} {layout}: {ms * 1e3:.1f} us, {entry['tbs']:.2f} TB/s "
                f"({entry['tbs'] / PEAK_TBS:.0%} of {PEAK_TBS}); back to back "
                f"{in_step * 1e3:.1f} us, {entry['back_to_back_tbs']:.2f} TB/s "
                f"({entry['back_to_back_tbs'] / PEAK_TBS:.0%}); loads alone "
                f"{entry['read_only_tbs']:.2f} TB/s"
            )
            if kv == "fp8":  # the CUDA kernel where it was built, beside Triton's
                got = case.run(order=case.order).clone()
                entry["triton_ms"] = do_bench(
                    lambda case=case: case.run(order=case.order, native=False)
                )
                entry["rel_diff_from_triton"] = (
                    (got.float() - reference.float()).norm() / reference.float().norm()
                ).item()
                line += (
                    f"; Triton's {entry['triton_ms'] * 1e3:.1f} us, output "
                    f"{entry['rel_diff_from_triton']:.1e} from it"
                )
            print(line, flush=True)
            if args.sweep and rows == args.rows[0] and shape == args.shapes[0]:
                entry["sweep"] = sweep(case, reference)
                best = sorted((r for r in entry["sweep"] if "ms" in r), key=lambda r: r["ms"])
                for r in best[:8]:
                    print("   ", r, flush=True)
            record["cases"].append(entry)
            del case
    path = report_path("decode_attention.json")
    write_report(path, **record)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
