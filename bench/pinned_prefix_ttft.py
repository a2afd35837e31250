"""Time to first token of requests sharing a long system prompt under KV pressure: the system
prompt pinned (`save_system_prompt_kv_cache`) against not pinned, in the same run.

The default model (SmolLM2-135M GGUF, CPU, in-flight batching) with a KV pool of `--kv-blocks`
blocks. Each round, `--fillers` requests of 1,000 random tokens run first (their KV evicts
whatever is cached and not pinned), then a question under the shared system prompt of about
`--system-tokens` tokens, streamed: its time to first token. The first question of each mode
computes the system prompt (and, pinned, pins it). Modes alternate round by round on two
engines, so the machine's drift falls on both alike. Prints TTFT median and mean per mode and
the prompt tokens the cache served; writes JSON.

    .venv/bin/python bench/pinned_prefix_ttft.py [--rounds 6] [--system-tokens 2000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from inflight import LLM, SamplingParams
from inflight.bench.report import report_path, write_report

SENTENCE = (
    "You are the support assistant of a large library; answer questions about opening hours, "
    "loans, renewals, fines, rooms, printing and the catalogue, politely and in detail. "
)


def question(llm: LLM, system: str, text: str, pin: bool) -> tuple[float, int]:
    """(seconds to the first token, prompt tokens the cache served) of one question."""
    conversation = [{"role": "system", "content": system}, {"role": "user", "content": text}]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    request = llm.prepare(conversation, params, save_system_prompt_kv_cache=pin)
    start = time.perf_counter()
    handle = llm.start(request, wait_for_room=True)
    first = None
    for chunk in handle:
        if chunk.token_ids and first is None:
            first = time.perf_counter() - start
    assert first is not None
    return first, handle.get().cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--fillers", type=int, default=8)
    parser.add_argument("--kv-blocks", type=int, default=384)
    args = parser.parse_args()
    options = dict(
        enable_in_flight_batching=True,
        max_batch_size=4,
        max_model_len=4096,
        num_kv_blocks=args.kv_blocks,
        max_pinned_prefix_tokens=args.system_tokens + 512,
    )
    engines = {mode: LLM(**options) for mode in ("pinned", "unpinned")}
    tokenizer = engines["pinned"].tokenizer
    system = SENTENCE
    while len(tokenizer.encode(system)) < args.system_tokens:
        system += SENTENCE
    system_tokens = len(tokenizer.encode(system))
    rng = random.Random(0)
    results: dict[str, dict[str, list]] = {m: {"ttft": [], "cached": []} for m in engines}
    for mode, llm in engines.items():  # the first question computes (and pins) the prompt
        question(llm, system, "Hello.", pin=mode == "pinned")
    for i in range(args.rounds):
        fillers = [
            {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(1000)]}
            for _ in range(args.fillers)
        ]
        for mode, llm in engines.items():
            llm.generate(fillers, SamplingParams(max_tokens=2, ignore_eos=True))
            ttft, cached = question(llm, system, f"Question {i}: when do you open?", pin=False)
            results[mode]["ttft"].append(ttft)
            results[mode]["cached"].append(cached)
            print(f"round {i} {mode:>8}: TTFT {ttft * 1000:7.1f} ms, {cached} tokens cached")
    summary = {}
    for mode, values in results.items():
        ttft = values["ttft"]
        summary[mode] = {
            "ttft_median_ms": statistics.median(ttft) * 1000,
            "ttft_mean_ms": statistics.mean(ttft) * 1000,
            "cached_tokens": values["cached"],
            "evictions": engines[mode].get_context_cache_metrics()["evictions"],
        }
    for llm in engines.values():
        llm.close()
    print(f"\nsystem prompt {system_tokens} tokens, KV pool {args.kv_blocks} blocks of 16")
    for mode, row in summary.items():
        print(
            f"{mode:>8}: TTFT median {row['ttft_median_ms']:7.1f} ms, mean "
            f"{row['ttft_mean_ms']:7.1f} ms, evictions {row['evictions']}"
        )
    ratio = summary["unpinned"]["ttft_median_ms"] / summary["pinned"]["ttft_median_ms"]
    print(f"unpinned / pinned median TTFT: {ratio:.1f}x")
    write_report(
        report_path("pinned_prefix_ttft.json"),
        system_tokens=system_tokens,
        args=vars(args),
        summary=summary,
        ratio=ratio,
    )


if __name__ == "__main__":
    main()
