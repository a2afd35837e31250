"""The roofline bound of `gpu_throughput.py`'s workload: the output tok/s no engine can beat.

The same requests (`gpu_throughput.workload`: 256, prompts and outputs uniform in 100-1,024,
seed 0) on a random-weight shape, each step given the least time the GPU could take for it:

- prefill: every prompt token through every linear layer, and causal attention over its
  prompt, at the matrix units' peak (the LM head only for each prompt's last token);
- decode step s: every request still generating (output longer than s) reads the weights once
  (for a mixture of experts: the experts that the step's rows are expected to touch, rows
  routing independently and uniformly) and its whole context's K and V; the step takes the
  larger of those bytes at the memory bandwidth and its multiply-adds at the matrix peak.

Optimistic by construction: prefill and decode never share a step, every decode step holds
every request left, nothing else runs (norms, sampling, launches, the host). Two rooflines:
the H200 datasheet (4.8 TB/s, 989 dense bf16 / 1,979 fp8 TFLOPS) and what this workplace's H200
measured (a device-to-device copy 4.27 TB/s, an 8,192-cube bf16 matmul 788 TFLOPS; fp8 taken at
twice that). Prints a table; writes JSON to $OUT (or bench/out).

    .venv/bin/python bench/workload_bound.py [--shapes qwen3-0.6b llama-3.1-8b qwen3-30b-a3b]
        [--requests 256] [--buckets]   (the decode bound by rows, as gpu_timeline.py groups steps)
        [--sequential]   (also each decode step's linear layers and attention taken in turn)
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass

from gpu_throughput import workload
from gpu_timeline import BUCKETS

from inflight.bench.random_model import SHAPES
from inflight.bench.report import report_path, write_report
from inflight.model.config import ModelConfig


@dataclass(frozen=True)
class Roof:
    name: str
    bytes_per_s: float
    bf16_flops: float
    fp8_flops: float


ROOFS = (
    Roof("datasheet", 4.8e12, 989e12, 1979e12),
    Roof("measured", 4.27e12, 788e12, 2 * 788e12),
)


@dataclass(frozen=True)
class Shape:
    """What a step reads and multiplies, per token and per weight."""

    dense_params: int  # linear weights every token reads (attention, router, dense MLPs)
    expert_params: int  # one expert's, per sparse layer
    sparse_layers: int
    experts: int
    top_k: int
    head_params: int
    attention_width: int  # query heads x head size, summed over layers
    kv_elements: int  # K and V elements a token of context holds, over layers

    @staticmethod
    def of(config: ModelConfig) -> Shape:
        if any(config.layer_windows) or config.mamba is not None:
            # Every layer is taken to read its whole context's K and V.
            raise ValueError("sliding windows and Mamba layers are not modelled")
        h, hd = config.hidden_size, config.head_dim
        attention = h * hd * (2 * config.num_heads + 2 * config.num_kv_heads)
        moe = config.moe
        sparse = len(moe.sparse_layers) if moe else 0
        dense_mlp = 3 * h * config.intermediate_size * (config.num_layers - sparse)
        router = h * moe.num_experts * sparse if moe else 0
        return Shape(
            dense_params=attention * config.num_layers + dense_mlp + router,
            expert_params=3 * h * moe.intermediate_size if moe else 0,
            sparse_layers=sparse,
            experts=moe.num_experts if moe else 0,
            top_k=moe.top_k if moe else 0,
            head_params=config.vocab_size * h,
            attention_width=config.num_heads * hd * config.num_layers,
            kv_elements=2 * config.num_kv_heads * hd * config.num_layers,
        )

    def active_params(self) -> int:
        return self.dense_params + self.sparse_layers * self.top_k * self.expert_params

    def touched_params(self, rows: int) -> float:
        """Weights a step of `rows` decode rows reads: each sparse layer's experts that at least
        one row routes to, in expectation."""
        if not self.experts:
            return self.dense_params
        untouched = (1 - self.top_k / self.experts) ** rows
        return self.dense_params + self.sparse_layers * self.experts * (1 - untouched) * (
            self.expert_params
        )


def bound_seconds(
    shape: Shape,
    work: list[tuple[int, int]],
    roof: Roof,
    weight_bytes: int,
    kv_bytes: int,
    sequential: bool = False,
) -> dict[str, float]:
    """Least seconds of the prefill and of the decode steps of `work` (prompt, output), the
    decode steps also by `gpu_timeline.BUCKETS` of rows ("decode<=R": steps, seconds).
    `sequential`: a decode step's linear layers and its attention each take their own least
    time, one after the other (as kernels that run in turn do), where by default the step's
    bytes and multiply-adds all overlap."""
    matmul_flops = roof.fp8_flops if weight_bytes == 1 else roof.bf16_flops
    prompt_tokens = sum(p for p, _ in work)
    # Causal attention: query i of a prompt scores and weighs i + 1 keys (2 multiply-adds each).
    attention = sum(p * (p + 1) // 2 for p, _ in work) * 4 * shape.attention_width
    prefill = (
        2 * shape.active_params() * prompt_tokens + 2 * shape.head_params * len(work)
    ) / matmul_flops + attention / roof.bf16_flops
    seconds = {"prefill_s": prefill, "decode_s": 0.0}
    for step in range(1, max(n for _, n in work)):  # token 0 of each output ends its prefill
        contexts = [p + step for p, n in work if n > step]
        rows = len(contexts)
        weights = (shape.touched_params(rows) + shape.head_params) * weight_bytes
        kv = sum(contexts) * shape.kv_elements * kv_bytes
        linear = 2 * (shape.active_params() + shape.head_params) * rows / matmul_flops
        attend = 4 * sum(contexts) * shape.attention_width / roof.bf16_flops
        if sequential:
            least = max(weights / roof.bytes_per_s, linear) + max(kv / roof.bytes_per_s, attend)
        else:
            least = max((weights + kv) / roof.bytes_per_s, linear + attend)
        seconds["decode_s"] += least
        bucket = f"decode<={next(b for b in BUCKETS if rows <= b)}"
        seconds[bucket + " steps"] = seconds.get(bucket + " steps", 0) + 1
        seconds[bucket + " s"] = seconds.get(bucket + " s", 0.0) + least
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument(
        "--buckets", action="store_true", help="the decode bound by rows, as gpu_timeline.py"
    )
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="also the bound with a decode step's linear layers and attention one after the other",
    )
    args = parser.parse_args()
    modes = (False, True) if args.sequential else (False,)
    variants = {"bf16": (2, 2), "fp8 weights + fp8 KV": (1, 1)}
    results = []
    print(
        f"{'shape':<16} {'dtype':<22} {'roof':<10} {'steps':<10} {'prefill s':>9} "
        f"{'decode s':>9} {'tok/s':>8}"
    )
    for name in args.shapes:
        config = SHAPES[name]
        shape = Shape.of(config)
        work = [(len(p), n) for p, n in workload(args.requests, config.vocab_size)]
        outputs = sum(n for _, n in work)
        for dtype, (weight_bytes, kv_bytes) in variants.items():
            for roof, sequential in itertools.product(ROOFS, modes):
                seconds = bound_seconds(shape, work, roof, weight_bytes, kv_bytes, sequential)
                tok_s = outputs / (seconds["prefill_s"] + seconds["decode_s"])
                steps = "sequential" if sequential else "overlapped"
                results.append(
                    {"shape": name, "dtype": dtype, "roof": roof.name, "steps": steps}
                    | {"output_tok_s": tok_s}
                    | seconds
                )
                print(
                    f"{name:<16} {dtype:<22} {roof.name:<10} {steps:<10} "
                    f"{seconds['prefill_s']:9.2f} {seconds['decode_s']:9.2f} {tok_s:8.0f}"
                )
                if args.buckets:
                    for key in (f"decode<={b}" for b in BUCKETS if f"decode<={b} s" in seconds):
                        steps, spent = seconds[key + " steps"], seconds[key + " s"]
                        per_step = spent / steps * 1e3
                        print(
                            f"    {key:<14} {steps:5d} steps {spent:6.2f} s {per_step:6.2f} ms/step"
                        )
    path = report_path("workload_bound.json")
    write_report(path, requests=args.requests, bounds=results)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
