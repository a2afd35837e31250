"""The LoRA side path of a linear layer: which tokens run which slot, and each slot's update
y += scale * (x A^T) B^T on its tokens' part of the output, on top of every linear method."""

import pytest
import torch

from inflight.model.kernels.cpu import ops as cpu_ops
from inflight.model.layers.linear import Linear, process_weights_after_loading
from inflight.model.layers.lora import LoRAMapping, LoRASlots
from inflight.model.layers.quantization import (
    Int8LinearMethod,
    PackedLinearMethod,
    Q4LinearMethod,
    TorchLinearMethod,
)

pytestmark = pytest.mark.usefixtures("two_threads")  # their work split, as on two cores

CPU = torch.device("cpu")
METHODS = {
    "torch": TorchLinearMethod,
    "onednn": PackedLinearMethod,
    "int8": Int8LinearMethod,
    "q4": Q4LinearMethod,
}


def test_native_mapping_runs_long_runs_alone_and_names_the_slot_of_every_other_token():
    rows = [(2, 3), (-1, 2), (0, 1), (1, 20), (1, 20), (2, 40), (0, 2), (-1, 1)]
    mapping = LoRAMapping.native(rows)
    assert mapping.num_tokens == 89
    # Adjacent rows of one slot merge into one run (here two short rows into a long one).
    assert mapping.runs == ((1, slice(6, 46)), (2, slice(46, 86)))
    assert mapping.token_slots.tolist() == [2] * 3 + [-1] * 2 + [0] + [-1] * 80 + [0, 0, -1]
    assert mapping.mask is None
    assert LoRAMapping.native([(-1, 5), (1, 32)]) == LoRAMapping(37, ((1, slice(5, 37)),))


def test_indexed_mapping_names_every_tokens_slot():
    mapping = LoRAMapping.indexed([(1, 2), (-1, 1), (0, 1)], CPU)
    assert mapping.num_tokens == 4 and mapping.runs == () and mapping.mask is None
    assert mapping.token_slots.dtype == torch.int32
    assert mapping.token_slots.tolist() == [1, 1, -1, 0]


def test_masked_mapping_is_each_tokens_one_hot_slot():
    mapping = LoRAMapping.masked([(1, 2), (-1, 1), (0, 1)], 3, torch.float32, CPU)
    assert mapping.num_tokens == 4
    assert mapping.mask.tolist() == [[0, 1, 0], [0, 1, 0], [0, 0, 0], [1, 0, 0]]
    with pytest.raises(ValueError, match="LoRA slot 3 does not exist: 3 slots"):
        LoRAMapping.masked([(3, 1)], 3, torch.float32, CPU)


@pytest.mark.parametrize("row", [(0, 0), (-2, 1)])
def test_mapping_refuses_bad_rows(row):
    with pytest.raises(ValueError, match="a row needs a slot >= -1 and tokens >= 1"):
        LoRAMapping.native([(0, 1), row])
    with pytest.raises(ValueError, match="a row needs a slot >= -1 and tokens >= 1"):
        LoRAMapping.masked([(0, 1), row], 2, torch.float32, CPU)


def _factors(gen, rank, in_features, out_features):
    return (
        torch.randn(rank, in_features, generator=gen),
        torch.randn(out_features, rank, generator=gen),
    )


def _mapping(form: str, rows, max_loras: int) -> LoRAMapping:
    if form == "native":
        return LoRAMapping.native(rows)
    return LoRAMapping.masked(rows, max_loras, torch.float32, CPU)


@pytest.mark.parametrize(
    "form, run",
    [("native", 3), ("native", 40), ("masked", 3)],
    ids=["native-short-runs", "native-long-runs", "masked"],
)
@pytest.mark.parametrize("method", METHODS)
def test_each_slot_updates_its_tokens_on_any_method(method, form, run):
    """A fused layer of three parts (96 -> 64 + 32 + 32), slots of rank 8 (every part), rank 3
    (parts 0 and 2) and an empty one; rows of `run` tokens, slot 0's apart (on the native path,
    short runs go through the native kernel, long ones through dense matmuls)."""
    gen = torch.Generator().manual_seed(0)
    parts = [64, 32, 32]
    layer = Linear(96, sum(parts), True, METHODS[method]())
    with torch.no_grad():
        layer.weight.normal_(generator=gen)
        layer.bias.normal_(generator=gen)
    process_weights_after_loading(layer)
    layer.lora_slots = LoRASlots(96, parts, max_loras=3, max_rank=8, lib=cpu_ops.library())
    adapters = {
        0: (8, 0.5, [_factors(gen, 8, 96, size) for size in parts]),
        1: (3, 2.0, [_factors(gen, 3, 96, 64), None, _factors(gen, 3, 96, 32)]),
    }
    for slot, (rank, scale, factors) in adapters.items():
        layer.lora_slots.write(slot, factors, rank, scale)
    slots = [0, -1, 1, 0, 2, 0]
    x = torch.randn(len(slots) * run, 96, generator=gen)
    base = layer(x)
    got = layer(x, _mapping(form, [(s, run) for s in slots], 3))
    for i, slot in enumerate(slots):
        rows = slice(run * i, run * i + run)
        if slot not in adapters:
            assert torch.equal(got[rows], base[rows])
            continue
        _, scale, factors = adapters[slot]
        update = torch.cat(
            [
                torch.zeros(run, size, dtype=torch.float64)
                if f is None
                else scale * (x[rows].double() @ f[0].double().T) @ f[1].double().T
                for size, f in zip(parts, factors, strict=True)
            ],
            dim=1,
        )
        # float32 rounding (updates reach ~100) against a float64 reference.
        torch.testing.assert_close(got[rows].double(), base[rows] + update, rtol=0, atol=1e-4)


@pytest.mark.parametrize("form", ["native", "masked"])
def test_a_slot_is_rewritten_and_cleared(form):
    gen = torch.Generator().manual_seed(1)
    slots = LoRASlots(16, [8], max_loras=1, max_rank=4, lib=cpu_ops.library())
    x = torch.randn(2, 16, generator=gen)
    mapping = _mapping(form, [(0, 2)], 1)
    small = _factors(gen, 2, 16, 8)
    slots.write(0, [_factors(gen, 4, 16, 8)], 4, 1.0)
    slots.write(0, [small], 2, 1.0)  # what rank 4 left beyond rank 2 is never read
    y = torch.zeros(2, 8)
    slots.add(y, x, mapping)
    torch.testing.assert_close(y, (x @ small[0].T) @ small[1].T)
    slots.clear(0)
    slots.add(y := torch.zeros(2, 8), x, mapping)
    assert not y.any()


def test_write_refuses_factors_of_another_shape():
    slots = LoRASlots(16, [8, 4], max_loras=1, max_rank=4)
    with pytest.raises(ValueError, match=r"\(2, 16\), \(8, 2\) do not fit a part of 16 -> 4"):
        slots.write(0, [None, (torch.zeros(2, 16), torch.zeros(8, 2))], 2, 1.0)


def test_a_native_mapping_needs_the_native_ops():
    slots = LoRASlots(16, [8], max_loras=1, max_rank=4)
    with pytest.raises(ValueError, match="a native LoRA mapping needs the native CPU ops"):
        slots.add(torch.zeros(2, 8), torch.zeros(2, 16), LoRAMapping.native([(0, 2)]))
