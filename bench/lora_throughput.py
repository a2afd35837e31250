"""Multi-LoRA throughput: 16 requests over 4 adapters against the same 16 on the base model.

Random rank-16 PEFT adapters on all seven projections are written for the model's shapes; the
two runs alternate (`--rounds`), each handing every request to the in-flight batching engine at
once (batch 16, 100-token prompts, 64 greedy tokens, EOS ignored). Default: the embedded model on
the CPU (quantization auto); `--shape qwen3-0.6b` a random-weight model on CUDA, where the same
base run on a runtime without LoRA slots is measured too (what enabling LoRA costs requests
that use none), and the mixed requests' greedy tokens through captured CUDA graphs are checked
against an eager runtime's. Prints output tok/s and the ratio; writes JSON to $OUT (or
bench/out).

    .venv/bin/python bench/lora_throughput.py [--rounds 3]
    python3 bench/lora_throughput.py --shape qwen3-0.6b --tokenizer DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from inflight.bench.offline import make_workload, run_requests
from inflight.bench.random_model import random_checkpoint
from inflight.bench.report import report_path, write_report
from inflight.model.checkpoints.loader import open_checkpoint
from inflight.model.config import ModelConfig
from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.runtime.runtime import Runtime

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: Path, config: ModelConfig, rank: int, seed: int) -> None:
    """A random PEFT adapter directory for a model of `config`'s shapes."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    shapes = {
        "self_attn.q_proj": (h, q),
        "self_attn.k_proj": (h, kv),
        "self_attn.v_proj": (h, kv),
        "self_attn.o_proj": (q, h),
        "mlp.gate_proj": (h, i),
        "mlp.up_proj": (h, i),
        "mlp.down_proj": (i, h),
    }
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (fan_in, fan_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": list(TARGETS),
                "bias": "none",
            }
        )
    )


def _requests(prompts, loras, n: int) -> list[GenerationRequest]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [
        GenerationRequest(p, params, lora_name=lora) for p, lora in zip(prompts, loras, strict=True)
    ]


def throughput(
    runtime: Runtime, prompts: list[list[int]], loras: list[str | None], n: int
) -> float:
    outputs, elapsed = run_requests(runtime, _requests(prompts, loras, n))
    return sum(map(len, outputs)) / elapsed


def make_runtime(checkpoint, args: argparse.Namespace, device: dict, **config) -> Runtime:
    return Runtime(
        checkpoint,
        DeploymentOptions(
            max_batch_size=args.requests,
            max_model_len=512,
            max_lora_rank=args.rank,
            enable_context_reuse=False,  # every round recomputes its prompts
            **device,
            **config,
        ),
    )


def greedy(runtime: Runtime, prompts: list[list[int]], loras: list[str | None]) -> list:
    return run_requests(runtime, _requests(prompts, loras, 32))[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default=None, help="a random-weight CUDA model of this shape")
    parser.add_argument("--tokenizer", default=None, help="where the prompts' tokenizer is")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    embedded = open_checkpoint(args.tokenizer)
    if args.shape:
        checkpoint = random_checkpoint(
            args.shape, torch.device("cuda"), tokenizer=embedded.tokenizer
        )
        device = dict(device="cuda")
    else:
        checkpoint, device = embedded, {}
    runtime = make_runtime(checkpoint, args, device, enable_lora=True, max_loras=args.adapters)
    work = make_workload(embedded.tokenizer, args.requests, 100, args.output_len)
    mixed = [f"a{i % args.adapters}" for i in range(args.requests)]
    base_only: list[str | None] = [None] * args.requests
    graphs_match = None
    with tempfile.TemporaryDirectory() as root:
        for a in range(args.adapters):
            write_adapter(Path(root) / f"a{a}", checkpoint.config, args.rank, seed=a)
            runtime.register_lora(f"a{a}", str(Path(root) / f"a{a}"))
        if args.shape:
            eager = make_runtime(
                checkpoint,
                args,
                device,
                enable_lora=True,
                max_loras=args.adapters,
                cuda_graphs=False,
            )
            for a in range(args.adapters):
                eager.register_lora(f"a{a}", str(Path(root) / f"a{a}"))
            rows = [*mixed[:8], *base_only[:8]]
            want = greedy(eager, work.prompts, rows)
            got = greedy(runtime, work.prompts, rows)
            graphs_match = got == want
            differ = sum(
                w != b
                for w, b in zip(
                    want[:8], greedy(eager, work.prompts[:8], base_only[:8]), strict=True
                )
            )
            print(
                f"greedy tokens through graphs equal eager ones: {graphs_match} "
                f"(adapter rows differing from the base: {differ} of 8)",
                flush=True,
            )
            del eager
        throughput(runtime, work.prompts[:2], [None, "a0"], 4)  # warm-up (and kernel builds)
        runs: dict[str, list[float]] = {"base": [], "adapters": []}
        for _ in range(args.rounds):
            runs["base"].append(throughput(runtime, work.prompts, base_only, args.output_len))
            runs["adapters"].append(throughput(runtime, work.prompts, mixed, args.output_len))
    base, adapters = (statistics.median(v) for v in runs.values())
    print(
        f"{args.requests} requests: base {base:.1f} tok/s, over {args.adapters} adapters "
        f"{adapters:.1f} tok/s: {adapters / base:.0%} of the base (medians of {args.rounds}; "
        f"all: {runs})",
        flush=True,
    )
    if args.shape:
        plain = make_runtime(checkpoint, args, device)
        throughput(plain, work.prompts[:2], [None, None], 4)
        runs["plain"] = [
            throughput(plain, work.prompts, base_only, args.output_len) for _ in range(args.rounds)
        ]
        print(
            f"the same base requests without LoRA slots: {statistics.median(runs['plain']):.1f} "
            f"tok/s ({runs['plain']})",
            flush=True,
        )
    write_report(
        report_path("lora_throughput.json"),
        device=torch.cuda.get_device_name() if args.shape else "cpu",
        threads=torch.get_num_threads(),
        args=vars(args),
        tok_s=runs,
        ratio=adapters / base,
        graphs_match_eager=graphs_match,
    )


if __name__ == "__main__":
    main()
