"""CPU kernels written in C, built with gcc on first use and loaded with ctypes.

No torch headers are involved, so a build takes about a second; the shared object is cached
(`kernels/build.py`).

Every kernel runs on AVX2 + FMA. A kernel with code for a wider instruction set (the quantized
matmuls' VNNI dot products: int8, 4-bit, Q5_K / Q6_K) is built as the best `Variant` this CPU
has, chosen at run time from /proc/cpuinfo; `INFLIGHT_CPU_ISA` names a lower one to use instead
(`avx2` on any machine), and the variants give the same bits.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from inflight.model.kernels.build import KernelBuildError, cached_library

log = logging.getLogger(__name__)

# -ffp-contract=off: results that must be bit-identical across batch sizes rely on the float
# ops the source spells out, not on what the compiler fuses in each inlined copy of a loop.
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")


ISA_ENV = "INFLIGHT_CPU_ISA"


@dataclass(frozen=True)
class Variant:
    """An instruction set a kernel can be built for: the compiler flags it adds to FLAGS and the
    /proc/cpuinfo flags a CPU needs to run it."""

    name: str
    flags: tuple[str, ...] = ()
    needs: frozenset[str] = frozenset()


# Best first.
VARIANTS = (
    Variant(
        "avx512-vnni",
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
        frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}),
    ),
    Variant("avx-vnni", ("-mavxvnni",), frozenset({"avx_vnni"})),
    Variant("avx2"),
)


class NativeBuildError(KernelBuildError):
    """A kernel could not be built or loaded here (no gcc, no source, an unsuited CPU, a failed
    compile or load); callers fall back to torch's ops or refuse an explicit request for it."""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's flags as /proc/cpuinfo lists them (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def check_cpu(what: str) -> None:
    """Raise NativeBuildError unless this CPU has AVX2 and FMA (what the kernels are compiled
    for)."""
    flags = cpu_flags()
    # No /proc/cpuinfo (not Linux): fall back on what PyTorch dispatches to.
    if not flags and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        return
    missing = [f for f in ("avx2", "fma") if f not in flags]
    if missing:
        raise NativeBuildError(f"running {what} needs a CPU with {' and '.join(missing).upper()}")


def runnable_variants() -> list[Variant]:
    """The variants this CPU can run, best first (AVX2 always: `check_cpu` guards it)."""
    flags = cpu_flags()
    return [v for v in VARIANTS if v.needs <= flags]


def chosen_variant() -> Variant:
    """The best variant this CPU runs, or the one $INFLIGHT_CPU_ISA names (a ValueError naming
    the choices where it is unknown or needs what this CPU lacks)."""
    forced = os.environ.get(ISA_ENV)
    if not forced:
        return runnable_variants()[0]
    by_name = {v.name: v for v in VARIANTS}
    if forced not in by_name:
        raise ValueError(f"{ISA_ENV}={forced!r} is none of {', '.join(by_name)}")
    variant = by_name[forced]
    missing = sorted(variant.needs - cpu_flags())
    if missing:
        raise ValueError(
            f"{ISA_ENV}={forced!r} needs CPU flags this CPU lacks ({', '.join(missing)}); it "
            f"runs {', '.join(v.name for v in runnable_variants())}"
        )
    return variant


_warned = False


def build(source: Path, what: str, variant: Variant | None = None) -> ctypes.CDLL:
    """The compiled library of `source` (for `variant`: its flags added), built now unless
    cached; NativeBuildError when that fails for any reason. The first failure in a process is
    logged as a warning (the native kernels share their causes of failure: one warning says it
    all), later ones at debug level."""
    global _warned
    try:
        return _build(source, what, () if variant is None else variant.flags)
    except (OSError, subprocess.SubprocessError, NativeBuildError) as exc:
        error = exc if isinstance(exc, NativeBuildError) else NativeBuildError(f"{what}: {exc}")
        (log.debug if _warned else log.warning)(
            "native CPU kernels unavailable (%s); falling back to torch's ops", error
        )
        _warned = True
        raise error from exc


def _build(source: Path, what: str, extra: tuple[str, ...]) -> ctypes.CDLL:
    check_cpu(what)
    try:
        return ctypes.CDLL(str(cached_library(source, "gcc", (*FLAGS, *extra), what)))
    except KernelBuildError as exc:
        raise NativeBuildError(str(exc)) from exc
