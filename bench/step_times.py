"""`bench/gpu_throughput.py` with every session step timed: how many decode-only steps and
steps with prefill the workload took, and their mean time, beside its throughput.

    python3 bench/step_times.py [gpu_throughput.py's arguments]
"""

from __future__ import annotations

import runpy
import sys
import time
from collections import defaultdict
from pathlib import Path

from inflight.runtime.host.session import GenerationSession

_stats: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])
_step = GenerationSession.step


def _timed_step(self: GenerationSession, *args, **kwargs):
    start = time.perf_counter()
    result = _step(self, *args, **kwargs)
    elapsed = time.perf_counter() - start
    residents = self._scheduler.residents.values()
    kind = "with prefill" if any(r.prefilling for r in residents) else "decode-only"
    stats = _stats[kind]
    stats[0] += 1
    stats[1] += elapsed
    stats[2] += len(residents)
    return result


def main() -> None:
    GenerationSession.step = _timed_step
    script = Path(__file__).with_name("gpu_throughput.py")
    sys.argv = [str(script), *sys.argv[1:]]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        for kind, (steps, seconds, residents) in sorted(_stats.items()):
            print(
                f"{kind}: {steps} steps, {seconds:.3f} s, {seconds / max(steps, 1) * 1000:.2f} "
                f"ms a step, {residents / max(steps, 1):.1f} residents a step"
            )


if __name__ == "__main__":
    main()
