"""Host arrays to the device without a synchronisation.

A copy from pageable memory makes the host wait for the device; one from page-locked memory with
`non_blocking=True` is queued on the stream like a kernel. torch's caching host allocator keeps
the pinned buffer alive until the copy has run, so a step's metadata may be built in numpy and
handed over without waiting.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` as a tensor on `device`: the array itself on the CPU (no copy), else an asynchronous
    copy through pinned memory."""
    host = torch.from_numpy(array)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
