"""`bench/gguf_twin.py`: a file's twin rebuilt from its header has the file's tensors, in their
stored types, with zero-mean weights of a trained model's spread (not all of one sign, which
made softmax underflow into denormals on an Intel CPU and the twin run slower than the file)."""

import subprocess
import sys

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

QUANTIZED = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K)


def _source(path) -> None:
    """A small GGUF with one tensor of each type (K-quants as raw blocks of arbitrary bytes)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    rng = np.random.default_rng(1)
    writer.add_tensor("blk.0.attn_norm.weight", rng.normal(0, 1, 256).astype(np.float32))
    writer.add_tensor("blk.0.proj.weight", rng.normal(0, 1, (4, 256)).astype(np.float32))
    for kind in QUANTIZED:
        name = f"blk.0.{kind.name.lower()}.weight"
        if kind in (Q.Q4_K, Q.Q6_K):
            blocks = rng.integers(0, 256, (8, 2 * gguf.GGML_QUANT_SIZES[kind][1]), dtype=np.uint8)
            blocks[:, :] &= 0x3F  # small scales, no NaN or inf among the float16 fields
        else:
            blocks = gguf.quants.quantize(rng.normal(0, 1, (8, 512)).astype(np.float32), kind)
        writer.add_tensor(name, blocks, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _run(*args) -> None:
    subprocess.run([sys.executable, "bench/gguf_twin.py", *map(str, args)], check=True)


def test_the_twin_has_the_files_tensors_with_zero_mean_weights(tmp_path):
    source, header, twin = tmp_path / "src.gguf", tmp_path / "src.header", tmp_path / "twin.gguf"
    _source(source)
    _run("header", source, header)
    assert header.stat().st_size < source.stat().st_size
    _run("fill", header, twin)
    original, copy = gguf.GGUFReader(source), gguf.GGUFReader(twin)
    assert twin.stat().st_size == source.stat().st_size
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in copy.tensors] == [
        (t.name, t.tensor_type, list(t.shape), t.data_offset) for t in original.tensors
    ]
    tensors = {t.name: t for t in copy.tensors}
    assert np.all(tensors["blk.0.attn_norm.weight"].data == 1.0)
    for name in ["blk.0.proj.weight", *(f"blk.0.{k.name.lower()}.weight" for k in QUANTIZED)]:
        t = tensors[name]
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        assert np.isfinite(w).all(), name
        assert 0.015 < w.std() < 0.025, (name, w.std())
        assert abs(w.mean()) < 0.2 * w.std(), (name, w.mean())
