"""ctypes bindings of cpu_attention.c: the KV store and the paged attention kernel."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from inflight.model.kernels.cpu import native
from inflight.model.metadata import AttentionMetadata, KVCache

_SOURCE = Path(__file__).with_name("cpu_attention.c")


@functools.cache
def library() -> ctypes.CDLL:
    return build(_SOURCE, "the CPU attention kernel")


def build(source: Path, what: str) -> ctypes.CDLL:
    """The kernel compiled from `source` (this tree's, or another's beside it in a benchmark),
    its functions' signatures set."""
    lib = native.build(source, what)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.paged_attention.argtypes = [
        p, i64, i64, p, p, i64, p, i64, p, p, i64, i64, i64, i64, i64, i64, i64,
        ctypes.c_float, p, i64, i64, ctypes.c_int, p,
    ]  # fmt: skip
    lib.paged_attention.restype = ctypes.c_int
    lib.store_kv.argtypes = [p, i64, i64, p, i64, i64, p, p, i64, p, i64, i64, i64]
    lib.store_kv.restype = None
    return lib


def store_kv(
    lib: ctypes.CDLL, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
) -> None:
    """The step's new k, v [T, Hkv, D] into their slots (one copy per token and head)."""
    k_cache, v_cache = kv_cache
    if k.stride(2) != 1 or v.stride(2) != 1 or not k_cache.is_contiguous():
        raise ValueError("store_kv needs unit-stride head dims and contiguous caches")
    slots = meta.slot_mapping.contiguous()
    lib.store_kv(
        k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), slots.data_ptr(),
        k.shape[0], k.shape[1], k.shape[2],
    )  # fmt: skip


def paged_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    kv_cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Attend every row's query tokens of q [T, Hq, D] (decode rows and prefill chunks) into
    out, each token with the bits it would get as a decode row; with a `window`, a token at
    position p over keys p - window + 1 .. p; with `sinks` [Hq] (float32), each head's logit
    joins its softmaxes as one more score."""
    k_cache, v_cache = kv_cache
    if q.dtype != torch.float32 or k_cache.dtype != torch.float32:
        raise ValueError(f"the CPU attention kernel is float32 only, got {q.dtype}")
    if q.stride(2) != 1 or out.stride(2) != 1 or not k_cache.is_contiguous():
        raise ValueError("the CPU attention kernel needs unit-stride head dims")
    kv_heads, _, head_dim = k_cache.shape
    tables = meta.block_tables.contiguous()
    starts = meta.query_start_loc.contiguous()
    seq_lens = meta.seq_lens.contiguous()
    if sinks is not None and (
        sinks.dtype != torch.float32 or sinks.shape != (q.shape[1],) or sinks.stride(0) != 1
    ):
        raise ValueError(
            f"sinks must be float32 [{q.shape[1]}], got {sinks.dtype} {tuple(sinks.shape)}"
        )
    status = lib.paged_attention(
        q.data_ptr(), q.stride(0), q.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
        tables.data_ptr(), tables.stride(0), starts.data_ptr(), seq_lens.data_ptr(),
        len(meta.query_lens_host), q.shape[1], kv_heads, head_dim, meta.block_size,
        meta.max_seq_len, window or 0, scale,
        out.data_ptr(), out.stride(0), out.stride(1), torch.get_num_threads(),
        None if sinks is None else sinks.data_ptr(),
    )  # fmt: skip
    if status == -1:
        raise ValueError(f"the CPU attention kernel needs a head_dim multiple of 8, got {head_dim}")
    if status != 0:
        raise MemoryError("the CPU attention kernel could not allocate its scratch buffers")
