"""What the deployment plan reads of the machine: its CUDA devices."""

from __future__ import annotations

import torch

from inflight.runtime.deployment import MachineFacts


def probe_machine() -> MachineFacts:
    """The visible CUDA devices and the first one's compute capability (none: a CPU box)."""
    if not torch.cuda.is_available():
        return MachineFacts()
    return MachineFacts(torch.cuda.device_count(), torch.cuda.get_device_capability(0))
