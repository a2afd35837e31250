"""What FP8 weights cost in quality, on a model with real weights (the default SmolLM2 unless
`--model`), on CUDA: `quantization="fp8"` against bf16 ("none") on the same weights.

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
from inflight.runtime.config import RuntimeConfig
from inflight.runtime.request import GenerationRequest, SamplingParams
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
    runs = {}
    for quantization in ("none", "fp8"):
        runtime = Runtime(
            checkpoint, RuntimeConfig(device="cuda", max_model_len=1024, quantization=quantization)
        )
        runs[quantization] = (_scores(runtime, texts), _greedy(runtime, args.tokens))
        del runtime
        torch.cuda.empty_cache()
    (ref, ref_greedy), (fp8, fp8_greedy) = runs["none"], runs["fp8"]
    diffs = [abs(a - b) for a, b in zip(ref, fp8, strict=True)]
    parted = [
        next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        for a, b in zip(ref_greedy, fp8_greedy, strict=True)
    ]
    result = {
        "tokens_scored": len(ref),
        "perplexity_bf16": math.exp(-sum(ref) / len(ref)),
        "perplexity_fp8": math.exp(-sum(fp8) / len(fp8)),
        "mean_abs_logprob_diff": sum(diffs) / len(diffs),
        "max_abs_logprob_diff": max(diffs),
        "greedy_identical": sum(p is None for p in parted),
        "greedy_first_difference": parted,
    }
    for key, value in result.items():
        print(f"{key:<26} {value}")
    write_report(
        report_path("fp8_quality.json"),
        device=torch.cuda.get_device_name(),
        model=checkpoint.name,
        args=vars(args),
        result=result,
    )


if __name__ == "__main__":
    main()
