"""`bench/workload_bound.py`: the workload's roofline, the decode steps' bytes and multiply-adds
overlapped and (with --sequential) the linear layers and attention taken in turn."""

import json
import os
import subprocess
import sys


def test_the_sequential_bound_is_never_the_faster_and_both_are_reported(tmp_path):
    command = [
        sys.executable, "bench/workload_bound.py", "--shapes", "llama-3.1-8b", "--sequential",
    ]  # fmt: skip
    run = subprocess.run(
        command, env={**os.environ, "OUT": str(tmp_path)}, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    bounds = json.loads((tmp_path / "workload_bound.json").read_text())["bounds"]
    assert len(bounds) == 8  # 2 dtypes x 2 roofs x overlapped, sequential
    by = {(b["dtype"], b["roof"], b["steps"]): b for b in bounds}
    for dtype, roof, _ in by:
        overlapped, sequential = by[dtype, roof, "overlapped"], by[dtype, roof, "sequential"]
        assert sequential["prefill_s"] == overlapped["prefill_s"]
        # Equal where both parts of every step are bound by bytes; bf16's 256-row steps
        # multiply at the peak.
        assert sequential["decode_s"] >= overlapped["decode_s"]
        if dtype == "bf16":
            assert sequential["output_tok_s"] < overlapped["output_tok_s"]
