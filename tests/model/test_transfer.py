"""Host-to-device copies: several arrays through one copy come back whole, each in its shape."""

import numpy as np
import torch

from inflight.model.transfer import to_device_packed


def test_packed_arrays_keep_their_shapes_and_values():
    arrays = [np.arange(5), np.arange(12).reshape(3, 4) * 7, np.array([], np.int64), np.array([9])]
    got = to_device_packed(arrays, torch.int32, torch.device("cpu"))
    assert [t.shape for t in got] == [(5,), (3, 4), (0,), (1,)]
    assert all(t.dtype == torch.int32 for t in got)
    for tensor, array in zip(got, arrays, strict=True):
        assert tensor.tolist() == array.tolist()
