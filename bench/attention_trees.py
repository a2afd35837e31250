"""The CPU attention kernel of this tree beside another tree's, on decode steps whose caches come
from memory, as a model's do.

`--against DIR`: a folder holding the other tree's `inflight/model/kernels/cpu` sources (e.g. from
`git archive`). A step is `--layers` calls of SmolLM2's shape (9 query heads, 3 KV heads, head dim
64), one a layer, each over its own caches: a pool of `--pool-blocks` blocks of 16 in which
`--rows` rows hold contexts drawn from `--contexts LO HI`, their blocks scattered (the same
tables in every layer, as the engine's). Before each step a 64 MB read evicts the caches; the two
trees then run the step in turn, their order swapped every round, and the outputs are checked
for the same bits. Prints the median and best ms a step over `--rounds` rounds; one build
alternated in one process is what separates a change of a tenth from this kind of host's
run-to-run spread (a whole process a variant, `bench/cpu_attention.py`, could not).

    .venv/bin/python bench/attention_trees.py --against DIR [--rows 16] [--layers 30]
        [--contexts 40 101] [--pool-blocks 1024] [--rounds 40]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from inflight.bench.report import report_path, write_report
from inflight.model.kernels.cpu import attention, native
from inflight.runtime.device.batch_builder import RowInput, build_ragged_batch

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--contexts", type=int, nargs=2, default=[40, 101], metavar=("LO", "HI"))
    parser.add_argument("--pool-blocks", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    rng = random.Random(0)
    lengths = [rng.randint(*args.contexts) for _ in range(args.rows)]
    needs = [-(-(n + 1) // BLOCK_SIZE) for n in lengths]
    if sum(needs) > args.pool_blocks:
        parser.error(f"the rows need {sum(needs)} blocks; --pool-blocks is {args.pool_blocks}")
    blocks = rng.sample(range(args.pool_blocks), sum(needs))
    inputs, used = [], 0
    for length, need in zip(lengths, needs, strict=True):
        inputs.append(RowInput([0], length, blocks[used : used + need], True))
        used += need
    meta = build_ragged_batch(inputs, BLOCK_SIZE, torch.device("cpu")).forward.attention
    slots = args.pool_blocks * BLOCK_SIZE
    caches = [
        tuple(torch.randn(KV_HEADS, slots, HEAD_DIM) for _ in range(2)) for _ in range(args.layers)
    ]
    q = torch.randn(args.rows, HEADS, HEAD_DIM)
    libs = {
        "this": attention.library(),
        "against": attention.build(args.against / "cpu_attention.c", "attention of --against"),
    }
    outs = {name: torch.empty(args.rows, HEADS, HEAD_DIM) for name in libs}
    evict = torch.ones(16 * 2**20)  # 64 MB

    def step(name: str) -> float:
        float(evict.sum())
        start = time.perf_counter()
        for layer in caches:
            attention.paged_attention(libs[name], q, layer, meta, HEAD_DIM**-0.5, outs[name])
        return time.perf_counter() - start

    times: dict[str, list[float]] = {name: [] for name in libs}
    names = list(libs)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(step(name))
    same = torch.equal(outs["this"], outs["against"])
    print(
        f"variant {native.chosen_variant().name}, {torch.get_num_threads()} threads, "
        f"{args.rows} rows of {min(lengths)}-{max(lengths)} keys, {args.layers} layers"
    )
    result = {}
    for name, ts in times.items():
        result[name] = {"median_ms": 1e3 * statistics.median(ts), "best_ms": 1e3 * min(ts)}
        print(
            f"{name:<8} {result[name]['median_ms']:.3f} ms a step (median), "
            f"{result[name]['best_ms']:.3f} best"
        )
    ratio = result["this"]["median_ms"] / result["against"]["median_ms"]
    print(f"this / against: {ratio:.2f}x the time; same bits: {same}")
    path = report_path("attention_trees.json")
    write_report(
        path,
        threads=torch.get_num_threads(),
        rows=args.rows,
        layers=args.layers,
        contexts=args.contexts,
        pool_blocks=args.pool_blocks,
        same_bits=same,
        **result,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
