"""What sampled rows cost beside greedy ones: the sampler alone, and decoding through `LLM`.

The sampler: one call over `--rows` rows of random logits (`--vocab` tokens, scale 3) per
setting: greedy, temperature 0.7, with top-p 0.9, with top-k 50, seeded; ms a call, the best of
`--repeat` rounds of 20 calls. Decoding: `--prompts` short prompts through `LLM` under in-flight
batching (the default model unless `--model`), `--output-len` tokens each with EOS ignored,
greedy and sampled alternated (greedy first and last); output tok/s.

    .venv/bin/python bench/sampling.py [--rows 16 64] [--vocab 49152] [--prompts 16]
        [--output-len 64] [--device cpu]   (prints; writes JSON to $OUT or bench/out)

Decoding runs first, with the threads `LLM` sets up (setting torch's beside its own pool
oversubscribed the cores).
"""

from __future__ import annotations

import argparse
import time

import torch

from inflight import LLM, SamplingParams
from inflight.bench.report import report_path, write_report
from inflight.runtime.device.sampler import Sampler
from inflight.runtime.host.rows import SamplingRow

SETTINGS = {
    "greedy": dict(temperature=0),
    "temperature 0.7": dict(temperature=0.7),
    "top_p 0.9": dict(temperature=0.7, top_p=0.9),
    "top_k 50": dict(temperature=0.7, top_k=50),
    "seeded": dict(temperature=0.7, seed=1),
}


def sampler_ms(rows: int, vocab: int, device: torch.device, repeat: int) -> dict[str, float]:
    sampler = Sampler(0, device)
    logits = torch.randn(rows, vocab, device=device) * 3
    out = {}
    for name, params in SETTINGS.items():
        batch = [SamplingRow(SamplingParams(**params), 3) for _ in range(rows)]
        sampler(logits, batch)
        best = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            for _ in range(20):
                sampler(logits, batch)
            best = min(best, (time.perf_counter() - start) / 20 * 1e3)
        out[name] = best
    return out


def decode_tok_s(llm: LLM, prompts: list[str], output_len: int) -> dict[str, float]:
    out: dict[str, float] = {}
    order = ["greedy", "temperature 0.7", "top_p 0.9", "greedy again"]
    for name in order:
        params = SamplingParams(
            **SETTINGS[name.removesuffix(" again")], max_tokens=output_len, ignore_eos=True
        )
        llm.generate(prompts[:2], params)
        start = time.perf_counter()
        results = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        out[name] = sum(len(r.token_ids) for r in results) / elapsed
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    record: dict = {"sampler_ms": {}, "args": vars(args)}
    words = [
        "cat",
        "dog",
        "fox",
        "owl",
        "bee",
        "ant",
        "elk",
        "yak",
        "emu",
        "cow",
        "pig",
        "hen",
        "ram",
        "eel",
        "cod",
        "jay",
    ]
    prompts = [f"Write a short story about a {words[i % len(words)]}." for i in range(args.prompts)]
    options = dict(enable_in_flight_batching=True, max_batch_size=args.prompts, device=args.device)
    llm = LLM(args.model, **options) if args.model else LLM(**options)
    record["decode_tok_s"] = decode_tok_s(llm, prompts, args.output_len)
    shown = ", ".join(f"{name} {v:.1f}" for name, v in record["decode_tok_s"].items())
    print(f"decoding {args.prompts} prompts x {args.output_len} tokens, tok/s: {shown}", flush=True)
    for rows in args.rows:
        figures = sampler_ms(rows, args.vocab, torch.device(args.device), args.repeat)
        record["sampler_ms"][rows] = figures
        shown = ", ".join(f"{name} {ms:.2f}" for name, ms in figures.items())
        print(f"sampler, {rows} rows x {args.vocab}: ms a call: {shown}", flush=True)
    write_report(report_path("sampling.json"), **record)


if __name__ == "__main__":
    main()
