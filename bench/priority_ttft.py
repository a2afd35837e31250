"""Time to first token of urgent requests behind a backlog: the priority scheduling policy
(urgent requests at priority -1) against FCFS, on the same arrivals.

The default model (SmolLM2-135M GGUF, CPU, in-flight batching, `--batch` residents). Each round
submits `--requests` chat requests at once (each `--tokens` tokens, EOS ignored), every
`--every`-th of them urgent; under FCFS they are seated in arrival order, under the priority
policy the urgent ones first. Time to first token is measured per request from the common
submission instant. Policies alternate round by round on two engines, so the machine's drift
falls on both alike. Prints the median and worst TTFT of urgent and other requests per policy
and the makespan; writes JSON.

    .venv/bin/python bench/priority_ttft.py [--rounds 3] [--requests 32] [--every 4]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from inflight import LLM, SamplingParams
from inflight.bench.report import report_path, write_report


def first_token(handle, start: float, out: list[float], index: int) -> None:
    """Read `handle` to its end; `out[index]`: seconds from `start` to its first token."""
    for chunk in handle:
        if chunk.token_ids and out[index] == 0.0:
            out[index] = time.perf_counter() - start


def one_round(llm: LLM, args: argparse.Namespace, urgent: list[bool], priority: bool) -> dict:
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    requests = [
        llm.prepare(
            [{"role": "user", "content": f"Question {i}: tell me about the sea."}],
            params,
            priority=-1 if priority and u else 0,
        )
        for i, u in enumerate(urgent)
    ]
    ttft = [0.0] * len(requests)
    start = time.perf_counter()
    handles = [llm.start(r, wait_for_room=True) for r in requests]
    readers = [
        threading.Thread(target=first_token, args=(h, start, ttft, i))
        for i, h in enumerate(handles)
    ]
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    makespan = time.perf_counter() - start
    return {
        "urgent": [t for t, u in zip(ttft, urgent, strict=True) if u],
        "other": [t for t, u in zip(ttft, urgent, strict=True) if not u],
        "makespan": makespan,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    options = dict(enable_in_flight_batching=True, max_batch_size=args.batch, max_model_len=1024)
    engines = {
        "fcfs": LLM(**options),
        "priority": LLM(**options, scheduling_policy="priority"),
    }
    # The urgent requests arrive last in each group of `every`, so FCFS seats them late.
    urgent = [i % args.every == args.every - 1 for i in range(args.requests)]
    rows: dict[str, dict[str, list[float]]] = {
        p: {"urgent": [], "other": [], "makespan": []} for p in engines
    }
    for llm in engines.values():  # warm-up
        llm.generate("Hi", SamplingParams(max_tokens=4))
    for i in range(args.rounds):
        for policy, llm in engines.items():
            got = one_round(llm, args, urgent, policy == "priority")
            for key in ("urgent", "other"):
                rows[policy][key] += got[key]
            rows[policy]["makespan"].append(got["makespan"])
            print(
                f"round {i} {policy:>8}: urgent TTFT median {statistics.median(got['urgent']):.2f}"
                f" s, other {statistics.median(got['other']):.2f} s, all done in "
                f"{got['makespan']:.2f} s"
            )
    for llm in engines.values():
        llm.close()
    summary = {
        policy: {
            "urgent_ttft_median_s": statistics.median(row["urgent"]),
            "urgent_ttft_max_s": max(row["urgent"]),
            "other_ttft_median_s": statistics.median(row["other"]),
            "other_ttft_max_s": max(row["other"]),
            "makespan_median_s": statistics.median(row["makespan"]),
        }
        for policy, row in rows.items()
    }
    print(
        f"\n{args.requests} requests of {args.tokens} tokens, 1 in {args.every} urgent, batch "
        f"{args.batch}, {args.rounds} rounds"
    )
    for policy, row in summary.items():
        print(
            f"{policy:>8}: urgent TTFT median {row['urgent_ttft_median_s']:.2f} s (worst "
            f"{row['urgent_ttft_max_s']:.2f}), others {row['other_ttft_median_s']:.2f} s (worst "
            f"{row['other_ttft_max_s']:.2f}), makespan {row['makespan_median_s']:.2f} s"
        )
    write_report(report_path("priority_ttft.json"), args=vars(args), summary=summary)


if __name__ == "__main__":
    main()
