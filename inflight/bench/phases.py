"""Time a class's step phases in a benchmark: each named method wrapped in a timer (the device
synchronized around it on CUDA, so a phase's time is its own)."""

from __future__ import annotations

import time

import torch


def time_phases(cls: type, names: tuple[str, ...], device: torch.device) -> dict[str, list[float]]:
    """Wrap `cls`'s methods `names` for good; each call's seconds appended to its list."""
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in names:
        method = getattr(cls, name)

        def timed(*args, _method=method, _name=name, **kwargs):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = _method(*args, **kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[_name].append(time.perf_counter() - t0)
            return out

        setattr(cls, name, timed)
    return times
