"""The CUDA FP8 decode kernel's build and the cases it takes (its numerics run on a GPU only:
bench/gpu_check.py "fp8 decode CUDA kernel"), and the cached build every native kernel shares."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import pytest
import torch

from inflight.model.kernels import build
from inflight.model.kernels.cuda import fp8_decode


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    fp8_decode.library.cache_clear()
    yield tmp_path / "inflight"
    fp8_decode.library.cache_clear()


def test_the_kernel_builds_with_nvcc_for_each_architecture_it_serves(cache):
    for capability in ((8, 0), (8, 9), (9, 0)):
        lib = fp8_decode.library(capability)
        assert lib is not None and isinstance(lib.fp8_decode_attention, ctypes._CFuncPtr)
    assert len(list(cache.glob("fp8_decode-*.so"))) == 3


def test_no_kernel_before_the_tensor_cores_it_needs_nor_without_nvcc(cache, monkeypatch, caplog):
    assert fp8_decode.library((7, 5)) is None
    monkeypatch.setattr(fp8_decode, "nvcc", lambda: "no-such-nvcc")
    with caplog.at_level(logging.WARNING):
        assert fp8_decode.library((9, 0)) is None
    assert "no-such-nvcc" in caplog.text and "Triton's serves instead" in caplog.text


class _Cuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: `serves` reads only shapes, dtypes and strides."""

    @property
    def is_cuda(self) -> bool:
        return True


def _case(heads=16, kv_heads=8, dim=128, block_size=16, q_dtype=torch.bfloat16, fp8=True):
    q = torch.zeros(4, heads, dim, dtype=q_dtype).as_subclass(_Cuda)
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    cache = torch.zeros(8, block_size, kv_heads, dim, dtype=dtype)
    return q, cache, cache.clone()


def test_it_serves_a_float8_cache_of_16_token_blocks_and_128_wide_heads_without_windows():
    q, k, v = _case()
    assert fp8_decode.serves(q, k, v, None, None)
    for group in (1, 2, 4, 8):
        assert fp8_decode.serves(*_case(heads=8 * group), None, None)
    assert not fp8_decode.serves(q, k, v, 128, None)  # a window
    assert not fp8_decode.serves(q, k, v, None, torch.zeros(16))  # sinks
    assert not fp8_decode.serves(*_case(heads=48), None, None)  # 6 heads a KV head
    assert not fp8_decode.serves(*_case(dim=64), None, None)
    assert not fp8_decode.serves(*_case(block_size=32), None, None)
    assert not fp8_decode.serves(*_case(q_dtype=torch.float16), None, None)
    assert not fp8_decode.serves(*_case(fp8=False), None, None)
    assert not fp8_decode.serves(q.as_subclass(torch.Tensor), k, v, None, None)  # on the CPU
    assert not fp8_decode.serves(q, k, v[:4], None, None)  # keys and values of other caches
    # Queries whose heads are not 16-byte aligned: the kernel reads them in 16-byte words.
    flat = torch.zeros(4 * 16 * 136 + 8, dtype=torch.bfloat16).as_subclass(_Cuda)
    assert fp8_decode.serves(flat.as_strided((4, 16, 128), (16 * 136, 136, 1), 8), k, v, None, None)
    for strides, offset in (((16 * 132, 132, 1), 0), ((16 * 128 + 4, 128, 1), 0), (q.stride(), 4)):
        misaligned = flat.as_strided((4, 16, 128), strides, offset)
        assert not fp8_decode.serves(misaligned, k, v, None, None), (strides, offset)
    # A view whose heads are not 16-byte aligned rows of the cache.
    wide = torch.zeros(8, 16, 8, 136, dtype=torch.float8_e4m3fn)[..., :128]
    assert not fp8_decode.serves(q, wide, wide, None, None)


def test_a_cached_library_is_built_once_and_a_failed_build_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    source = tmp_path / "k.c"
    source.write_text("int answer(void) { return 42; }\n")
    flags = ("-O2", "-shared", "-fPIC")
    path = build.cached_library(source, "gcc", flags, "a test kernel")
    assert ctypes.CDLL(str(path)).answer() == 42
    # Cached: found again without a compiler.
    assert build.cached_library(source, "no-such-compiler", flags, "a test kernel") == path
    with pytest.raises(build.KernelBuildError, match="needs no-such-compiler"):
        build.cached_library(source, "no-such-compiler", ("-O1", *flags), "a test kernel")
    source.write_text("int answer(void) { return }\n")
    with pytest.raises(build.KernelBuildError, match="building k.c failed"):
        build.cached_library(source, "gcc", flags, "a test kernel")
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no partial file left
