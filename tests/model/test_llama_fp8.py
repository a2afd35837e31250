"""FP8 decoder layers take their inputs quantized by the kernel before them: each norm that
feeds an FP8 projection, and SiLU-mul before down_proj, hands it float8 rows and scales, so
only o_proj's input is quantized by a kernel of its own, and the logits keep their bits. (On
CUDA those are fused kernels; here their CPU compositions, whose bits the fused kernels are
held to in tests/model/test_triton_kernels.py and `bench/gpu_check.py "fp8 linear"`.)"""

import pytest
import torch

from inflight.model.checkpoints.loader import build_model, open_checkpoint
from inflight.model.layers.linear import Fp8Rows, Linear
from inflight.model.layers.quantization import Fp8LinearMethod

from helpers import prefill_logits

IDS = [3, 17, 5, 29, 11, 2, 40, 8, 13]


def _quantized_by_the_layer(model, monkeypatch) -> list[str]:
    """Runs a prefill; the layers whose method quantized its input itself, in call order."""
    names = {id(m): name for name, m in model.named_modules() if isinstance(m, Linear)}
    calls: list[str] = []
    apply = Fp8LinearMethod.apply

    def watched(self, layer, x, bias):
        if not isinstance(x, Fp8Rows):
            calls.append(names[id(layer)].rsplit(".", 1)[-1])
        return apply(self, layer, x, bias)

    monkeypatch.setattr(Fp8LinearMethod, "apply", watched)
    return calls


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_norms_and_silu_quantize_for_their_fp8_layers(tiny_dirs, family, monkeypatch):
    checkpoint = open_checkpoint(tiny_dirs[family])
    model = build_model(checkpoint, torch.float32, torch.device("cpu"), 64, quantization="fp8")
    layers = checkpoint.config.num_layers
    calls = _quantized_by_the_layer(model, monkeypatch)
    fused = prefill_logits(model, IDS)
    assert calls == ["o_proj"] * layers

    calls.clear()
    monkeypatch.setattr(Fp8LinearMethod, "takes_fp8_rows", False)
    plain = prefill_logits(model, IDS)
    assert calls == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] * layers
    assert torch.equal(fused, plain)


def test_layers_with_adapter_slots_take_float_rows(tiny_dirs, monkeypatch):
    checkpoint = open_checkpoint(tiny_dirs["llama"])
    model = build_model(
        checkpoint, torch.float32, torch.device("cpu"), 64, quantization="fp8", max_loras=1
    )
    calls = _quantized_by_the_layer(model, monkeypatch)
    prefill_logits(model, IDS)
    assert (
        calls == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] * checkpoint.config.num_layers
    )
