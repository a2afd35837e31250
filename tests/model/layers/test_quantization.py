"""The linear methods, each running its kernel's arithmetic exactly from the float weight a
checkpoint loads, and the choice of a method for each layer."""

import pytest
import torch
import torch.nn.functional as F

from inflight.model.kernels.cpu.int8 import QuantizedWeight, int8_linear, quantize_weight
from inflight.model.kernels.cpu.q4 import Q4Weight, q4_linear, quantize_q4
from inflight.model.layers.linear import Fp8Rows, Linear, process_weights_after_loading
from inflight.model.layers.platform import Platform
from inflight.model.layers.quantization import (
    FP8_MAX,
    Fp8LinearMethod,
    Int8LinearMethod,
    InvariantLinearMethod,
    LinearMethod,
    LinearMethods,
    PackedLinearMethod,
    Q4LinearMethod,
    TorchLinearMethod,
    fp8_rows,
    unquantized_method,
)

from helpers import torch_threads

CPU = torch.device("cpu")


def _loaded(method: LinearMethod, weight: torch.Tensor, bias: torch.Tensor) -> Linear:
    layer = Linear(weight.shape[1], weight.shape[0], True, method)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    process_weights_after_loading(layer)
    return layer


@pytest.fixture
def operands():
    torch.manual_seed(0)
    return torch.randn(5, 96), torch.randn(40, 96), torch.randn(40)


def test_torch_method_runs_the_weight_as_loaded(operands):
    x, weight, bias = operands
    layer = _loaded(TorchLinearMethod(), weight, bias)
    assert torch.equal(layer.weight, weight) and layer.prepared is None
    assert torch.equal(layer(x), F.linear(x, weight, bias))


def test_packed_method_runs_the_onednn_layout(operands):
    x, weight, bias = operands
    layer = _loaded(PackedLinearMethod(), weight, bias)
    assert layer.weight is None and "weight" not in dict(layer.named_parameters())
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    want = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    # Under inference mode, as the runtime runs it: with autograd on (the bias a Parameter)
    # oneDNN may add the bias apart from the matmul, an ulp away on some CPUs.
    with torch.inference_mode():
        assert torch.equal(layer(x), want)
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_packed_method_gives_a_row_alone_the_bits_it_gets_beside_others(threads):
    """A decode at batch 1, or the one new token after a cached prefix, against the same row in a
    batch or a whole prompt. K past 1024: where oneDNN on AVX-512 ran a lone row in a kernel of
    its own, whose sums came out some ulps away."""
    torch.manual_seed(0)
    x, weight, bias = torch.randn(6, 1536), torch.randn(64, 1536), torch.randn(64)
    layer = _loaded(PackedLinearMethod(), weight, bias)
    with torch_threads(threads), torch.inference_mode():
        batch = layer(x)
        for i in range(len(x)):
            assert torch.equal(layer(x[i : i + 1]), batch[i : i + 1])
        alone = layer(x[:1].view(1, 1, -1))
    assert alone.shape == (1, 1, 64) and torch.equal(alone[0], batch[:1])


@pytest.mark.parametrize(
    ("method", "quantize", "linear", "form"),
    [
        (Int8LinearMethod, quantize_weight, int8_linear, QuantizedWeight),
        (Q4LinearMethod, quantize_q4, q4_linear, Q4Weight),
    ],
)
def test_quantized_methods_run_their_kernel(operands, method, quantize, linear, form):
    x, weight, bias = operands
    layer = _loaded(method(), weight, bias)
    assert layer.weight is None and isinstance(layer.prepared, form)
    assert torch.equal(layer(x), linear(x, quantize(weight), bias))


def test_unquantized_method_by_platform():
    assert isinstance(unquantized_method(Platform.detect(CPU, torch.float32)), PackedLinearMethod)
    assert isinstance(unquantized_method(Platform.detect(CPU, torch.bfloat16)), TorchLinearMethod)


FLOAT, INT8, Q4, FP8, BLOCKS = (LinearMethod() for _ in range(5))
KERNELS = {"int8": INT8, "q4": Q4, "blocks": BLOCKS}


def test_explicit_modes():
    none = LinearMethods(FLOAT)
    assert none.choose(64, ["a.weight"]) is FLOAT
    assert none.choose(64, ["lm_head.weight"], head=True) is FLOAT
    int8 = LinearMethods(FLOAT, "int8", KERNELS)
    assert int8.choose(64, ["a.weight"]) is INT8
    assert int8.choose(64, ["lm_head.weight"], head=True) is INT8
    assert int8.choose(48, ["a.weight"]) is FLOAT  # K not a multiple of 32
    q4 = LinearMethods(FLOAT, "q4", KERNELS)
    assert q4.choose(64, ["a.weight", "b.weight"]) is Q4
    assert q4.choose(64, ["embed_tokens.weight"], head=True) is INT8
    assert q4.choose(80, ["a.weight"]) is FLOAT
    assert q4.choose(80, ["lm_head.weight"], head=True) is FLOAT


def test_auto_follows_the_stored_types():
    stored = {
        "q.weight": "Q4_1",
        "k.weight": "Q4_1",
        "v.weight": "Q8_0",
        "o.weight": "Q5_0",
        "gate.weight": "Q4_K",
        "up.weight": "F16",
        "down.weight": "Q4_0",
    }
    auto = LinearMethods(FLOAT, "auto", KERNELS, stored)
    assert auto.choose(64, ["q.weight", "k.weight"]) is Q4
    # Q8_0, Q5_0 and the K-quants run from their stored blocks: one method for all of them.
    assert auto.choose(64, ["v.weight"]) is BLOCKS
    assert auto.choose(64, ["v.weight", "o.weight", "gate.weight"]) is BLOCKS
    assert auto.choose(64, ["q.weight", "k.weight", "v.weight"]) is FLOAT  # parts disagree
    assert auto.choose(64, ["q.weight", "up.weight"]) is FLOAT
    assert auto.choose(64, ["up.weight"]) is FLOAT
    assert auto.choose(64, ["down.weight"]) is FLOAT  # no kernel of its own
    assert auto.choose(64, ["absent.weight"]) is FLOAT
    assert auto.choose(48, ["v.weight"]) is FLOAT
    # The head goes by its tensor's type too: no int8 override as under "q4".
    assert auto.choose(64, ["q.weight"], head=True) is Q4
    assert auto.choose(64, ["v.weight"], head=True) is BLOCKS
    # Where the stored-blocks method is not offered (tensor parallelism), float.
    sharded = LinearMethods(FLOAT, "auto", {"q4": Q4}, stored)
    assert sharded.choose(64, ["v.weight"]) is FLOAT


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_method_is_the_rowwise_scaled_formula(operands, dtype):
    x, weight, bias = (t.to(dtype) for t in operands)
    x[2] = 0  # an all-zero token keeps scale 1 and gives the bias alone
    layer = _loaded(Fp8LinearMethod(Platform(CPU, dtype)), weight, bias)
    wq, w_scale = layer.prepared
    assert layer.weight is None and wq.dtype == torch.float8_e4m3fn and w_scale.shape == (40, 1)
    # Each row's largest magnitude maps to the format's largest value.
    assert torch.equal(wq.float().abs().amax(dim=1), torch.full((40,), FP8_MAX))
    xq, x_scale = fp8_rows(x)
    expected = (xq.double() * x_scale.double()) @ (wq.double() * w_scale.double()).T
    got = layer(x)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), expected + bias.double(), rtol=tol, atol=tol)
    torch.testing.assert_close(got[2], bias)
    # e4m3 keeps 3 mantissa bits: within a few percent of the float matmul.
    exact = F.linear(x.double(), weight.double(), bias.double())
    assert (got.double() - exact).norm() / exact.norm() < 0.05
    # Tokens are quantized alone: a token's FP8 form does not depend on the batch beside it.
    alone, alone_scale = fp8_rows(x[1:2])
    assert torch.equal(alone.view(torch.uint8), xq[1:2].view(torch.uint8))
    assert torch.equal(alone_scale, x_scale[1:2])


def test_fp8_method_takes_rows_quantized_before_it(operands):
    """Rows a norm or SiLU quantized for it give the bits the float rows give; a layer with
    adapter slots takes float rows (their side path reads them)."""
    x, weight, bias = operands
    layer = _loaded(Fp8LinearMethod(Platform(CPU, torch.float32)), weight, bias)
    assert layer.takes_fp8_rows
    assert torch.equal(layer(Fp8Rows(*fp8_rows(x), torch.float32)), layer(x))
    assert not _loaded(TorchLinearMethod(), weight, bias).takes_fp8_rows
    layer.lora_slots = object()
    assert not layer.takes_fp8_rows


def test_fp8_mode_keeps_the_head_in_float():
    fp8 = LinearMethods(FLOAT, "fp8", {"fp8": FP8})
    assert fp8.choose(64, ["a.weight", "b.weight"]) is FP8
    assert fp8.choose(64, ["lm_head.weight"], head=True) is FLOAT
    assert fp8.choose(48, ["a.weight"]) is FLOAT


def test_auto_takes_the_k_quants_as_one_kind():
    """Q4_K, Q5_K and Q6_K parts of one fused layer share the K-quant method (it runs each
    part's type); mixed with another type, or without the method (tensor parallelism), float."""
    k_quant = LinearMethod()
    stored = {"q.weight": "Q4_K", "k.weight": "Q4_K", "v.weight": "Q6_K", "o.weight": "Q5_K"}
    stored["up.weight"] = "Q4_1"
    auto = LinearMethods(FLOAT, "auto", {**KERNELS, "blocks": k_quant}, stored)
    kernels_without = {kind: m for kind, m in KERNELS.items() if kind != "blocks"}
    assert auto.choose(256, ["q.weight", "k.weight", "v.weight"]) is k_quant
    assert auto.choose(256, ["o.weight"]) is k_quant
    assert auto.choose(256, ["o.weight"], head=True) is k_quant
    assert auto.choose(256, ["q.weight", "up.weight"]) is FLOAT
    assert auto.choose(256, ["up.weight"]) is Q4
    without = LinearMethods(FLOAT, "auto", kernels_without, stored)
    assert without.choose(256, ["q.weight", "k.weight", "v.weight"]) is FLOAT


def test_batch_invariant_mode_takes_the_fixed_tile_matmul_on_cuda_only():
    """On CUDA the float method leaves cuBLAS (which picks its kernel by the step's size) for
    the Triton matmul of one tile shape; the CPU float32 path keeps its per-row packed method."""
    cuda = Platform(torch.device("cuda"), torch.bfloat16, batch_invariant=True)
    assert isinstance(unquantized_method(cuda), InvariantLinearMethod)
    assert isinstance(unquantized_method(Platform(cuda.device, cuda.dtype)), TorchLinearMethod)
    cpu = Platform(torch.device("cpu"), torch.float32, onednn=True, batch_invariant=True)
    assert isinstance(unquantized_method(cpu), PackedLinearMethod)
