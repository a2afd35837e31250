"""The JSON record the benchmarks write."""

import json

from inflight.bench.report import write_report


def test_report_is_stamped_and_creates_its_folder(tmp_path):
    path = tmp_path / "out" / "run.json"
    write_report(path, results={"tok_s": 1.5}, where=tmp_path)
    record = json.loads(path.read_text())
    assert record["results"] == {"tok_s": 1.5} and record["where"] == str(tmp_path)
    assert len(record["date"]) == 10 and "cpus" in record["machine"]
