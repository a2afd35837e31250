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


def test_packed_parts_start_16_byte_aligned():
    # Triton compiles a kernel per alignment case of its pointers: parts must not move between
    # cases as the step's sizes change.
    for first in range(1, 9):
        arrays = [np.arange(first), np.arange(3), np.arange(6).reshape(2, 3)]
        for dtype in (torch.int32, torch.int64):
            got = to_device_packed(arrays, dtype, torch.device("cpu"))
            assert all((t.data_ptr() - got[0].data_ptr()) % 16 == 0 for t in got)
            assert [t.tolist() for t in got] == [a.tolist() for a in arrays]
