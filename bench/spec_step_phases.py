"""Where a step's time goes, plain against speculative decoding (prompt lookup), on CUDA.

Runs the repetitive workload of `spec_decode.py` (`--repeats` copies of each prompt per unit of
batch, `--batch` at a time) through a session with overlapped steps, with a host timer around
each part of the step: planning (and in it the drafter), launching (batch building, the forward's
launch), sampling, waiting for the device, and taking the step in; and counts the steps that
run eagerly (those with a prefill) instead of replaying a CUDA graph. Then times each graph's
replay on the device. Writes JSON to $OUT (or bench/out).

    python3 bench/spec_step_phases.py --model FILE.gguf [--batch 4]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from spec_decode import REPETITIVE

import inflight.runtime.device.executor as executor_module
from inflight.bench.report import report_path, write_report
from inflight.model.checkpoints.loader import open_checkpoint
from inflight.protocol.deployment import DeploymentOptions, SpeculativeConfig
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.protocol.stepped import AdmissionAnswer
from inflight.runtime.runtime import Runtime


def run(runtime: Runtime, prompts: list[list[int]], batch: int, max_tokens: int) -> tuple:
    """The pool's output tokens and steps, `batch` residents at a time."""
    session = runtime.new_session()
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    queue = [GenerationRequest(p, params) for p in prompts]
    tokens = steps = 0
    while queue or session.residents():
        while len(session.residents()) < batch and queue:
            if session.admit(queue[0]).answer is not AdmissionAnswer.ADMITTED:
                break
            queue.pop(0)
        result = session.step()
        steps += 1
        tokens += sum(len(chunk.token_ids) for chunk in result.deltas.values())
    session.finish()
    return tokens, steps


def timed(totals: dict[str, float], key: str, fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - start

    return wrapper


def phases(runtime: Runtime, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    # Warm-up over the whole pool: an eager step of a shape not seen before builds kernels.
    run(runtime, prompts, args.batch, args.max_tokens)
    totals: dict[str, float] = defaultdict(float)
    ex, graphs = runtime.executor, runtime.executor.runner.graphs
    eager = 0
    replay = graphs.run

    def counted(*a):
        nonlocal eager
        hidden = replay(*a)
        eager += hidden is None
        return hidden

    patches = [
        (runtime.scheduler, "schedule", "plan"),
        (ex, "launch", "launch"),
        (ex, "execute", "launch: forward"),
        (ex, "sample", "sample"),
        (ex, "fetch", "wait for the device"),
        (runtime.outputs, "complete", "take in"),
        (executor_module, "build_ragged_batch", "launch: build batch"),
    ]
    if runtime.speculator is not None:
        patches.append((runtime.speculator, "propose", "plan: drafts"))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    graphs.run = counted
    for obj, name, key in patches:
        setattr(obj, name, timed(totals, key, getattr(obj, name)))
    try:
        start = time.perf_counter()
        tokens, steps = run(runtime, prompts, args.batch, args.max_tokens)
        elapsed = time.perf_counter() - start
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
        graphs.run = replay
    return dict(
        tokens=tokens,
        steps=steps,
        eager_steps=eager,
        tok_s=tokens / elapsed,
        ms_per_step=1000 * elapsed / steps,
        host_ms_per_step={k: 1000 * v / steps for k, v in sorted(totals.items())},
        speculative=None if runtime.speculator is None else runtime.speculator.snapshot(),
    )


def graph_replays(runtime: Runtime) -> dict[int, float]:
    """Device milliseconds of one replay of each captured graph."""
    graphs = runtime.executor.runner.graphs
    out = {}
    for bucket in graphs.buckets:
        graph, _ = graphs._graphs[bucket]
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        out[bucket] = start.elapsed_time(end) / 50
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    checkpoint = open_checkpoint(args.model)
    prompts = [checkpoint.tokenizer.encode(p) for p in REPETITIVE] * (args.repeats * args.batch)
    results = {}
    for name, spec in (("plain", None), ("speculative", SpeculativeConfig(args.k))):
        config = DeploymentOptions(
            device="cuda",
            max_batch_size=args.batch,
            max_model_len=1024,
            enable_context_reuse=False,
            speculative_config=spec,
        )
        runtime = Runtime(checkpoint, config)
        results[name] = phases(runtime, prompts, args)
        results[name]["graph_replay_ms"] = graph_replays(runtime)
        r = results[name]
        print(
            f"{name}: {r['tokens']} tokens in {r['steps']} steps ({r['eager_steps']} eager), "
            f"{r['tok_s']:.0f} tok/s, {r['ms_per_step']:.3f} ms a step",
            flush=True,
        )
        for key, ms in r["host_ms_per_step"].items():
            print(f"    {key:<22} {ms:.3f} ms a step")
        replays = ", ".join(f"{b}: {ms:.2f}" for b, ms in r["graph_replay_ms"].items())
        print(f"    graph replay ms by bucket: {replays}")
        if r["speculative"]:
            print(f"    {r['speculative']}")
    write_report(
        report_path("spec_step_phases.json"),
        device=torch.cuda.get_device_name(),
        args=vars(args),
        results=results,
    )


if __name__ == "__main__":
    main()
