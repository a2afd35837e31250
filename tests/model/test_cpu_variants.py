"""The native kernels' instruction-set variants (`native.Variant`): which one a CPU runs, the
variable that forces a lower one, and the quantized matmuls (int8, 4-bit, Q5_K, Q6_K's centered
build) of every variant the bits of AVX2's.

Every variant this machine runs is checked, and the VNNI code on any AVX2 machine too, built with
vpdpbusd emulated (`INFLIGHT_EMULATE_VNNI`): its layout, corrections and tiles are the real
variants', only the one instruction is spelled in AVX2. The real VNNI builds run their full
register tiles in assembly (vnni.h's DPBUSD_ASM), which only a machine with VNNI runs; every
variant is compiled on any machine. The attention and the decoder step have no code of their
own for wider sets yet: they are built for AVX2."""

import pytest
import torch

from inflight.model.kernels.cpu import blocks, int8, native, q4

from helpers import random_blocks

pytestmark = pytest.mark.usefixtures("two_threads")  # their work split, as on two cores

EMULATED_VNNI = native.Variant("vnni-emulated", ("-DINFLIGHT_EMULATE_VNNI",))
AVX2 = native.VARIANTS[-1]
CHECKED = [*native.runnable_variants(), EMULATED_VNNI]


def _int8(lib, x, k, weight, bias):
    tensors = (weight.values, weight.scales)
    return int8.run_kernel(lib.int8_linear, "int8_linear", x, k, 37, tensors, bias)


def _q4(lib, x, k, weight, bias):
    tensors = (weight.values, weight.scales, weight.mins)
    return int8.run_kernel(lib.q4_linear, "q4_linear", x, k, 37, tensors, bias)


def _k8(lib, x, k, weight, bias):
    tensors = (weight.values, weight.scales, weight.multipliers)
    return int8.run_kernel(lib.k8_linear, "k8_linear", x, k, 37, tensors, bias)


def _k_quant(type_name):
    def quantize(weight):
        n, k = weight.shape
        return blocks.block_weight(type_name, random_blocks(type_name, n, k, seed=k), k)

    return quantize


KERNELS = {
    "int8": (int8.quantize_weight, int8.load_variant, _int8),
    "q4": (q4.quantize_q4, q4.load_variant, _q4),
    "Q5_K": (_k_quant("Q5_K"), blocks.load_variant, _k8),
    "Q6_K": (_k_quant("Q6_K"), lambda variant: blocks.load_variant(variant, centered=True), _k8),
}


@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize("variant", CHECKED, ids=lambda v: v.name)
def test_every_variant_gives_the_bits_of_avx2(variant, kind):
    """K over every group size (8, 4, 2, 1 blocks; for q4 an odd last register), 1-9 and 16
    tokens (partial register tiles), an odd number of rows, a bias; int8 weights reaching -128
    (as GGUF's Q8_0 blocks may), a row of zeros and one of outliers among the activations."""
    quantize, load, run = KERNELS[kind]
    torch.manual_seed(0)
    want_lib, got_lib = load(AVX2), load(variant)
    # K-quants: whole superblocks of 256
    for k in (256, 768, 1536) if kind.endswith("_K") else (32 * 15, 576, 1536):
        weight = quantize(torch.randn(37, k))
        if kind == "int8":
            weight.values.view(-1)[::97] = -128
        bias = torch.randn(37)
        x = torch.randn(16, k)
        x[3] = 0
        x[5, ::13] *= 1e4
        for m in (*range(1, 10), 16):
            want = run(want_lib, x[:m], k, weight, bias)
            assert torch.equal(run(got_lib, x[:m], k, weight, bias), want), (k, m)


@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize("variant", native.VARIANTS, ids=lambda v: v.name)
def test_every_variant_compiles_on_any_machine(variant, kind):
    """Built, not run: the assembly of a variant this CPU lacks still has to assemble."""
    assert KERNELS[kind][1](variant) is not None


def test_the_best_variant_the_cpu_reports_is_chosen(monkeypatch):
    monkeypatch.delenv(native.ISA_ENV, raising=False)
    for flags, name in (
        (
            {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni"},
            "avx512-vnni",
        ),
        ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx_vnni"}, "avx-vnni"),
        ({"avx2", "fma"}, "avx2"),
    ):
        monkeypatch.setattr(native, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert native.chosen_variant().name == name


def test_the_variable_forces_a_lower_variant_and_refuses_what_the_cpu_lacks(monkeypatch):
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx_vnni"}))
    monkeypatch.setenv(native.ISA_ENV, "avx2")
    assert native.chosen_variant() is AVX2
    monkeypatch.setenv(native.ISA_ENV, "avx512-vnni")
    with pytest.raises(ValueError, match="avx512-vnni.*lacks.*avx512_vnni.*runs avx-vnni, avx2"):
        native.chosen_variant()
    monkeypatch.setenv(native.ISA_ENV, "sse4")
    with pytest.raises(ValueError, match="'sse4' is none of avx512-vnni, avx-vnni, avx2"):
        native.chosen_variant()


@pytest.mark.parametrize("variant", CHECKED, ids=lambda v: v.name)
def test_the_small_weights_build_gives_the_bits_of_the_general_one(variant):
    """Weights within -16..15 (Q5_0's, -16 included): the build for small weights sums them by
    vpmaddubsw in int16 (or, with VNNI, as the general build does), every output the general
    build's bits; GGUF's Q5_0 blocks are packed to run in it."""
    torch.manual_seed(1)
    general, small = int8.load_variant(AVX2), int8.load_variant(variant, small=True)
    for k in (32 * 15, 576, 1536):
        values = torch.randint(-16, 16, (37, k), dtype=torch.int8)
        values[:, ::7] = -16
        values[0], values[1] = -16, 15  # with rows of x at +-127 everywhere: int16's bounds
        weight = int8.pack_int8(values, torch.rand(37, k // 32) * 1e-2, small=True)
        bias = torch.randn(37)
        x = torch.randn(16, k)
        x[5, ::13] *= 1e4
        x[6], x[7] = 1.0, -1.0
        for m in (*range(1, 10), 16):
            want = _int8(general, x[:m], k, weight, bias)
            assert torch.equal(_int8(small, x[:m], k, weight, bias), want), (k, m)
    q5_0 = blocks.block_weight("Q5_0", random_blocks("Q5_0", 37, 576, seed=2), 576)
    assert q5_0.small
    x = torch.randn(9, 576)
    assert torch.equal(blocks.block_linear(x, q5_0), _int8(general, x, 576, q5_0, None))


@pytest.mark.parametrize("variant", CHECKED, ids=lambda v: v.name)
def test_the_centered_build_sums_q6_k_as_the_general_one(variant):
    """Q6_K's centered build takes the 32 off in integers (int16 sums that wrap on the way), the
    general one in float minimum terms: the same products up to float rounding, at the int16
    bounds too (every q 0 or 63 against activations at +-127 everywhere, scales -128 and 127)."""
    general = blocks.load_variant(AVX2)
    centered = blocks.load_variant(variant, centered=True)
    k = 512
    raw = random_blocks("Q6_K", 37, k, seed=4).reshape(37, k // 256, 210)
    raw[0:2, :, 0:192] = 0  # q = 0 everywhere
    raw[2:4, :, 0:192] = 255  # q = 63 everywhere
    raw[0, :, 192:208] = 128  # scale -128
    raw[2, :, 192:208] = 127
    weight = blocks.block_weight("Q6_K", raw.reshape(37, -1), k)
    assert weight.centered
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(4))
    x[6], x[7] = 1.0, -1.0
    for m in (1, 5, 16):
        want = _k8(general, x[:m], k, weight, None)
        got = _k8(centered, x[:m], k, weight, None)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
