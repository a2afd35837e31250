"""KV memory of long conversations with sliding-window attention against full attention.

A random-weight decoder (float32, CPU) whose every layer slides over `--window` tokens
(Mistral-style), the same weights with sliding and full layers alternating (gpt-oss's pattern:
the sliding layers' KV in the window group's pool), and with full attention: `--requests`
sequences of `--prompt-len` prompt tokens and `--output-len` greedy tokens at once. Printed
and written: the most KV blocks each pool had given out at once, the KV bytes those hold over
the layers that use each pool, and the output tok/s. A sliding pool is its default (one
window's quota a sequence); a full one holds every sequence's whole length.

    .venv/bin/python bench/sliding_window_kv.py [--window 256] [--output-len 2000]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from inflight.bench import random_model
from inflight.bench.report import report_path, write_report
from inflight.model.config import ModelConfig, RopeConfig
from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.runtime.runtime import Runtime

SHAPE = ModelConfig(
    family="mistral", vocab_size=2048, hidden_size=256, intermediate_size=512, num_layers=4,
    num_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, max_position_embeddings=32768,
    rope=RopeConfig(theta=1_000_000.0),
)  # fmt: skip


def run(name: str, config: ModelConfig, args: argparse.Namespace) -> dict:
    random_model.SHAPES[name] = config
    total = args.prompt_len + args.output_len
    runtime = Runtime(
        random_model.random_checkpoint(name, torch.device("cpu")),
        DeploymentOptions(
            device="cpu",
            quantization="none",
            max_batch_size=args.requests,
            max_model_len=total,
            block_size=args.block_size,
        ),
    )
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    session = runtime.new_session()
    for i in range(args.requests):
        prompt = [(7 * j + 13 * i) % config.vocab_size for j in range(args.prompt_len)]
        session.admit(GenerationRequest(prompt, params))
    pool, window_pool = runtime.blocks, runtime.window_blocks
    peak = window_peak = tokens = 0
    start = time.perf_counter()
    while session.residents():
        result = session.step()
        tokens += sum(len(delta.token_ids) for delta in result.deltas.values())
        peak = max(peak, pool.num_blocks - pool.num_free)
        if window_pool is not None:
            window_peak = max(window_peak, window_pool.num_blocks - window_pool.num_free)
    elapsed = time.perf_counter() - start
    session.finish()
    # A block of one layer: keys and values, float32.
    per_layer = 2 * args.block_size * config.num_kv_heads * config.head_dim * 4
    sliding = sum(w is not None for w in config.layer_windows) if window_pool else 0
    kv = (peak * (config.num_layers - sliding) + window_peak * sliding) * per_layer
    return {
        "pool_blocks": pool.num_blocks,
        "peak_blocks": peak,
        "window_pool_blocks": 0 if window_pool is None else window_pool.num_blocks,
        "window_peak_blocks": window_peak,
        "peak_kv_mib": kv / 2**20,
        "output_tok_s": tokens / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=2000)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    windowed = replace(SHAPE, layer_windows=(args.window,) * SHAPE.num_layers)
    alternating = replace(SHAPE, layer_windows=(args.window, None) * (SHAPE.num_layers // 2))
    results = {}
    for name, config in (("sliding", windowed), ("alternating", alternating), ("full", SHAPE)):
        results[name] = run(f"bench-{name}", config, args)
        print(name, {k: round(v, 1) for k, v in results[name].items()}, flush=True)
    write_report(report_path("sliding_window_kv.json"), args=vars(args), results=results)


if __name__ == "__main__":
    main()
