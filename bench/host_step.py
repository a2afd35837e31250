"""The host's share of a decode step: many residents on a tiny random model, so that the
scheduler, the executor's planning, the sampler's bookkeeping and the output processor (not
the forward pass) are what a step costs.

Seats `--residents` requests of random 64-token prompts on a one-layer random model (a
2,048-token vocabulary) on the CPU (overlapped steps, as on CUDA), prefills them, then times
`--rounds` rounds of `--steps` decode steps; prints the minimum and median ms a step, and with
`--profile` the functions a cProfile of one round spends most in.

    .venv/bin/python bench/host_step.py [--residents 256] [--steps 20] [--rounds 7] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time

import torch

from inflight.bench import random_model
from inflight.bench.report import report_path, write_report
from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.runtime.runtime import Runtime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--residents", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shape = random_model.SHAPES["host-step"]
    runtime = Runtime(
        random_model.random_checkpoint("host-step", torch.device("cpu")),
        DeploymentOptions(
            device="cpu",
            max_batch_size=args.residents,
            max_model_len=1024,
            max_num_tokens=16384,
            overlap=True,
        ),
    )
    rng = random.Random(0)
    session = runtime.new_session()
    params = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)
    for _ in range(args.residents):
        prompt = [rng.randrange(1, shape.vocab_size) for _ in range(64)]
        session.admit(GenerationRequest(prompt, params))
    while any(r.prefilling for r in runtime.scheduler.residents.values()):
        session.step()
    for _ in range(3):
        session.step()
    per_step = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        for _ in range(args.steps):
            session.step()
        per_step.append((time.perf_counter() - start) / args.steps * 1000)
    low, median = min(per_step), statistics.median(per_step)
    print(f"decode step of {args.residents} residents: min {low:.3f} ms, median {median:.3f} ms")
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps):
            session.step()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
    write_report(
        report_path("host_step.json"),
        args=vars(args),
        min_ms=low,
        median_ms=median,
        rounds_ms=per_step,
    )


if __name__ == "__main__":
    main()
