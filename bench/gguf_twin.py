"""A random-weight twin of a GGUF file, rebuilt from the file's header alone.

The default model (98 MB) cannot travel to the device machine, but its header (metadata,
tokenizer, tensor names, types and shapes: ~1.8 MB) can. `header` cuts a file's header off, with
a JSON note of how many data bytes follow it; `fill` writes the twin: that header, then every
tensor in its own stored type, random: weights drawn zero-mean (normal, std 0.02) and quantized
to the type, norms ones. Same tensors, same types, same tokenizer: the same work for any engine,
so speed measured on the twin is the file's speed (on this project's AMD box the default
model's short chats ran 151.7 tok/s on the file, 152.2 on its twin).

    .venv/bin/python bench/gguf_twin.py header SRC.gguf OUT.header
    python3 bench/gguf_twin.py fill OUT.header TWIN.gguf
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

STD = 0.02  # of every random weight, as a trained model's are about

# K-quants, which `gguf.quants` cannot quantize: random blocks (random quants and 6-bit
# sub-scales) whose float16 super-block fields (byte offset in the block, value) make the
# weights zero-mean with a standard deviation of about STD (measured by dequantizing). Weights
# all of one sign would blow the activations up until softmax underflows: denormal floats,
# which cost an Intel core far more than an AMD one, so the twin would not run as the file.
K_QUANT_SCALES = {
    Q.Q2_K: ((80, 1.44e-3), (82, 1.5 * 1.44e-3)),
    Q.Q3_K: ((108, 4.61e-4),),
    Q.Q4_K: ((0, 7.77e-5), (2, 7.5 * 7.77e-5)),
    Q.Q5_K: ((0, 3.78e-5), (2, 15.5 * 3.78e-5)),
    Q.Q6_K: ((208, 1.46e-5),),
}


def cut_header(source: Path, out: Path) -> None:
    reader = gguf.GGUFReader(source)
    data_bytes = source.stat().st_size - reader.data_offset
    with source.open("rb") as f:
        out.write_bytes(f.read(reader.data_offset))
    note = {"source": source.name, "data_bytes": data_bytes, "tensors": len(reader.tensors)}
    out.with_suffix(out.suffix + ".json").write_text(json.dumps(note))
    print(f"{out}: {reader.data_offset} header bytes, {data_bytes} data bytes to fill")


def _fill_tensor(tensor, rng: np.random.Generator) -> None:
    kind = tensor.tensor_type
    data = tensor.data
    if kind in K_QUANT_SCALES:
        blocks = data.reshape(-1, gguf.GGML_QUANT_SIZES[kind][1])
        blocks[...] = rng.integers(0, 256, blocks.shape, dtype=np.uint8)
        for offset, scale in K_QUANT_SCALES[kind]:
            blocks[:, offset : offset + 2] = np.frombuffer(np.float16(scale).tobytes(), np.uint8)
        return
    rows = int(np.prod(tensor.shape[1:]))  # GGUF shapes list the row length first
    if tensor.name.endswith("norm.weight"):
        values = np.ones((rows, tensor.n_elements // rows), np.float32)
    else:
        values = rng.normal(0.0, STD, (rows, tensor.n_elements // rows)).astype(np.float32)
    if kind == Q.F32:
        data[...] = values.reshape(data.shape)
    elif kind == Q.F16:
        data[...] = values.astype(np.float16).reshape(data.shape)
    else:
        try:
            quantized = gguf.quants.quantize(values, kind)
        except NotImplementedError:
            raise ValueError(f"{tensor.name}: cannot write random {kind.name} blocks") from None
        data[...] = quantized.reshape(data.shape)


def fill(header: Path, out: Path) -> None:
    note = json.loads(header.with_suffix(header.suffix + ".json").read_text())
    with out.open("wb") as f:
        f.write(header.read_bytes())
        f.truncate(f.tell() + note["data_bytes"])
    reader = gguf.GGUFReader(out, "r+")
    if len(reader.tensors) != note["tensors"]:
        raise ValueError(f"{out}: {len(reader.tensors)} tensors, the header says {note['tensors']}")
    rng = np.random.default_rng(0)
    for tensor in reader.tensors:
        _fill_tensor(tensor, rng)
    reader.data.flush()
    print(f"{out}: twin of {note['source']}, {len(reader.tensors)} tensors filled")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cut = sub.add_parser("header", help="write a file's header and the size of its data")
    cut.add_argument("source", type=Path)
    cut.add_argument("out", type=Path)
    grow = sub.add_parser("fill", help="write a random-weight twin from a header")
    grow.add_argument("header", type=Path)
    grow.add_argument("out", type=Path)
    args = parser.parse_args()
    if args.command == "header":
        cut_header(args.source, args.out)
    else:
        fill(args.header, args.out)


if __name__ == "__main__":
    main()
