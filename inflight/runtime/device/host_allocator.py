"""glibc malloc's settings for steps on the CPU.

A CPU step allocates and frees the same large buffers every step (activations, logits, the
native kernels' quantized activations). By default glibc hands a block over 128 KiB its own
mmap and trims the heap's top past 128 KiB, raising both thresholds only as it sees such blocks
freed: until it has, every step faults fresh pages in. On a 2-core KVM guest the first two
passes of 16 short chats after a load ran a quarter slower (bench/RESULTS.md, "Short chats on
an AVX-512 box"). Fixed thresholds keep freed memory in the heap for the next step: the process
holds its peak working set instead of returning it between steps.
"""

from __future__ import annotations

import ctypes

# mallopt's parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Blocks up to 32 MiB (glibc's ceiling for this threshold on 64-bit) come from the heap.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Set glibc's thresholds as above; False where the C library has no mallopt (not glibc) or
    refuses them."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
