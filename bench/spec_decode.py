"""Speculative decoding (prompt lookup) against plain decoding, in the same run.

Two workloads, greedy: "repetitive" (edits that quote their prompt: text to correct, code to
rename or document, a list to reformat; completions) and "plain" (open chat questions, where
lookups match less and the drafter has to back off). Each workload is a pool of its prompts
handed to the in-flight batching engine at once; "batch" is how many run at a time (a queued one
joins as another ends). The pool holds each prompt `--repeats` times per unit of batch, so that
the pool's end, where slots empty and the slowest request runs on alone, weighs as little at
batch 4 as at batch 1 (speculation ends predictable requests first, and the rest run late).
Plain and speculative runtimes take turns over `--rounds`; output tok/s is output tokens over
wall time (prefill included), medians over rounds. Default: the embedded SmolLM2 on the CPU;
`--model PATH --device cuda` another checkpoint on the GPU; `--shape qwen3-0.6b` a
random-weight model of that shape on CUDA (its greedy output loops, so acceptance there says
nothing of real text: what it measures is what verification steps cost against plain ones).
Writes JSON to $OUT (or bench/out).

    .venv/bin/python bench/spec_decode.py [--batches 1 2 4] [--rounds 3] [--k 4]
    python3 bench/spec_decode.py --model FILE.gguf --device cuda
    python3 bench/spec_decode.py --shape qwen3-0.6b --tokenizer DIR
"""

from __future__ import annotations

import argparse
import statistics

import torch

from inflight.bench.offline import run_requests
from inflight.bench.random_model import random_checkpoint
from inflight.bench.report import report_path, write_report
from inflight.model.checkpoints.loader import open_checkpoint
from inflight.protocol.deployment import DeploymentOptions, SpeculativeConfig
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.runtime.runtime import Runtime

CODE = """def total_price(items, tax):
    result = 0
    for item in items:
        result = result + item.price * item.count
    result = result * (1 + tax)
    return result


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
"""
TEXT = (
    "Our team met on monday to discuss the the new release. We decided that the the release "
    "will ship next week, after the last tests pass. Everyone agreed that documentation need "
    "to be updated before then, and that the website should announce the changes."
)
# Completions (no chat template): SmolLM2-135M answers edit instructions in chat with a line or
# two, but continues these by quoting its prompt, as edits do.
REPETITIVE = [
    f"Text:\n{TEXT}\n\nThe same text with the typos fixed:\n",
    f"{CODE}\n\n# The same code with `result` renamed to `total`:\n",
    f"{CODE}\n\n# The same code with a docstring in each function:\n",
    "Fruits: apples, pears, plums, cherries, grapes, melons, lemons, limes, oranges, peaches.\n"
    "The same fruits as a numbered list:\n1.",
]
# Chat questions.
PLAIN = [
    "What are the main causes of the seasons on Earth?",
    "Give me three ideas for a birthday party for a ten-year-old.",
    "Explain what a hash table is to a beginner.",
    "Why do cats purr?",
]


def run_pool(
    runtime: Runtime, prompts: list[list[int]], max_tokens: int, batch: int
) -> tuple[list[tuple[int, ...]], float]:
    """Every prompt's greedy output, `batch` at a time, and the wall time of the pool."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    return run_requests(runtime, [GenerationRequest(p, params) for p in prompts], batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded one)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default=None, help="a random-weight CUDA model of this shape")
    parser.add_argument("--tokenizer", default=None, help="where --shape's tokenizer is")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=2, help="copies of each prompt per batch")
    args = parser.parse_args()
    checkpoint = open_checkpoint(args.tokenizer if args.shape else args.model)
    if args.shape:
        args.device = "cuda"
        checkpoint = random_checkpoint(
            args.shape, torch.device("cuda"), tokenizer=checkpoint.tokenizer
        )
    tok = checkpoint.tokenizer

    def chat(text: str) -> list[int]:
        if not tok.chat_template:  # a bare tokenizer: the text as it is
            return tok.encode(text)
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))

    workloads = {
        "repetitive": [tok.encode(p) for p in REPETITIVE],
        "plain": [chat(p) for p in PLAIN],
    }
    base = dict(
        max_batch_size=max(args.batches),
        max_model_len=1024,
        enable_context_reuse=False,
        device=args.device,
    )
    spec = SpeculativeConfig(num_speculative_tokens=args.k)
    runtimes = {
        "plain": Runtime(checkpoint, DeploymentOptions(**base)),
        "speculative": Runtime(checkpoint, DeploymentOptions(**base, speculative_config=spec)),
    }
    for runtime in runtimes.values():  # warm-up (kernel builds, graph capture)
        run_pool(runtime, workloads["plain"][:1], 8, 1)
    results: dict = {}
    for workload, prompts in workloads.items():
        for batch in args.batches:
            pool = prompts * (args.repeats * batch)
            runs: dict[str, list[float]] = {name: [] for name in runtimes}
            outputs: dict[str, list] = {}
            before = runtimes["speculative"].speculator.snapshot()
            for _ in range(args.rounds):
                for name, runtime in runtimes.items():
                    outputs[name], elapsed = run_pool(runtime, pool, args.max_tokens, batch)
                    runs[name].append(sum(map(len, outputs[name])) / elapsed)
            pairs = zip(outputs["plain"], outputs["speculative"], strict=True)
            same = sum(a == b for a, b in pairs)
            after = runtimes["speculative"].speculator.snapshot()
            drafted = after["drafted_tokens"] - before["drafted_tokens"]
            accepted = after["accepted_tokens"] - before["accepted_tokens"]
            plain, fast = (statistics.median(runs[n]) for n in ("plain", "speculative"))
            results[f"{workload} batch {batch}"] = dict(
                tok_s=runs,
                speedup=fast / plain,
                drafted=drafted,
                accepted=accepted,
                identical_outputs=f"{same}/{len(pool)}",
            )
            print(
                f"{workload:>10} batch {batch}: plain {plain:7.1f} tok/s, speculative "
                f"{fast:7.1f} tok/s, x{fast / plain:.2f} (drafts {drafted}, accepted "
                f"{accepted / drafted if drafted else 0:.0%}; "
                f"outputs identical {same}/{len(pool)})",
                flush=True,
            )
    write_report(
        report_path("spec_decode.json"),
        device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        threads=torch.get_num_threads(),
        args=vars(args),
        statistic="median",
        results=results,
    )


if __name__ == "__main__":
    main()
