"""Does a request's output on CUDA depend on the context cache or on the rows beside it?

A random-weight model (`--shape`, bf16, the Triton backend with CUDA graphs) serves seeded and
greedy requests over random prompts of 35 and 33 tokens: each first computed whole (the cache
bypassed), then again reading its first 32 tokens from the cache (3 and 1 tokens computed), and
once more beside 7 other requests in the same steps. Printed and written: how many of the
outputs equal the cold one token for token and logprob for logprob, and the largest logprob
difference of the first sampled token.

    python3 bench/gpu_cache_hit.py [--shape qwen3-0.6b] [--prompts 16] [--quantization fp8]
        [--kv-cache-dtype fp8] [--device cpu]
"""

from __future__ import annotations

import argparse
import random
from dataclasses import replace

import torch
from gpu_check import run_all

from inflight.bench.random_model import random_checkpoint
from inflight.bench.report import report_path, write_report
from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.runtime.runtime import Runtime


def _run(runtime: Runtime, requests: list[GenerationRequest]) -> list:
    """Every request admitted into one session at once; their first sequences in order."""
    return [output.outputs[0] for output in run_all(runtime, requests)]


def _first_gap(a, b) -> float:
    """The largest difference of the first token's top logprobs of two outputs."""
    if a.token_ids[0] != b.token_ids[0]:
        return float("inf")
    theirs = {t.token_id: t.logprob for t in b.logprobs[0].top}
    return max(abs(t.logprob - theirs.get(t.token_id, float("-inf"))) for t in a.logprobs[0].top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quantization", default="none", choices=["none", "fp8"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    args = parser.parse_args()

    device = torch.device(args.device)
    backend = {"cuda": "triton", "cpu": "cpu"}[args.device]
    runtime = Runtime(
        random_checkpoint(args.shape, device, args.seed),
        DeploymentOptions(
            device=args.device,
            attention_backend=backend,
            max_batch_size=8,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
        ),
    )
    rng = random.Random(args.seed)
    vocab = runtime.checkpoint.config.vocab_size
    kinds = {
        "seeded": SamplingParams(temperature=1.0, seed=1234, max_tokens=32, logprobs=2),
        "greedy": SamplingParams(temperature=0.0, max_tokens=32, logprobs=2),
    }
    results: list[dict] = []
    for length, new in ((35, 3), (33, 1)):
        for kind, params in kinds.items():
            same = {"hit": 0, "beside 7": 0}
            gaps = {"hit": 0.0, "beside 7": 0.0}
            for _ in range(args.prompts):
                prompt = [rng.randrange(1, vocab) for _ in range(length)]
                others = [
                    GenerationRequest([rng.randrange(1, vocab) for _ in range(length)], params)
                    for _ in range(7)
                ]
                alone = replace(params, reuse_context=False)
                (cold,) = _run(runtime, [GenerationRequest(prompt, alone)])
                (hit,) = _run(runtime, [GenerationRequest(prompt, params)])
                beside = _run(runtime, [GenerationRequest(prompt, params), *others])[0]
                for name, got in (("hit", hit), ("beside 7", beside)):
                    equal = got.token_ids == cold.token_ids and got.logprobs == cold.logprobs
                    same[name] += equal
                    gaps[name] = max(gaps[name], _first_gap(got, cold))
            row = {"prompt": length, "computed on a hit": new, "kind": kind}
            row |= {f"same ({k})": v for k, v in same.items()}
            row |= {f"first-token gap ({k})": v for k, v in gaps.items()}
            results.append(row)
            print(
                f"{args.quantization}/{args.kv_cache_dtype} KV, "
                f"{length} tokens ({new} computed on a hit), {kind}: "
                f"identical after a hit {same['hit']}/{args.prompts} "
                f"(first-token logprob gap {gaps['hit']:.3g}), "
                f"beside 7 others {same['beside 7']}/{args.prompts} "
                f"(gap {gaps['beside 7']:.3g})",
                flush=True,
            )
    write_report(
        report_path(f"gpu_cache_hit-{args.quantization}-{args.kv_cache_dtype}.json"),
        shape=args.shape,
        prompts=args.prompts,
        results=results,
    )


if __name__ == "__main__":
    main()
