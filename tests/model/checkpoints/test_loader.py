"""build_model's quantization modes: validation, what each needs, and how "auto" falls back."""

import json
import logging
import shutil
import subprocess
import sys

import pytest
import torch

from inflight.model.checkpoints.loader import build_model, open_checkpoint
from inflight.model.kernels.cpu import attention, int8, native, ops, q4
from inflight.model.layers.linear import Linear
from inflight.model.layers.quantization import PackedLinearMethod, TorchLinearMethod
from inflight.protocol.deployment import DeploymentOptions
from inflight.runtime.runtime import Runtime

CPU = torch.device("cpu")


def _methods(model) -> set[type]:
    return {type(m.method) for m in model.modules() if isinstance(m, Linear)}


@pytest.fixture
def no_native_build(monkeypatch):
    """No native kernel can be built (as without gcc); none is loaded before, and the ones loaded
    after are built again."""

    def fail(source, what, flags):
        raise native.NativeBuildError(f"{what} needs gcc to build its kernel; none on PATH")

    loaders = (
        int8.load_kernel, int8.load_variant, q4.load_kernel, q4.load_variant, ops.library,
        attention.library,
    )  # fmt: skip
    monkeypatch.setattr(native, "_build", fail)
    monkeypatch.setattr(native, "_warned", False)
    for loader in loaders:
        loader.cache_clear()
    yield
    for loader in loaders:
        loader.cache_clear()


def test_rejects_unknown_values(tiny_dirs):
    checkpoint = open_checkpoint(tiny_dirs["llama"])
    for value in ("q3", None, "None"):
        with pytest.raises(
            ValueError,
            match=f"quantization must be one of auto, none, int8, q4, fp8, got {value!r}",
        ):
            build_model(checkpoint, torch.float32, CPU, 64, quantization=value)


@pytest.mark.parametrize("quantization", ["int8", "q4"])
def test_quantized_modes_need_the_cpu_float32_path(tiny_dirs, quantization):
    """The deployment plan refuses them elsewhere, naming what runs there."""
    options = DeploymentOptions(dtype="bfloat16", quantization=quantization)
    with pytest.raises(
        ValueError,
        match=f"quantization='{quantization}' needs the CPU float32 path, got cpu bfloat16; "
        "on CUDA use quantization='fp8' or 'none'",
    ):
        Runtime(tiny_dirs["llama"], options)


@pytest.mark.parametrize("quantization", ["int8", "q4"])
def test_quantized_modes_name_why_their_kernel_cannot_be_built(
    tiny_dirs, no_native_build, quantization
):
    checkpoint = open_checkpoint(tiny_dirs["llama"])
    with pytest.raises(ValueError, match="needs gcc to build its kernel; none on PATH"):
        build_model(checkpoint, torch.float32, CPU, 64, quantization=quantization)


def test_auto_falls_back_to_float32_where_the_kernels_cannot_be_built(no_native_build, caplog):
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        model = build_model(open_checkpoint(), torch.float32, CPU, 64)
    assert _methods(model) == {PackedLinearMethod}
    warnings = [r for r in caplog.records if "native CPU kernels unavailable" in r.message]
    assert len(warnings) == 1


def test_auto_is_float_for_hugging_face_checkpoints_and_off_the_cpu_float32_path(tiny_dirs):
    checkpoint = open_checkpoint(tiny_dirs["qwen2"])
    assert checkpoint.stored_types == {}
    auto = build_model(checkpoint, torch.float32, CPU, 64)
    assert _methods(auto) == {PackedLinearMethod}
    bf16 = build_model(open_checkpoint(), torch.bfloat16, CPU, 64)
    assert _methods(bf16) == {TorchLinearMethod}
    # Tied, the torch head computes with the embedding's own weight.
    assert bf16.lm_head.weight is bf16.embed_tokens.weight


def test_sampling_defaults_are_what_generation_config_recommends(tiny_dirs, tmp_path):
    """As vLLM reads it: temperature, top_p, top_k and repetition_penalty; the rest ignored."""
    path = shutil.copytree(tiny_dirs["llama"], tmp_path / "llama")
    config = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.05}
    (path / "generation_config.json").write_text(json.dumps(config))
    assert open_checkpoint(path).sampling_defaults == {
        "temperature": 0.7,
        "top_p": 0.8,
        "repetition_penalty": 1.05,
    }


def test_a_cpu_model_never_imports_triton(tiny_dirs):
    # As on a machine without Triton (the test venv has it, for its interpreter): any import
    # of it fails; torch itself copes with that.
    script = (
        "import sys\n"
        "sys.modules['triton'] = None\n"
        "import torch\n"
        "from inflight.model.checkpoints.loader import build_model, open_checkpoint\n"
        f"checkpoint = open_checkpoint({str(tiny_dirs['llama'])!r})\n"
        "for dtype in (torch.float32, torch.bfloat16):\n"
        "    build_model(checkpoint, dtype, torch.device('cpu'), 64)\n"
        "ours = [m for m in sys.modules if m.startswith('inflight.model.kernels.triton')]\n"
        "assert not ours, ours\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True)


def test_fp8_needs_a_gpu_with_fp8_tensor_cores(tiny_dirs):
    """The deployment plan refuses it elsewhere, naming the option that runs."""
    with pytest.raises(
        ValueError,
        match="quantization='fp8' needs a CUDA GPU with FP8 tensor cores .* got cpu; start with "
        r"quantization='auto' \(--quantization auto\)",
    ):
        Runtime(tiny_dirs["llama"], DeploymentOptions(dtype="bfloat16", quantization="fp8"))
