"""Small helpers shared by the scheduler, the attention backends and the worker."""

from __future__ import annotations

import ctypes

import torch


def ragged_arange(lengths: torch.Tensor) -> torch.Tensor:
    """Concatenation of arange(n) for each n in `lengths` (int64, on lengths' device)."""
    starts = torch.cumsum(lengths, 0) - lengths
    return torch.arange(int(lengths.sum()), device=lengths.device) - torch.repeat_interleave(starts, lengths)


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; a no-op elsewhere).
    Freed tensors' memory otherwise stays resident in the allocator: after loading a model (the
    fp32 weights a quantized model was made from) that was ~440 MB of a SmolLM2 server's 1.7 GB."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass
