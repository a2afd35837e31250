"""`bench/decode_attention.py`'s block tables: every block of the cache used once, each row's
blocks at random or (`runs`, as the engine lays out the workload's requests) in one run."""

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from decode_attention import BLOCK_SIZE, block_tables  # noqa: E402


def _rows(lens, table):
    return [table[row, : -(-n // BLOCK_SIZE)].tolist() for row, n in enumerate(lens)]


def test_runs_give_each_row_consecutive_blocks_and_scattered_ones_do_not():
    lens = [random.Random(3).randint(1, 900) for _ in range(40)]
    total = sum(-(-n // BLOCK_SIZE) for n in lens)
    for runs in (False, True):
        rows = _rows(lens, block_tables(lens, runs))
        assert sorted(b for row in rows for b in row) == list(range(total))
        consecutive = [row == list(range(row[0], row[0] + len(row))) for row in rows]
        if runs:
            assert all(consecutive)
            assert [row[0] for row in rows] != sorted(row[0] for row in rows)  # runs shuffled
        else:
            assert not all(consecutive)
