"""What multi-LoRA adds to a step on the CPU, on SmolLM2-135M's shapes.

Matmuls (default): the LoRA side path of every decoder linear of a step (30 layers of qkv + o +
gate_up + down, each with its own factors, so that they stream from memory as in a real step),
against the base matmuls of the same step (float32 as `PackedLinearMethod` runs it, and the 4-bit
kernel the default GGUF runs). Per scenario, the side path the model runs on the CPU float32
path (`native`: the native kernel, dense matmuls for long runs), the one it runs on CUDA and
without the native ops (`masked`: every token through every slot's factors, a one-hot mask), and
for comparison one pair of torch matmuls per adapter over its tokens (`grouped`). Adapters have
rank `--rank` on all seven projections.

Step (`--step`): a whole decode step of `--rows` rows of SmolLM2 (4-bit and float32 weights),
with every row on the base model, then over adapters as in the decode scenarios.

CUDA (`--cuda`, on the device): the side path of a Qwen3-0.6B-shaped step (28 layers, bf16) at
several token counts, indexed (the Triton kernel) against masked (matmuls), all tokens spread
over 4 adapters; what `INDEXED_MAX_TOKENS` is set from.

Each figure is the median over `--repeats` rounds, the cases taking turns within a round so
that a noisy neighbour on the shared cores hits them alike.

    .venv/bin/python bench/lora_matmul.py [--threads N] [--rank 16] [--repeats 15] [--step]
    python3 bench/lora_matmul.py --cuda
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from inflight.bench.report import write_report
from inflight.model.contract import ModelCaches
from inflight.model.kernels.cpu import ops as cpu_ops
from inflight.model.kernels.cpu.q4 import q4_linear, quantize_q4
from inflight.model.layers import lora
from inflight.model.layers.lora import LoRAMapping, LoRASlots

CPU = torch.device("cpu")
LAYERS = 30
SLOTS = 4
# name: (in_features, output parts), SmolLM2-135M: hidden 576, intermediate 1536, 9 + 2 * 3
# heads of 64.
SHAPES = {
    "qkv": (576, [576, 192, 192]),
    "o": (576, [576]),
    "gate_up": (576, [1536, 1536]),
    "down": (1536, [576]),
}
# name: the step's rows in packed order, (slot or -1, tokens).
SCENARIOS = {
    "decode 16 rows, 4 adapters sorted": [(i // 4, 1) for i in range(16)],
    "decode 16 rows, 4 adapters interleaved": [(i % 4, 1) for i in range(16)],
    "decode 16 rows, 4 adapters uneven": [
        (s, 1) for s in [0, 1, 0, 2, 0, 3, 0, 0, 1, 0, 2, 3, 0, 0, 1, 0]
    ],
    "decode 16 rows, 1 adapter": [(0, 1)] * 16,
    "decode 16 rows, half on 4 adapters": [(i % 4 if i % 2 else -1, 1) for i in range(16)],
    "16 decode rows over 4 adapters + a 96-token chunk": [(i % 4, 1) for i in range(16)]
    + [(0, 96)],
    "prefill 512 tokens, 2 adapters (320 + 192)": [(0, 320), (1, 192)],
    "prefill 512 tokens, 2 adapters (4 x 128)": [(0, 128), (1, 128), (0, 128), (1, 128)],
}
STEP_SCENARIOS = [name for name in SCENARIOS if name.startswith("decode")]


def median_times(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Median over `repeats` rounds of each function's seconds per call."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


class Layer:
    """One linear layer's base weights and adapters, in every form the cases run."""

    def __init__(self, in_features: int, parts: list[int], rank: int, gen: torch.Generator):
        out = sum(parts)
        weight = torch.randn(out, in_features, generator=gen) * 0.02
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.q4 = quantize_q4(weight)
        self.slots = LoRASlots(in_features, parts, SLOTS, rank, cpu_ops.library())
        # The grouped comparison's form: per slot A [parts * rank, in] part after part, and B^T
        # [parts * rank, out] block-diagonal.
        self.a = torch.zeros(SLOTS, len(parts) * rank, in_features)
        self.bt = torch.zeros(SLOTS, len(parts) * rank, out)
        for slot in range(SLOTS):
            factors = [
                (
                    torch.randn(rank, in_features, generator=gen) * 0.02,
                    torch.randn(size, rank, generator=gen) * 0.02,
                )
                for size in parts
            ]
            self.slots.write(slot, factors, rank, 2.0)
            offset = 0
            for p, (lora_a, lora_b) in enumerate(factors):
                rows = slice(p * rank, (p + 1) * rank)
                self.a[slot, rows] = lora_a
                self.bt[slot, rows, offset : offset + lora_b.shape[0]] = lora_b.T * 2.0
                offset += lora_b.shape[0]


def token_slots(rows: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor([slot for slot, tokens in rows for _ in range(tokens)])


def grouped(layers: list[Layer], xs: list[torch.Tensor], ys: list[torch.Tensor], slots):
    """One pair of matmuls per adapter over its tokens (gathered unless one contiguous run)."""
    groups = []
    for slot in sorted(set(slots.tolist()) - {-1}):
        index = (slots == slot).nonzero().flatten()
        run = int(index[-1] - index[0]) + 1 == len(index)
        groups.append((slot, slice(int(index[0]), int(index[-1]) + 1) if run else index))

    def run() -> None:
        for layer, x, y in zip(layers, xs, ys, strict=True):
            for slot, tokens in groups:
                a, bt = layer.a[slot], layer.bt[slot]
                if isinstance(tokens, slice):
                    y[tokens].addmm_(x[tokens] @ a.T, bt)
                else:
                    y.index_add_(0, tokens, (x.index_select(0, tokens) @ a.T) @ bt)

    return run


def matmuls(args: argparse.Namespace) -> dict:
    gen = torch.Generator().manual_seed(0)
    layers = [
        Layer(k, parts, args.rank, gen) for _ in range(LAYERS) for k, parts in SHAPES.values()
    ]
    results = {}
    print(f"side path of {LAYERS} layers x {len(SHAPES)} linears, rank {args.rank}, ms per step")
    print(f"{'scenario':>52} {'fp32':>7} {'q4':>7} {'native':>7} {'masked':>7} {'grouped':>8}")
    for name, rows in SCENARIOS.items():
        slots = token_slots(rows)
        tokens = len(slots)
        xs = [torch.randn(tokens, layer.slots.in_features, generator=gen) for layer in layers]
        ys = [torch.zeros(tokens, layer.bt.shape[2]) for layer in layers]
        native = LoRAMapping.native(rows)
        mask = LoRAMapping.masked(rows, SLOTS, torch.float32, CPU)

        def fp32(xs=xs) -> None:
            for layer, x in zip(layers, xs, strict=True):
                torch.ops.mkldnn._linear_pointwise(x, layer.packed, None, "none", [], "")

        def q4(xs=xs) -> None:
            for layer, x in zip(layers, xs, strict=True):
                q4_linear(x, layer.q4)

        def side_path(mapping: LoRAMapping, xs=xs, ys=ys) -> None:
            for layer, x, y in zip(layers, xs, ys, strict=True):
                layer.slots.add(y, x, mapping)

        fns = [
            fp32,
            q4,
            lambda native=native: side_path(native),
            lambda mask=mask: side_path(mask),
            grouped(layers, xs, ys, slots),
        ]
        times = dict(
            zip(
                ["fp32", "q4", "native", "masked", "grouped"],
                median_times(fns, args.repeats),
                strict=True,
            )
        )
        results[name] = times
        print(f"{name:>52} " + " ".join(f"{t * 1e3:>7.2f}" for t in times.values()))
    return results


def step(args: argparse.Namespace) -> dict:
    """Whole decode steps of SmolLM2 through `build_model`, as the tests run a model directly."""
    from inflight.model.attention import select_backend
    from inflight.model.checkpoints.loader import build_model, open_checkpoint
    from inflight.model.checkpoints.lora import target_shapes
    from inflight.model.layers.lora_adapters import LoRAAdapter
    from inflight.runtime.device.batch_builder import RowInput, build_ragged_batch

    checkpoint = open_checkpoint(None)
    config = checkpoint.config
    gen = torch.Generator().manual_seed(0)
    adapters = [
        LoRAAdapter(
            args.rank,
            2.0,
            {
                (i, module): (
                    torch.randn(args.rank, k, generator=gen) * 0.02,
                    torch.randn(n, args.rank, generator=gen) * 0.02,
                )
                for i in range(config.num_layers)
                for module, (_, k, n) in target_shapes(config).items()
            },
        )
        for _ in range(SLOTS)
    ]
    rows, context, block_size = 16, 128, 16
    blocks = context // block_size + 1
    results = {}
    for quantization in ("q4", "none"):
        model = build_model(
            checkpoint,
            torch.float32,
            CPU,
            context + 1,
            quantization=quantization,
            max_loras=SLOTS,
            max_lora_rank=args.rank,
        )
        for slot, adapter in enumerate(adapters):
            model.lora.load(slot, adapter)
        backend = select_backend(None, CPU, torch.float32, config.head_dim)
        shape = backend.kv_cache_shape(
            rows * blocks, block_size, config.num_kv_heads, config.head_dim
        )
        caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(config.num_layers)]
        batch = build_ragged_batch(
            [
                RowInput([i + 5], context, list(range(i * blocks, (i + 1) * blocks)), True)
                for i in range(rows)
            ],
            block_size,
            CPU,
        )
        cases = {"base": None} | {
            name: SCENARIOS[name] for name in STEP_SCENARIOS if len(SCENARIOS[name]) == rows
        }

        def run(scenario, model=model, backend=backend, caches=caches, batch=batch) -> None:
            # The mapping is built per step, as the executor does.
            batch.forward.lora = None if scenario is None else model.lora.mapping(scenario)
            backend.plan(batch.forward.attention)
            with torch.no_grad():
                hidden = model(batch.forward, ModelCaches(caches, backend))
                model.compute_logits(hidden)

        times = median_times([lambda s=s: run(s) for s in cases.values()], args.repeats)
        base = times[0]
        results[quantization] = dict(zip(cases, times, strict=True))
        print(f"decode step of {rows} rows, {quantization} weights: base {base * 1e3:.2f} ms")
        for name, t in zip(list(cases)[1:], times[1:], strict=True):
            print(f"{name:>52} {t * 1e3:>7.2f} ms  +{(t / base - 1) * 100:.0f} %")
    return results


def cuda_paths(args: argparse.Namespace) -> dict:
    device = torch.device("cuda")
    hidden, q, kv, inter = 1024, 2048, 1024, 3072
    shapes = [(hidden, [q, kv, kv]), (q, [hidden]), (hidden, [inter, inter]), (inter, [hidden])]
    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(28):
        for in_features, parts in shapes:
            slots = LoRASlots(in_features, parts, SLOTS, args.rank).to(device, torch.bfloat16)
            for slot in range(SLOTS):
                factors = [
                    (
                        torch.randn(args.rank, in_features, generator=gen) * 0.02,
                        torch.randn(size, args.rank, generator=gen) * 0.02,
                    )
                    for size in parts
                ]
                slots.write(slot, factors, args.rank, 2.0)
            layers.append(slots)
    results = {}
    print(f"CUDA side path of 28 layers x 4 linears, rank {args.rank}, ms per step")
    print(f"{'tokens':>7} {'indexed':>8} {'masked':>8}")
    for tokens in (1, 16, 64, 128, 256, 512, 1024, 4096):
        rows = [(i % SLOTS, 1) for i in range(tokens)]
        mappings = [
            LoRAMapping.indexed(rows, device),
            LoRAMapping.masked(rows, SLOTS, torch.bfloat16, device),
        ]
        xs = [torch.randn(tokens, s.in_features, device=device).bfloat16() for s in layers]
        ys = [torch.zeros(tokens, s.part_starts[-1], device=device).bfloat16() for s in layers]

        def run(mapping: LoRAMapping, xs=xs, ys=ys) -> None:
            for slots, x, y in zip(layers, xs, ys, strict=True):
                slots.add(y, x, mapping)
            torch.cuda.synchronize()

        times = median_times([lambda m=m: run(m) for m in mappings], args.repeats)
        results[tokens] = dict(zip(["indexed", "masked"], times, strict=True))
        print(f"{tokens:>7} {times[0] * 1e3:>8.3f} {times[1] * 1e3:>8.3f}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--step", action="store_true", help="whole decode steps of the model")
    parser.add_argument("--cuda", action="store_true", help="the CUDA side paths by step size")
    parser.add_argument(
        "--long-run",
        type=int,
        default=lora.LONG_RUN,
        help="tokens from which one slot's run runs on its own (the model's LONG_RUN)",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out/lora_matmul.json")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    lora.LONG_RUN = args.long_run
    mode = "cuda" if args.cuda else "step" if args.step else "matmuls"
    results = {"cuda": cuda_paths, "step": step, "matmuls": matmuls}[mode](args)
    write_report(
        args.out,
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        rank=args.rank,
        long_run=args.long_run,
        repeats=args.repeats,
        statistic="median",
        mode=mode,
        seconds=results,
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
