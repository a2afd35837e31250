"""Offline throughput: in-flight batching against the blocking path, same model, same run.

All requests are handed over at once (one client thread each, streaming); prompts are windows of
real text with lengths uniform in [64, 512] tokens, outputs uniform in [32, 256] tokens (greedy,
EOS ignored, so both paths do exactly the same work). Prints output tok/s and mean time to first
token for each path, and the ratio; writes JSON.

    .venv/bin/python bench/ifb_offline.py [--requests 32] [--batch 8]
"""

from __future__ import annotations

import argparse
import os
import random
import threading
import time

from inflight import LLM, SamplingParams
from inflight.bench.report import write_report

TEXT = (
    "The history of science is the study of the development of science and scientific "
    "knowledge, including both the natural and social sciences. Science is a body of empirical, "
    "theoretical, and practical knowledge about the natural world, produced by scientists who "
    "emphasize the observation, explanation, and prediction of real-world phenomena. Early "
    "cultures in Mesopotamia and Egypt recorded observations of the stars, developed methods of "
    "measurement, and practised medicine. Greek philosophers sought natural explanations for "
    "events in the world, and their work was preserved and extended by scholars in the Islamic "
    "world during the Middle Ages. The Scientific Revolution of the sixteenth and seventeenth "
    "centuries brought new methods of experiment and mathematical description. "
)


def workload(llm: LLM, requests: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    corpus = llm.tokenizer.encode(TEXT * 20, add_special_tokens=False)
    items = []
    for _ in range(requests):
        length = rng.randint(64, 512)
        start = rng.randint(0, len(corpus) - length)
        items.append((corpus[start : start + length], rng.randint(32, 256)))
    return items


def run(llm: LLM, items: list[tuple[list[int], int]]) -> dict[str, float]:
    first_token: dict[int, float] = {}
    produced: dict[int, int] = {}
    start = time.perf_counter()

    def client(i: int, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        n = 0
        for delta in llm.generate_stream({"prompt_token_ids": prompt}, params):
            if delta.token_ids and i not in first_token:
                first_token[i] = time.perf_counter() - start
            n += len(delta.token_ids)
        produced[i] = n

    threads = [threading.Thread(target=client, args=(i, p, m)) for i, (p, m) in enumerate(items)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    total = sum(produced.values())
    assert total == sum(m for _, m in items), "every request must produce its max_tokens"
    return {
        "seconds": elapsed,
        "output_tokens": total,
        "output_tok_s": total / elapsed,
        "mean_ttft_s": sum(first_token.values()) / len(first_token),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/out/ifb_offline.json")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    results = {}
    for mode in ("blocking", "ifb"):
        llm = LLM(
            args.model,
            enable_in_flight_batching=mode == "ifb",
            max_batch_size=args.batch,
            max_model_len=1024,
        )
        items = workload(llm, args.requests, args.seed)
        run(llm, items[:2])  # warm-up
        results[mode] = run(llm, items)
        llm.close()
        r = results[mode]
        print(
            f"{mode:<9} {r['output_tok_s']:8.1f} output tok/s   mean TTFT {r['mean_ttft_s']:7.2f} s"
            f"   ({r['output_tokens']} tokens in {r['seconds']:.1f} s)"
        )
    ratio = results["ifb"]["output_tok_s"] / results["blocking"]["output_tok_s"]
    print(f"IFB / blocking throughput: {ratio:.2f}x")
    write_report(args.out, requests=args.requests, batch=args.batch, results=results, ratio=ratio)


if __name__ == "__main__":
    main()
