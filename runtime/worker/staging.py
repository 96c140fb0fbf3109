"""Host values onto the device without waiting for it: what a batch is built with while the step
before it runs (overlap scheduling) must not synchronize the device.

A plain ``torch.tensor(values, device="cuda")`` copies from pageable memory, which waits for
everything queued on the stream, the running step included. Here values are made on the host,
pinned, and sent with ``non_blocking=True`` (the pinned block is kept until the copy is done by
torch's host allocator). On a CPU the host tensor is the answer. Every host-to-device copy made
while building a batch goes through ``to_device`` or ``stage``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def _send(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def to_device(values: Any, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device``, sent without a synchronization."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return _send(host.to(dtype), device)


def stage(arrays: list[np.ndarray], device: torch.device | str) -> list[torch.Tensor]:
    """Host int64 arrays as device tensors in one copy: concatenated on the host, sent, and split
    into views."""
    sizes = [len(a) for a in arrays]
    host = torch.from_numpy(np.concatenate(arrays).astype(np.int64, copy=False))
    return list(_send(host, device).split(sizes))
