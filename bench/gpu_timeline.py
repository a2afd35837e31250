"""Where the nano-vllm workload's time goes on the GPU: its steps by kind and batch size, each
with its wall time, its device time and the device's idle time before it.

Runs `gpu_throughput.py`'s workload through the engine with the runtime's session step timed
from outside: host clock around each `step`, CUDA events before and after what it queues. A step
whose device time is short of its wall time waited for the host; "idle" is the device's gap
between the end of one step's work and the start of the next's.

    python3 bench/gpu_timeline.py [--shape qwen3-0.6b] [--requests 256] [--quantization fp8]
        [--kv-cache-dtype fp8] [--profile-prefill 3]

Each step with a prefill is listed alone; `--profile-prefill K` also prints the device kernels of
the K-th of them (from 0) by total time, profiled as it runs in the workload.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
from gpu_profile import kernel_table
from gpu_throughput import _submit_all, add_engine_args, ready_engine, workload

from inflight.bench.random_model import SHAPES
from inflight.bench.report import report_path, write_report
from inflight.runtime.device.executor import Executor
from inflight.runtime.host.session import GenerationSession

BUCKETS = (8, 32, 64, 128, 192, 256, 1 << 30)


@dataclass
class StepTime:
    prefill_tokens: int
    decode_rows: int
    wall_s: float
    begin: torch.cuda.Event
    end: torch.cuda.Event


def trace(steps: list[StepTime], profile_prefill: int | None = None) -> list[str]:
    """Time every session step into `steps` (the composition of the step it launches); the
    returned list gets the kernel table of the step after `profile_prefill` prefill steps, once
    it has run (that step's own times then include the profiler's)."""
    launch, step = Executor.launch, GenerationSession.step
    composition: list[tuple[int, int]] = []
    last = [time.perf_counter()]
    tables: list[str] = []
    profiled = [profile_prefill is None]  # one step is profiled, where one is asked for

    def timed_launch(self, scheduled):
        prefill = sum(
            len(r.token_ids) for r in scheduled.rows if r.past_len < len(r.resident.prompt)
        )
        composition.append((prefill, len(scheduled.rows) - sum(
            1 for r in scheduled.rows if r.past_len < len(r.resident.prompt)
        )))  # fmt: skip
        return launch(self, scheduled)

    def timed_step(self, cancelled=()):
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        composition.clear()
        begin.record()
        # Counted only until the profile is taken: no work added to the timed steps after it.
        if not profiled[0] and sum(1 for s in steps if s.prefill_tokens) == profile_prefill:
            profiled[0] = True
            result, table = kernel_table(lambda: step(self, cancelled))
            prefill = bool(composition and composition[0][0])
            kind = f"prefill step {profile_prefill}" if prefill else "the decode step after them"
            tables.append(f"{kind} {composition[:1]}:\n{table}")
        else:
            result = step(self, cancelled)
        end.record()
        now = time.perf_counter()
        if composition:
            prefill, decode = composition[0]
            steps.append(StepTime(prefill, decode, now - last[0], begin, end))
        last[0] = now
        return result

    Executor.launch = timed_launch
    GenerationSession.step = timed_step
    return tables


def summarize(steps: list[StepTime]) -> dict:
    torch.cuda.synchronize()
    groups: dict[str, dict] = {}
    prefills: list[dict] = []
    previous_end = None
    for s in steps:
        device = s.begin.elapsed_time(s.end) / 1000
        idle = 0.0 if previous_end is None else max(0.0, previous_end.elapsed_time(s.begin) / 1000)
        previous_end = s.end
        if s.prefill_tokens:
            prefills.append(
                {
                    "prefill_tokens": s.prefill_tokens,
                    "decode_rows": s.decode_rows,
                    "wall_ms": s.wall_s * 1000,
                    "device_ms": device * 1000,
                }
            )
            key = "prefill+decode"
        else:
            top = next(b for b in BUCKETS if s.decode_rows <= b)
            key = f"decode<={top}" if top < BUCKETS[-1] else "decode"
        g = groups.setdefault(
            key, {"steps": 0, "wall_s": 0.0, "device_s": 0.0, "idle_s": 0.0, "tokens": 0}
        )
        g["steps"] += 1
        g["wall_s"] += s.wall_s
        g["device_s"] += device
        g["idle_s"] += idle
        g["tokens"] += s.prefill_tokens + s.decode_rows
    print(f"{'prefill tokens':>15}{'decode rows':>12}{'wall ms':>9}{'device ms':>10}")
    for p in prefills:
        print(
            f"{p['prefill_tokens']:>15}{p['decode_rows']:>12}{p['wall_ms']:>9.1f}"
            f"{p['device_ms']:>10.1f}"
        )
    print(
        f"{'steps':<16}{'n':>6}{'wall s':>9}{'device s':>10}{'idle s':>9}{'ms/step':>9}"
        f"{'tokens':>9}"
    )
    for key in sorted(groups, key=lambda k: (k != "prefill+decode", len(k), k)):
        g = groups[key]
        print(
            f"{key:<16}{g['steps']:>6}{g['wall_s']:>9.2f}{g['device_s']:>10.2f}"
            f"{g['idle_s']:>9.2f}{g['wall_s'] / g['steps'] * 1000:>9.2f}{g['tokens']:>9}"
        )
    total = {
        k: sum(g[k] for g in groups.values()) for k in ("steps", "wall_s", "device_s", "idle_s")
    }
    print(
        f"{'all':<16}{total['steps']:>6}{total['wall_s']:>9.2f}{total['device_s']:>10.2f}{total['idle_s']:>9.2f}"
    )
    return {"groups": groups, "total": total, "prefill_steps": prefills}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-0.6b")
    add_engine_args(parser)
    parser.add_argument("--profile-prefill", type=int, default=None, metavar="K")
    args = parser.parse_args()
    work = workload(args.requests, SHAPES[args.shape].vocab_size)
    engine = ready_engine(args.shape, work, args)
    steps: list[StepTime] = []
    tables = trace(steps, args.profile_prefill)
    tok_s = _submit_all(engine, work)
    engine.shutdown()
    print(f"{args.shape}: {tok_s:.0f} output tok/s (timed steps; a little slower than untimed)")
    summary = summarize(steps)
    for table in tables:
        print(table)
    write_report(
        report_path("gpu_timeline.json"),
        device=torch.cuda.get_device_name(),
        args=vars(args),
        output_tok_s=tok_s,
        **summary,
    )


if __name__ == "__main__":
    main()
