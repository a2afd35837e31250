"""What structured outputs and penalties cost a decode step: a batch where half the rows are
JSON-schema constrained, or penalized, against the same batch all free.

Seats `--batch` residents of 100-token prompts (every other one constrained by a JSON schema
that cannot end within the run, so every row decodes through it, or penalized: repetition,
frequency and presence penalties, whose counts the sampler builds from the row's tokens each
step), prefills them, then times `--steps` decode steps; the modes alternate for `--rounds`
rounds. Default: the
embedded model on the CPU; `--shape qwen3-0.6b` a random-weight model of that shape on CUDA
(with the embedded model's tokenizer, which JSON needs). Prints step times and the overhead;
writes JSON to $OUT (or bench/out).

    .venv/bin/python bench/structured_overhead.py [--batch 16] [--steps 48] [--rounds 3]
    python3 bench/structured_overhead.py --shape qwen3-0.6b [--batch 16 256] [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from inflight.bench.offline import make_workload
from inflight.bench.random_model import random_checkpoint
from inflight.bench.report import report_path, write_report
from inflight.model.checkpoints.loader import open_checkpoint
from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.request import GenerationRequest, SamplingParams, StructuredOutputs
from inflight.runtime.runtime import Runtime

# Rows must decode through every timed step: an array of strings that cannot end early. (A
# maxLength on the strings would make each mask about 6x costlier: llguidance counts them.)
SCHEMA = {
    "type": "object",
    "properties": {"words": {"type": "array", "items": {"type": "string"}, "minItems": 500}},
    "required": ["words"],
}


PENALTIES = dict(repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5)
MODES = ("free", "half constrained", "half penalized")


def step_ms(runtime: Runtime, prompts: list[list[int]], mode: str, steps: int) -> float:
    """Mean wall time of a decode step of every row (every other one as `mode` says)."""
    session = runtime.new_session()
    for i, prompt in enumerate(prompts):
        odd = bool(i % 2)
        constrained = odd and mode == "half constrained"
        params = SamplingParams(
            max_tokens=steps + 8,
            temperature=0,
            ignore_eos=True,
            structured_outputs=StructuredOutputs(json=SCHEMA) if constrained else None,
            **(PENALTIES if odd and mode == "half penalized" else {}),
        )
        assert session.admit(GenerationRequest(prompt, params)).ref is not None
    for _ in range(4):  # the prefill, and a few decode steps to settle
        session.step()
    if runtime.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        result = session.step()
        assert not result.finished, "a row ended early"
    if runtime.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    session.abort()
    session.finish()
    return elapsed / steps * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default=None, help="a random-weight CUDA model of this shape")
    parser.add_argument("--batch", type=int, nargs="+", default=[16])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="a checkpoint whose tokenizer the prompts and grammars use (default: the embedded "
        "model; an HF directory holding its tokenizer where the GGUF cannot be read)",
    )
    args = parser.parse_args()
    embedded = open_checkpoint(args.tokenizer)
    if args.shape:
        device = torch.device("cuda")
        checkpoint = random_checkpoint(args.shape, device, tokenizer=embedded.tokenizer)
        config = dict(device="cuda")
    else:
        checkpoint, config = embedded, {}
    results = {}
    for batch in args.batch:
        runtime = Runtime(
            checkpoint,
            DeploymentOptions(
                max_batch_size=batch, max_model_len=512, max_num_tokens=8192, **config
            ),
        )
        work = make_workload(embedded.tokenizer, batch, 100, args.steps)
        runs: dict[str, list[float]] = {mode: [] for mode in MODES}
        for _ in range(args.rounds):
            for mode in runs:
                runs[mode].append(step_ms(runtime, work.prompts, mode, args.steps))
        medians = {mode: statistics.median(v) for mode, v in runs.items()}
        free = medians["free"]
        results[batch] = {
            "step_ms": runs,
            "overhead": {mode: ms / free - 1 for mode, ms in medians.items() if mode != "free"},
        }
        line = ", ".join(
            f"{mode} {ms:.2f} ms/step ({batch / ms * 1000:.0f} tok/s, "
            f"{(ms / free - 1) * 100:+.1f} %)"
            for mode, ms in medians.items()
        )
        print(f"batch {batch}: {line} (medians of {args.rounds}; all: {runs})", flush=True)
        del runtime
    write_report(
        report_path("structured_overhead.json"),
        device=torch.cuda.get_device_name() if args.shape else "cpu",
        threads=torch.get_num_threads(),
        args=vars(args),
        results=results,
    )


if __name__ == "__main__":
    main()
