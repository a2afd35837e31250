"""ctypes binding of fp8_decode.cu: decode attention over a float8 KV cache on the tensor cores.

Built on first use with nvcc for this GPU's architecture (no torch headers: seconds) and cached
(`kernels/build.py`); nvcc is looked for on PATH, then under $CUDA_HOME and /usr/local/cuda.
Where it is missing or fails, `library` returns None once a warning is logged, and the Triton
decode kernel serves the cache instead (the same attention, slower: bench/RESULTS.md).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
from pathlib import Path

import torch

from inflight.model.kernels.build import KernelBuildError, cached_library

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("fp8_decode.cu")
BLOCK_SIZE = 16
HEAD_DIM = 128
GROUPS = (1, 2, 4, 8)  # query heads a KV head, as the kernel is instantiated


def nvcc() -> str:
    """nvcc's path, or its bare name where none is found (the build then says so)."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and os.access(Path(root, "bin", "nvcc"), os.X_OK):
            return str(Path(root, "bin", "nvcc"))
    return "nvcc"


@functools.cache
def library(capability: tuple[int, int]) -> ctypes.CDLL | None:
    """The kernel built for compute capability `capability` (8.0 and up: its `mma.sync`
    shape), or None where it cannot be built or loaded (logged once)."""
    if capability < (8, 0):
        return None
    arch = f"{capability[0]}{capability[1]}"
    flags = (
        "-O3", "--use_fast_math", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-shared",
        "-Xcompiler", "-fPIC",
    )  # fmt: skip
    try:
        lib = ctypes.CDLL(str(cached_library(_SOURCE, nvcc(), flags, "the FP8 decode kernel")))
    except (KernelBuildError, OSError) as exc:
        log.warning("the CUDA FP8 decode kernel is unavailable (%s); Triton's serves instead", exc)
        return None
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.fp8_decode_attention.argtypes = [
        p, p, p, p, p, p, p, p, p, i32, i32, i32, i32, ctypes.c_float, *[i64] * 11, i32, i32, p,
    ]  # fmt: skip
    lib.fp8_decode_attention.restype = i32
    return lib


def serves(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, window: int | None, sinks
) -> bool:
    """Whether the kernel covers this decode: a float8 e4m3 cache of blocks of 16 tokens and
    heads of 128 (as [blocks, block_size, KV heads, head size], the head's bytes contiguous and
    16-byte aligned), bfloat16 queries, 1, 2, 4 or 8 of them a KV head, each head's 128 values
    contiguous and 16-byte aligned (the kernel reads them in 16-byte words), no attention window
    and no sinks."""
    _, block_size, kv_heads, head_dim = k_cache.shape
    return (
        q.is_cuda
        and k_cache.shape == v_cache.shape
        and k_cache.dtype == v_cache.dtype == torch.float8_e4m3fn
        and q.dtype == torch.bfloat16
        and block_size == BLOCK_SIZE
        and head_dim == HEAD_DIM
        and q.shape[1] % kv_heads == 0
        and q.shape[1] // kv_heads in GROUPS
        and not window
        and sinks is None
        and q.stride(2) == 1
        and q.stride(0) % 8 == 0
        and q.stride(1) % 8 == 0
        and q.data_ptr() % 16 == 0
        and all(
            c.stride(3) == 1 and all(s % 16 == 0 for s in c.stride()[:3]) and c.data_ptr() % 16 == 0
            for c in (k_cache, v_cache)
        )
    )


def decode(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    rows: int,
    scale: float,
    splits: int,
    parts: torch.Tensor,
    stats: torch.Tensor,
    order: torch.Tensor | None,
    tma: bool = True,
) -> None:
    """Queue the attention of the first `rows` queries of q over their rows' keys (as
    `serves` requires) on the current stream: into `out` where `splits` is 1, else each row's
    keys in `splits` parts into `parts` and `stats` (float32, contiguous, the Triton decode
    kernel's layout) for its merge kernel. On compute capability 9.0 and later the blocks come
    through the tensor memory accelerator where the cache's layout allows (`tma=False`: read
    straight from the cache, as before Hopper; the same bits)."""
    kv_heads = k_cache.shape[2]
    error = lib.fp8_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        parts.data_ptr(), stats.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
        None if order is None else order.data_ptr(), rows, kv_heads, q.shape[1] // kv_heads,
        splits, scale, q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1), k_cache.shape[0], int(tma),
        torch.cuda.current_stream(q.device).cuda_stream,
    )  # fmt: skip
    if error:
        raise RuntimeError(f"the CUDA FP8 decode kernel failed to launch (cudaError {error})")
