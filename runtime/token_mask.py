"""The allowed-token bitmask: its layout, the bits of one token, and applying it to logits.

One row per batch row, ``ceil(V / 32)`` int32 words (a CPU tensor): bit j of word w allows token
32w + j; a row of all ones (-1) allows everything, so unconstrained rows are left as allocated.
The constraint backends write their rows (constrained/, `grammar_bitmask`); the sampler applies
the whole mask to the step's logits before anything else it does (worker/sampler.py).

A leaf, so both sides depend on it and it on neither. torch is imported only where a tensor is
made: the outlines backend's compiler process (compile_worker.py) imports this module and stays
free of torch.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def mask_words(vocab_size: int) -> int:
    """Words per row: ceil(V / 32)."""
    return (vocab_size + 31) // 32


def allocate_mask(rows: int, vocab_size: int, allowed: bool = True) -> torch.Tensor:
    """A ``[rows, ceil(V/32)]`` int32 CPU mask: every token allowed, or (``allowed=False``) none."""
    import torch

    return torch.full((rows, mask_words(vocab_size)), -1 if allowed else 0, dtype=torch.int32)


def token_bit(token: int) -> tuple[int, int]:
    """(word, the int32 value with only `token`'s bit set) of `token`."""
    word, bit = divmod(token, 32)
    return word, (1 << bit) - (1 << 32 if bit == 31 else 0)  # bit 31 is the int32 sign bit


def allow_token(row: torch.Tensor, token: int) -> None:
    """Set `token`'s bit in `row`, a ``[1, W]`` view of one mask row, in place."""
    word, value = token_bit(token)
    row[0, word] |= value


def forbid_token(row: torch.Tensor, token: int) -> None:
    """Clear `token`'s bit in `row`, a ``[1, W]`` view of one mask row, in place."""
    word, value = token_bit(token)
    row[0, word] &= ~value


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor) -> None:
    """Set disallowed tokens' logits to -inf, in place, in one vectorised operation.

    (outlines-core's own kernel is torch.compile'd: its first call costs ~15 s on a CPU.)"""
    mask = mask.to(logits.device, non_blocking=True)
    # [B, W, 32]: bit j of word w is token 32w + j
    bits = (mask.unsqueeze(-1) >> _bit_positions(logits.device)) & 1
    allowed = bits.view(mask.shape[0], -1)[:, : logits.shape[-1]].bool()
    logits.masked_fill_(~allowed, float("-inf"))


@cache
def _bit_positions(device: torch.device) -> torch.Tensor:
    """0..31 as int32 on `device`, the shifts that take a word apart into its bits (made there
    once: no copy a step)."""
    import torch

    return torch.arange(32, dtype=torch.int32, device=device)
