"""The JSON record every benchmark writes beside the figures it prints."""

from __future__ import annotations

import json
import os
import platform
from datetime import date
from pathlib import Path
from typing import Any


def report_path(name: str) -> Path:
    """Where a benchmark writes its record `name`: under $OUT (the device's output folder) or
    bench/out."""
    return Path(os.environ.get("OUT", "bench/out")) / name


def write_report(path: str | Path, **fields: Any) -> None:
    """Write `fields` as JSON to `path`, stamped with today's date and this machine."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "date": date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus",
        **fields,
    }
    path.write_text(json.dumps(record, indent=2, default=str))
