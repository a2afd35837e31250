"""Where a decode step's time goes on the GPU machine: host Python against device time.

Seats `--batch` residents of random prompts on a random-weight model, runs their prefill, then
profiles `--steps` decode steps with cProfile (host) and times the forward alone with CUDA
events (device), then the device's idle time between kernels inside a forward (a graph replay)
and a whole step.

    python3 bench/gpu_profile.py [--shape qwen3-0.6b] [--batch 256] [--prompt 512]
        [--kv-cache-dtype fp8] [--quantization fp8] [--trace DIR]

`--trace DIR` writes the whole decode steps' trace, host calls included, to DIR/steps.json.gz
(chrome://tracing or Perfetto reads it).
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import io
import itertools
import json
import pstats
import random
import tempfile
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from inflight.bench.random_model import random_checkpoint
from inflight.model.layers.mamba import MambaRows
from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.runtime.device.batch_builder import RowInput, build_ragged_batch
from inflight.runtime.runtime import Runtime

# Prompts admitted beside the decoding batch for the profile of a mixed step (a prefill of
# MIXED_PROMPTS x --prompt tokens with every resident's decode row, as the workload's first steps).
MIXED_PROMPTS = 16
T = TypeVar("T")


def kernel_table(run: Callable[[], T]) -> tuple[T, str]:
    """Run `run()` under the profiler: its result, and the device kernels it ran by total time
    (also gpu_timeline.py's)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = run()
        torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=20, max_name_column_width=70
    )
    return result, table


def kernel_gaps(
    run: Callable[[], object],
    repeats: int = 5,
    apart: bool = False,
    last: str | None = None,
    trace: Path | None = None,
) -> str:
    """Run `run()` `repeats` times under the profiler and describe the middle run's device
    timeline (`timeline_gaps`). `apart`: the device finishes each run before the next is
    queued (graph replays queue back to back, with no gap wider than those inside one to tell
    them apart by; steps must not be, the next one's host work overlaps this one's forward:
    they are told apart by `last`, a name their last event holds).
    With `trace`, the host's calls are recorded too and the whole trace written there (gzipped
    chrome trace JSON)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if trace else [])
    torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            run()
            if apart:
                torch.cuda.synchronize()
                time.sleep(0.002)
    with tempfile.NamedTemporaryFile(suffix=".json") as file:
        prof.export_chrome_trace(file.name)
        text = Path(file.name).read_text()
    if trace is not None:
        trace.write_bytes(gzip.compress(text.encode()))
    return timeline_gaps(json.loads(text)["traceEvents"], repeats, last)


def timeline_gaps(events: list[dict], repeats: int, last: str | None = None) -> str:
    """Of a trace's device events (`ts`, `dur` in us) from `repeats` runs one after another: the
    middle run's kernels, their summed time against the span from the first's start to the
    last's end (the difference: the device idle between kernels, inside a graph too), and the
    pairs of kernels whose gaps add up to most. `last`: a name each run's last event holds
    (runs queued back to back are told apart by it); else the runs are told apart by the
    widest gaps between events (the host's waits between runs timed apart)."""
    kernels = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
        key=lambda e: e["ts"],
    )
    if last is not None:
        cuts = [i for i, e in enumerate(kernels) if last in e["name"]][:-1]
    else:
        gaps = [b["ts"] - a["ts"] - a["dur"] for a, b in itertools.pairwise(kernels)]
        cuts = sorted(sorted(range(len(gaps)), key=gaps.__getitem__)[len(gaps) - repeats + 1 :])
    bounds = [0, *(c + 1 for c in cuts), len(kernels)]
    run_kernels = kernels[bounds[repeats // 2] : bounds[repeats // 2 + 1]]
    span = run_kernels[-1]["ts"] + run_kernels[-1]["dur"] - run_kernels[0]["ts"]
    busy = sum(k["dur"] for k in run_kernels)
    by_pair: defaultdict[tuple[str, str], list[float]] = defaultdict(list)
    for a, b in itertools.pairwise(run_kernels):
        by_pair[a["name"][:45], b["name"][:45]].append(b["ts"] - a["ts"] - a["dur"])
    lines = [
        f"{len(run_kernels)} kernels, span {span / 1000:.3f} ms, kernels {busy / 1000:.3f} ms, "
        f"between them {(span - busy) / 1000:.3f} ms ({(span - busy) / len(run_kernels):.2f} us "
        "a kernel)"
    ]
    for (a, b), pair_gaps in sorted(by_pair.items(), key=lambda kv: -sum(kv[1]))[:12]:
        lines.append(
            f"  {sum(pair_gaps):8.1f} us over {len(pair_gaps):4d} gaps "
            f"({sum(pair_gaps) / len(pair_gaps):5.2f} each): {a} -> {b}"
        )
    # The widest single gaps, where in the run they fall (a step's prelude, its graph, its end).
    start = run_kernels[0]["ts"]
    single = [
        (b["ts"] - a["ts"] - a["dur"], i, a, b)
        for i, (a, b) in enumerate(itertools.pairwise(run_kernels))
    ]
    lines.append("  widest gaps:")
    for gap, i, a, b in sorted(single, key=lambda g: -g[0])[:8]:
        lines.append(
            f"  {gap:8.1f} us after kernel {i + 1} of {len(run_kernels)} "
            f"(at {(b['ts'] - start) / 1000:.3f} ms): {a['name'][:45]} -> {b['name'][:45]}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--quantization", default="none", choices=["none", "fp8"])
    parser.add_argument(
        "--trace", type=Path, default=None, help="a folder for the decode steps' chrome trace"
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    runtime = Runtime(
        random_checkpoint(args.shape, device),
        DeploymentOptions(
            device="cuda",
            max_batch_size=args.batch + 2 * MIXED_PROMPTS,
            max_model_len=args.prompt + 1000 + 16,
            max_num_tokens=16384,
            kv_cache_dtype=args.kv_cache_dtype,
            quantization=args.quantization,
        ),
    )
    rng = random.Random(0)
    session = runtime.new_session()

    def admit(count: int) -> None:
        for _ in range(count):
            prompt = [rng.randrange(1, 100000) for _ in range(args.prompt)]
            session.admit(
                GenerationRequest(
                    prompt, SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
                )
            )

    admit(args.batch)
    torch.cuda.synchronize()
    start = time.perf_counter()
    while any(r.prefilling for r in runtime.scheduler.residents.values()):
        session.step()
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - start
    print(f"prefill of {args.batch} x {args.prompt} tokens: {prefill_s:.2f} s", flush=True)
    for _ in range(3):
        session.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        session.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - start) / args.steps * 1000
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        session.step()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue()[-6000:])

    # Device time of the forward alone, on rows like the decode steps'.
    residents = list(runtime.scheduler.residents.values())
    rows = [RowInput([0], r.computed, r.kv.blocks, True) for r in residents]
    batch = build_ragged_batch(rows, runtime.blocks.block_size, device)
    runner = runtime.executor.runner
    if runner.recurrent:  # a hybrid's rows read their state slots
        slots = [r.ref.slot for r in residents]
        batch.forward.recurrent = MambaRows.build(slots, [False] * len(rows), device)
    runner.execute(batch)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(10):
        runner.logits(runner.execute(batch))
    end.record()
    torch.cuda.synchronize()
    print(
        f"decode step, whole (host included): {step_ms:.2f} ms at batch {args.batch}, "
        f"{args.batch / step_ms * 1000:.0f} tok/s"
    )
    print(f"forward + LM head only, device time: {begin.elapsed_time(end) / 10:.2f} ms")
    t = time.perf_counter()
    for _ in range(10):
        build_ragged_batch(rows, runtime.blocks.block_size, device)
    print(f"build_ragged_batch: {(time.perf_counter() - t) / 10 * 1000:.2f} ms")
    print(kernel_table(lambda: [runner.logits(runner.execute(batch)) for _ in range(5)])[1])
    print("forward + LM head (a graph replay where captured), the device between kernels:")
    print(kernel_gaps(lambda: runner.logits(runner.execute(batch)), apart=True))
    print("whole decode steps, the device between kernels:")
    # A step ends with its sampled tokens' copy to the host.
    trace = args.trace and args.trace / "steps.json.gz"
    print(kernel_gaps(session.step, last="Memcpy DtoH", trace=trace))
    # Two mixed steps: the host's work for the first (cProfile), the device's for the second.
    admit(MIXED_PROMPTS)
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    session.step()
    profiler.disable()
    print(f"one mixed step, host: {(time.perf_counter() - start) * 1000:.1f} ms (cProfile on)")
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(20)
    print(text.getvalue()[-5000:])
    session.step()
    admit(MIXED_PROMPTS)
    start = time.perf_counter()
    print(f"one mixed step ({MIXED_PROMPTS} x {args.prompt} prompt tokens + the decode rows):")
    print(kernel_table(session.step)[1])
    print(f"mixed step wall time (profiled): {(time.perf_counter() - start) * 1000:.1f} ms")
    # A hidden synchronization makes the host wait for the step in flight: find any.
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            session.step()
        print("steps ran without a device synchronization outside the sampled-token fetch")
    except RuntimeError:
        print("a step synchronized with the device:")
        traceback.print_exc(limit=-6)
    finally:
        torch.cuda.set_sync_debug_mode("default")


if __name__ == "__main__":
    main()
