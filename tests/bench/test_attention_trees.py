"""`bench/attention_trees.py`: another tree's attention kernel built beside this one's, both run
on the same steps alternately, their outputs compared bit for bit (here against this tree's own
sources: the same bits)."""

import json
import os
import subprocess
import sys


def test_two_builds_alternate_and_compare_their_bits(tmp_path):
    command = [
        sys.executable, "bench/attention_trees.py", "--against", "inflight/model/kernels/cpu",
        "--rows", "4", "--layers", "2", "--pool-blocks", "64", "--rounds", "3",
    ]  # fmt: skip
    run = subprocess.run(
        command, env={**os.environ, "OUT": str(tmp_path)}, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert "same bits: True" in run.stdout
    record = json.loads((tmp_path / "attention_trees.json").read_text())
    assert record["same_bits"] is True and record["layers"] == 2
    assert record["this"]["best_ms"] > 0 and record["against"]["median_ms"] > 0
