"""Time to first token with a shared prefix: the context cache on against off.

16 requests share a 1,000-token prefix (a long system prompt) and differ in a short question;
they arrive as a Poisson stream (one streaming client thread each) at an engine under in-flight
batching. Prints TTFT p50/p99 with the context cache off and on, and the ratio; writes JSON.

    .venv/bin/python bench/context_cache_ttft.py [--rate 0.5] [--requests 16]
"""

from __future__ import annotations

import argparse
import os
import random
import threading
import time

from inflight import LLM, SamplingParams
from inflight.bench.online import percentile
from inflight.bench.report import write_report

SYSTEM = (
    "You are the support assistant of a large library. Answer questions about opening hours, "
    "loans, renewals, fines, rooms, printing and the catalogue, politely and in detail. "
)


def run(llm: LLM, prompts: list[list[int]], rate: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    ttft: list[float] = []
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def client(prompt: list[int]) -> None:
        start = time.perf_counter()
        for delta in llm.generate_stream({"prompt_token_ids": prompt}, params):
            if delta.token_ids:
                ttft.append(time.perf_counter() - start)
                break

    threads = []
    for prompt in prompts:
        thread = threading.Thread(target=client, args=(prompt,))
        thread.start()
        threads.append(thread)
        time.sleep(rng.expovariate(rate))
    for thread in threads:
        thread.join()
    return ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prefix", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=0.5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", default="bench/out/context_cache_ttft.json")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    results = {}
    for cache in (False, True):
        llm = LLM(
            enable_in_flight_batching=True,
            max_batch_size=args.batch,
            max_model_len=args.prefix + 128,
            max_num_tokens=512,
            enable_context_reuse=cache,
        )
        tok = llm.tokenizer
        prefix = tok.encode(SYSTEM * (args.prefix // 20 + 1))[: args.prefix]
        prompts = [
            prefix
            + tok.encode(f" Question {i}: when does branch {i} open?", add_special_tokens=False)
            for i in range(args.requests)
        ]
        run(llm, [tok.encode("warm up")], rate=100, seed=1)
        ttft = run(llm, prompts, args.rate, seed=0)
        metrics = llm.get_context_cache_metrics()
        llm.close()
        name = "on" if cache else "off"
        results[name] = {
            "ttft_p50": percentile(ttft, 50),
            "ttft_p99": percentile(ttft, 99),
            "context_cache": metrics,
        }
        print(
            f"context cache {name:<3}  TTFT p50 {results[name]['ttft_p50']:6.2f} s"
            f"  p99 {results[name]['ttft_p99']:6.2f} s",
            flush=True,
        )
    ratio = results["off"]["ttft_p50"] / results["on"]["ttft_p50"]
    print(f"TTFT p50 off / on: {ratio:.2f}x")
    write_report(args.out, args=vars(args), results=results, ratio=ratio)


if __name__ == "__main__":
    main()
