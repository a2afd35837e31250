"""The JSON record the benchmarks write."""

import json

from inflight.bench.report import write_report


def test_report_is_stamped_and_creates_its_folder(tmp_path):
    path = tmp_path / "out" / "run.json"
    write_report(path, results={"tok_s": 1.5}, where=tmp_path)
    record = json.loads(path.read_text())
    assert record["results"] == {"tok_s": 1.5} and record["where"] == str(tmp_path)
    assert len(record["date"]) == 10 and "cpus" in record["machine"]


def test_online_result_summary_line():
    from inflight.bench.online import LoadResult

    r = LoadResult(0.5, 16, 16, 1024, 40.0, 25.6, 0.41, 0.53, 0.112, 0.412)
    assert r.summary() == (
        "rate  0.50/s     25.6 output tok/s  TTFT p50   0.41s p99   0.53s  "
        "ITL p50    112ms p99    412ms  (16/16 ok)"
    )
