"""The platform the layers choose their kernels by."""

import torch

from inflight.model.layers.platform import Platform


def test_detect():
    cpu = torch.device("cpu")
    float32 = Platform.detect(cpu, torch.float32)
    assert float32.onednn == torch.backends.mkldnn.is_available()
    assert float32.cpu_ops is not None, "the fused CPU ops did not build"
    bf16 = Platform.detect(cpu, torch.bfloat16)
    assert not bf16.onednn and bf16.cpu_ops is None
