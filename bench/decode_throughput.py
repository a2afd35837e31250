"""Decode throughput on the CPU: inflight beside HF transformers, same model file, same run.

Single-request decode tok/s (one sequence) and batched decode tok/s (N sequences decoding together),
greedy, EOS ignored. Decode time excludes prefill: it is the time to generate `--tokens` tokens
minus the time to generate the first one, for both engines alike.

    .venv/bin/python bench/decode_throughput.py [--model PATH] [--batch 8] [--tokens 64]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from inflight.bench.report import write_report
from inflight.model.checkpoints.loader import default_model_path
from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.runtime.runtime import Runtime

PROMPTS = [
    "The history of the Roman Empire begins with",
    "Write a haiku about autumn leaves falling in the park.",
    "Explain how a bicycle stays upright while moving.",
    "List some uses of baking soda around the house:",
    "The three laws of thermodynamics are",
    "Once upon a time, in a small village by the sea,",
    "What is the difference between weather and climate?",
    "A good recipe for pancakes needs",
]


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def inflight_decode(runtime: Runtime, prompts: list[list[int]], tokens: int) -> float:
    """Decode tok/s of `len(prompts)` residents stepping together."""

    def run(n: int) -> None:
        session = runtime.new_session()
        for ids in prompts:
            params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            session.admit(GenerationRequest(ids, params))
        while session.residents():
            session.step()
        session.finish()

    run(2)  # warm-up
    first = _timed(lambda: run(1))
    full = _timed(lambda: run(tokens))
    return len(prompts) * (tokens - 1) / (full - first)


def hf_decode(model, tokenizer, texts: list[str], tokens: int) -> float:
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(texts, return_tensors="pt", padding=True)

    def run(n: int) -> None:
        with torch.no_grad():
            model.generate(
                **batch,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )

    run(2)
    first = _timed(lambda: run(1))
    full = _timed(lambda: run(tokens))
    return len(texts) * (tokens - 1) / (full - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: embedded SmolLM2)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", default="bench/out/decode_throughput.json")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    texts = (PROMPTS * (args.batch // len(PROMPTS) + 1))[: args.batch]
    runtime = Runtime(args.model, DeploymentOptions(max_batch_size=args.batch, max_model_len=512))
    ids = [runtime.tokenizer.encode(t) for t in texts]
    path = Path(args.model) if args.model else default_model_path()
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    where = path.parent if path.suffix == ".gguf" else path
    hf = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kwargs).eval()
    hf_tok = AutoTokenizer.from_pretrained(where, **kwargs)

    rows = {
        "inflight_single": inflight_decode(runtime, ids[:1], args.tokens),
        "inflight_batched": inflight_decode(runtime, ids, args.tokens),
        "transformers_single": hf_decode(hf, hf_tok, texts[:1], args.tokens),
        "transformers_batched": hf_decode(hf, hf_tok, texts, args.tokens),
    }
    print(
        f"decode tok/s, {path.name} (inflight: quantization auto; transformers: float32), "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'engine':<14}{'single':>10}{f'batch {args.batch}':>12}")
    for engine in ("inflight", "transformers"):
        print(f"{engine:<14}{rows[engine + '_single']:>10.1f}{rows[engine + '_batched']:>12.1f}")
    write_report(args.out, model=path.name, batch=args.batch, tokens=args.tokens, decode_tok_s=rows)


if __name__ == "__main__":
    main()
