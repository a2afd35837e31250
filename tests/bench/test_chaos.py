"""The chaos and load suite, short: `bench/chaos.py` for 12 seconds against the real server."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BAD_INPUT = {
    "prompt-too-long": "400",
    "body-too-large": "413",
    "malformed-json": "400",
    "wrong-types": "400",
    "unknown-field": "400",
    "huge-max-tokens": "400",
    "invalid-utf8": "400",
}


@pytest.mark.slow
def test_a_short_chaos_run_keeps_every_promise(tmp_path):
    """No 5xx, no hung stream, nothing left in use, counters adding up, a clean exit on
    SIGTERM; bad input refused with its 4xx, and bursts beyond the queue told 429."""
    command = [sys.executable, "bench/chaos.py", "--duration", "12", "--clients", "6"]
    command += ["--burst-every", "4", "--seed", "1"]
    result = subprocess.run(
        command,
        cwd=ROOT,
        env={**os.environ, "OUT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    record = json.loads((tmp_path / "chaos.json").read_text())
    assert record["failures"] == [] and record["server_exit_status"] == 0
    outcomes = record["outcomes"]
    assert outcomes.get("burst: 429", 0) > 0
    assert sum(n for key, n in outcomes.items() if key.startswith("chat-stream: ")) > 0
    for key, count in outcomes.items():
        kind, outcome = key.split(": ")
        if kind in BAD_INPUT:
            assert outcome == BAD_INPUT[kind], (key, count)
        assert outcome not in ("hung", "stream-cut"), (key, count)
    assert record["kv_blocks_used"] == 0 and record["resident_slots_used"] == 0
