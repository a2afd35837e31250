import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# transformers 5.25 fetches some layers' kernels from the hub (gpt-oss's, Mamba's): the
# reference is its own PyTorch code.
os.environ.setdefault("USE_HUB_KERNELS", "NO")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# No GPU here: the Triton kernels' tests run them in Triton's interpreter, which is chosen when
# a kernel is decorated, so before anything imports one.
os.environ.setdefault("TRITON_INTERPRET", "1")

import sys
from pathlib import Path

import pytest
import torch

# Helpers shared by tests: tests/helpers.py, tests/tiny_models.py, tests/engine/fake_execution.py.
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "engine"))
sys.path.insert(0, str(Path(__file__).parent / "server"))

from helpers import assert_no_leaks, torch_threads  # noqa: E402
from tiny_models import (  # noqa: E402
    FAMILIES,
    SLIDING_KINDS,
    make_tiny_llava,
    make_tiny_model,
    make_tiny_sliding,
)


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`make test`: a worker per core), a worker and the processes it starts
    take one thread each: two workers of two threads on two cores would contend for them."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


@pytest.fixture
def two_threads():
    """The native kernels' work split over two threads whatever the process's own count (one
    under `make test`'s workers): the kernels' test modules use it for every test."""
    with torch_threads(2):
        yield


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    for family in FAMILIES:
        make_tiny_model(family, root / family)
    return {family: root / family for family in FAMILIES}


@pytest.fixture(scope="session")
def sliding_dirs(tmp_path_factory) -> dict[str, Path]:
    """Tiny sliding-window checkpoints (`tiny_models.SLIDING_KINDS`), by kind."""
    root = tmp_path_factory.mktemp("sliding")
    for kind in SLIDING_KINDS:
        make_tiny_sliding(kind, root / kind)
    return {kind: root / kind for kind in SLIDING_KINDS}


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory) -> tuple[Path, object]:
    """A tiny random LLaVA (CLIP tower) directory, and its transformers model (float32)."""
    path = tmp_path_factory.mktemp("tiny_llava")
    return path, make_tiny_llava(path)


@pytest.fixture(scope="session")
def llm():
    """The embedded default model (SmolLM2-135M-Instruct GGUF) as users get it by default (the
    blocking path, quantization "auto"), loaded once for the session."""
    from inflight import LLM

    instance = LLM(max_batch_size=8, max_model_len=1024)
    yield instance
    instance.close()


@pytest.fixture(scope="session")
def smollm_runtime():
    """A runtime on the default model in exact float32 (quantization "none") without the context
    cache: the plain reference the comparisons with HF transformers run."""
    from inflight.protocol.deployment import DeploymentOptions
    from inflight.runtime.runtime import Runtime

    config = DeploymentOptions(
        max_batch_size=8, max_model_len=1024, quantization="none", enable_context_reuse=False
    )
    return Runtime(None, config)


@pytest.fixture
def smollm(smollm_runtime):
    """The float32 default-model runtime, checked for leaks before and after the test."""
    assert_no_leaks(smollm_runtime)
    yield smollm_runtime
    assert_no_leaks(smollm_runtime)


@pytest.fixture(scope="session")
def hf_smollm():
    """HF transformers' own load of the same GGUF: the numerical reference."""
    from inflight.bench.offline import hf_model

    return hf_model(None)


@pytest.fixture(scope="session")
def ifb_llm():
    """The default model under in-flight batching, batch 4."""
    from inflight import LLM

    instance = LLM(enable_in_flight_batching=True, max_batch_size=4, max_model_len=1024)
    yield instance
    instance.close()


@pytest.fixture(scope="session")
def server_llm():
    """The default model under in-flight batching (batch 4, short context) for the server."""
    from inflight import LLM

    instance = LLM(enable_in_flight_batching=True, max_batch_size=4, max_model_len=512)
    yield instance
    instance.close()


@pytest.fixture(scope="session")
def smollm_cached():
    """A second float32 runtime on the default model, with the context cache on (the default)."""
    from inflight.protocol.deployment import DeploymentOptions
    from inflight.runtime.runtime import Runtime

    return Runtime(
        None, DeploymentOptions(max_batch_size=4, max_model_len=1024, quantization="none")
    )
