"""The OpenMP thread pool of the thread that built a runtime, released once it is built.

libgomp gives every thread that opens a parallel region a pool of worker threads of its own and
counts them all: once they outnumber the CPUs, a worker waiting for the next region spins 100
times instead of 300,000 before it sleeps on a futex. Loading the weights (torch's parallel ops
on the building thread) leaves a pool there, and the engine's actor thread, which runs the steps,
opens another: then between the hundreds of parallel regions of a CPU step the actor's worker
falls asleep and is woken each time: a 16-row SmolLM2 forward took 17.3 ms instead of 13.3 on
a 2-core KVM guest (bench/RESULTS.md, "Short chats on an AVX-512 box"). Released, the building
thread's workers exit; a later parallel region there starts new ones.
"""

from __future__ import annotations

import ctypes

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: release the threads, keep nothing else


def release_thread_pool() -> bool:
    """Release the calling thread's OpenMP workers (OpenMP 5's omp_pause_resource_all, which
    libgomp applies to the calling thread's pool); False where libgomp is missing or refuses
    (inside a parallel region)."""
    try:
        pause = ctypes.CDLL("libgomp.so.1").omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    return pause(OMP_PAUSE_SOFT) == 0
