"""`bench/gpu_profile.py`'s reading of a device trace: runs told apart, idle time between
kernels summed, the costliest pairs named."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from gpu_profile import timeline_gaps  # noqa: E402


def _kernel(name, ts, dur):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_the_middle_run_is_read_and_its_gaps_summed_by_pair():
    events = [{"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 10_000}]
    for run in range(3):
        at = run * 1000.0
        # norm 10 us, gap 2, gemm 50, gap 3, norm 10, gap 2, gemm 50
        events += [
            _kernel("norm", at, 10),
            _kernel("gemm", at + 12, 50),
            _kernel("norm", at + 65, 10),
            _kernel("gemm", at + 77, 50),
        ]
    text = timeline_gaps(events, 3)
    first, *pairs = text.splitlines()
    assert first == (
        "4 kernels, span 0.127 ms, kernels 0.120 ms, between them 0.007 ms (1.75 us a kernel)"
    )
    assert "4.0 us over    2 gaps ( 2.00 each): norm -> gemm" in pairs[0]
    assert "3.0 us over    1 gaps ( 3.00 each): gemm -> norm" in pairs[1]
    widest = pairs[pairs.index("  widest gaps:") + 1]
    assert "3.0 us after kernel 2 of 4 (at 0.065 ms): gemm -> norm" in widest


def test_runs_back_to_back_are_told_apart_by_their_last_event():
    events = []
    for run in range(3):
        at = run * 100.0  # no gap between runs wider than those inside one
        events += [
            _kernel("copy in", at, 10),
            _kernel("gemm", at + 30, 50),
            {"cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": at + 90, "dur": 10},
        ]
    first = timeline_gaps(events, 3, last="Memcpy DtoH").splitlines()[0]
    assert first == (
        "3 kernels, span 0.100 ms, kernels 0.070 ms, between them 0.030 ms (10.00 us a kernel)"
    )
