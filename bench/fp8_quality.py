"""What FP8 costs in quality, on a model with real weights (the default SmolLM2 unless
`--model`), on CUDA: FP8 weights (`quantization="fp8"`), an FP8 KV cache
(`kv_cache_dtype="fp8"`) and both, each against bf16 ("none") on the same weights.

- Scoring: the log-probability of every token of `--texts` English passages (the benchmark's
  corpus in windows of `--window` tokens) under each; their mean negative log-likelihood
  (perplexity) and the mean and largest |difference| per token.
- Greedy: 8 chat prompts, `--tokens` tokens each; how many continuations are identical, and
  where the others part.

Prints both; writes JSON to $OUT (or bench/out).

    python3 bench/fp8_quality.py [--model PATH]
"""

from __future__ import annotations

import argparse
import math

import torch
from decode_throughput import PROMPTS

from inflight.bench.offline import TEXT
from inflight.bench.report import report_path, write_report
from inflight.model.checkpoints.loader import open_checkpoint
from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.runtime.runtime import Runtime


def _scores(runtime: Runtime, texts: list[list[int]]) -> list[float]:
    """Each token's log-probability given the tokens before it, text after text."""
    out = []
    for ids in texts:
        request = GenerationRequest(ids, SamplingParams(max_tokens=1, prompt_logprobs=0))
        result = runtime.handle_request(request).result()
        out += [entry.logprob for entry in result.prompt_logprobs if entry is not None]
    return out


def _greedy(runtime: Runtime, tokens: int) -> list[tuple[int, ...]]:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    return [
        runtime.handle_request(GenerationRequest(runtime.tokenizer.encode(prompt), params))
        .result()
        .token_ids
        for prompt in PROMPTS
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--texts", type=int, default=8)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    checkpoint = open_checkpoint(args.model)
    corpus: list[int] = []
    while len(corpus) < args.texts * args.window:
        corpus = checkpoint.tokenizer.encode(TEXT * (2 + 2 * len(corpus)), add_special_tokens=False)
    texts = [corpus[i * args.window : (i + 1) * args.window] for i in range(args.texts)]
    # name: (quantization, kv_cache_dtype)
    variants = {
        "bf16": ("none", "auto"),
        "fp8 weights": ("fp8", "auto"),
        "fp8 KV cache": ("none", "fp8"),
        "fp8 weights + KV": ("fp8", "fp8"),
    }
    runs = {}
    for name, (quantization, kv_cache_dtype) in variants.items():
        runtime = Runtime(
            checkpoint,
            DeploymentOptions(
                device="cuda",
                max_model_len=1024,
                quantization=quantization,
                kv_cache_dtype=kv_cache_dtype,
            ),
        )
        runs[name] = (_scores(runtime, texts), _greedy(runtime, args.tokens))
        del runtime
        torch.cuda.empty_cache()
    ref, ref_greedy = runs["bf16"]
    results = {}
    for name, (scores, greedy) in runs.items():
        diffs = [abs(a - b) for a, b in zip(ref, scores, strict=True)]
        parted = [
            next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
            for a, b in zip(ref_greedy, greedy, strict=True)
        ]
        results[name] = {
            "tokens_scored": len(scores),
            "perplexity": math.exp(-sum(scores) / len(scores)),
            "mean_abs_logprob_diff": sum(diffs) / len(diffs),
            "max_abs_logprob_diff": max(diffs),
            "greedy_identical": sum(p is None for p in parted),
            "greedy_first_difference": parted,
        }
        print(name, results[name], flush=True)
    write_report(
        report_path("fp8_quality.json"),
        device=torch.cuda.get_device_name(),
        model=checkpoint.name,
        args=vars(args),
        results=results,
    )


if __name__ == "__main__":
    main()
