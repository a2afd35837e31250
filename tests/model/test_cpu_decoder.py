"""The CPU decoder step (kernels/cpu/decoder.c): decode-only steps run every layer in one native
call, and give the Python layers' results bit for bit (hidden states and the KV they store)."""

import random

import pytest
import torch

from inflight.runtime.batch_builder import RowInput, build_ragged_batch
from inflight.runtime.config import RuntimeConfig
from inflight.runtime.runtime import Runtime
from tests.model.test_k_quant import write_k_quant_gguf


def _runner(model, **options):
    config = RuntimeConfig(device="cpu", max_model_len=256, context_cache=False, **options)
    return Runtime(model, config).executor.runner


def _forward(runner, rows, native: bool) -> torch.Tensor:
    runner.model.native_decode = native
    batch = build_ragged_batch(rows, runner.block_size, torch.device("cpu"))
    runner.backend.plan(batch.meta)
    with torch.inference_mode():
        return runner._forward(batch.input_ids, batch.positions, batch.meta)


def _decode_matches_the_layers(runner, vocab: int, lengths=(5, 40, 17, 1)) -> None:
    """Prefill rows of `lengths` (through the layers), then one decode step both ways from the
    same caches: the same hidden states and the same stored keys and values."""
    rng = random.Random(0)
    size, rows, decodes = runner.block_size, [], []
    blocks = list(range(1, 60))
    rng.shuffle(blocks)
    for length in lengths:
        table = [blocks.pop() for _ in range(-(-(length + 1) // size))]
        rows.append(RowInput([rng.randrange(vocab) for _ in range(length)], 0, table, True))
        decodes.append(RowInput([rng.randrange(vocab)], length, table, True))
    _forward(runner, rows, native=True)  # a prefill step: the layers either way
    caches = [tuple(c.clone() for c in kv) for kv in runner.kv_caches]
    native = _forward(runner, decodes, native=True)
    assert runner.model._decoder[1] is not None, "the decoder step did not run"
    native_caches = [tuple(c.clone() for c in kv) for kv in runner.kv_caches]
    for kv, saved in zip(runner.kv_caches, caches, strict=True):
        for cache, copy in zip(kv, saved, strict=True):
            cache.copy_(copy)
    layers = _forward(runner, decodes, native=False)
    assert torch.equal(native, layers)
    for a, b in zip(native_caches, runner.kv_caches, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    # Each row alone gets the bits it got in the batch.
    for i, row in enumerate(decodes):
        assert torch.equal(_forward(runner, [row], native=True)[0], native[i])


def test_the_default_model_decodes_as_its_layers_do():
    runner = _runner(None)  # Q4_1 decoder layers in the 4-bit kernel
    _decode_matches_the_layers(runner, runner.model.config.vocab_size)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_int8_layers_with_biases_and_q_k_norms(tiny_dirs, family):
    runner = _runner(tiny_dirs[family], quantization="int8")
    assert runner.model.config.qkv_bias == (family == "qwen2")
    assert runner.model.config.qk_norm == (family == "qwen3")
    _decode_matches_the_layers(runner, runner.model.config.vocab_size)


def test_k_quant_layers_of_mixed_kernels(tmp_path):
    # Layer 0's q/k are Q4_K (the 4-bit kernel), its v Q6_K (k8): two parts; layer 1's o Q5_K.
    runner = _runner(str(write_k_quant_gguf(tmp_path)))
    layers = runner.model.layers
    assert [len(layer.self_attn.qkv_proj.prepared) for layer in layers] == [2, 1]
    _decode_matches_the_layers(runner, runner.model.config.vocab_size)


def test_models_it_cannot_run_keep_their_layers(tiny_dirs):
    # Float weights (no native matmul), the torch attention backend.
    for model, options in (
        (tiny_dirs["llama"], {"quantization": "none"}),
        (tiny_dirs["llama"], {"quantization": "int8", "attention_backend": "torch"}),
    ):
        runner = _runner(model, **options)
        rows = [RowInput([3, 4, 5], 0, [1], True)]
        _forward(runner, rows, native=True)
        _forward(runner, [RowInput([6], 3, [1], True)], native=True)
        assert runner.model._decoder is not None and runner.model._decoder[1] is None
