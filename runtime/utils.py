"""Small helpers shared by the scheduler, the attention backends and the worker."""

from __future__ import annotations

import torch


def ragged_arange(lengths: torch.Tensor) -> torch.Tensor:
    """Concatenation of arange(n) for each n in `lengths` (int64, on lengths' device)."""
    starts = torch.cumsum(lengths, 0) - lengths
    return torch.arange(int(lengths.sum()), device=lengths.device) - torch.repeat_interleave(starts, lengths)
