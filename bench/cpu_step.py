"""Where a CPU step's time goes, with the native decoder step and on the Python layers,
alternated in one process.

The short-chat workload (16 prompts of random tokens, greedy, EOS ignored, all admitted at once,
no context cache) through `LLM` under in-flight batching; every session step is timed, and
inside it the forward pass and the LM head. "prefill" is the first step; the medians are over
the steps after it: decodes alone, unless a small `--max-num-tokens` chunks the prompts, which
then prefill beside the first rows' decodes.

    .venv/bin/python bench/cpu_step.py [--model M] [--prompts 16] [--prompt-len 38]
        [--output-len 64] [--threads 2] [--rounds 2] [--max-num-tokens 2048]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections import defaultdict

import torch

from inflight import LLM, SamplingParams
from inflight.bench.report import write_report
from inflight.runtime.device.model_runner import ModelRunner
from inflight.runtime.host.session import GenerationSession

_times: dict[str, list[float]] = defaultdict(list)


def _timed(owner: type, name: str, key: str) -> None:
    original = getattr(owner, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        result = original(*args, **kwargs)
        _times[key].append(time.perf_counter() - start)
        return result

    setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=38)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-num-tokens", type=int, default=2048)
    parser.add_argument("--out", default="bench/out/cpu_step.json")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    for owner, name, key in (
        (GenerationSession, "step", "step"),
        (ModelRunner, "forward", "forward"),
        (ModelRunner, "logits", "head"),
    ):
        _timed(owner, name, key)

    llm = LLM(
        args.model,
        enable_in_flight_batching=True,
        max_batch_size=args.prompts,
        max_num_tokens=args.max_num_tokens,
        enable_context_reuse=False,  # every round computes its prompts
    )
    model = llm._runtime.executor.runner.model
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prompts = [
        {"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.prompt_len)]}
        for _ in range(args.prompts)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[0], SamplingParams(max_tokens=2))  # warm-up
    results: dict[str, list[dict[str, float]]] = defaultdict(list)
    print(f"{args.prompts} x {args.prompt_len} tokens -> {args.output_len}, {args.threads} threads")
    print(f"{'path':<8}{'tok/s':>8}{'prefill':>9}{'step ms':>9}{'forward':>9}{'head':>7}")
    for _ in range(args.rounds):
        for path, native in (("native", True), ("layers", False)):
            model.native_step = native
            _times.clear()
            start = time.perf_counter()
            llm.generate(prompts, params)
            elapsed = time.perf_counter() - start
            row = {"tok_s": args.prompts * args.output_len / elapsed}
            row["prefill_ms"] = 1e3 * _times["step"][0]
            for key in ("step", "forward", "head"):
                row[f"{key}_ms"] = 1e3 * statistics.median(_times[key][1:])
            results[path].append(row)
            print(
                f"{path:<8}{row['tok_s']:>8.1f}{row['prefill_ms']:>9.1f}{row['step_ms']:>9.2f}"
                f"{row['forward_ms']:>9.2f}{row['head_ms']:>7.2f}"
            )
    llm.close()
    write_report(
        args.out,
        model=args.model or "default",
        threads=args.threads,
        max_num_tokens=args.max_num_tokens,
        rounds=results,
    )


if __name__ == "__main__":
    main()
