"""Write a step's new K/V rows into their pool slots (one program per token)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kernel(k_cache, v_cache, k_new, v_new, slots, row_size, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    chunk = tl.program_id(1)
    slot = tl.load(slots + token)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_size
    tl.store(k_cache + slot * row_size + offs, tl.load(k_new + token * row_size + offs, mask=mask), mask=mask)
    tl.store(v_cache + slot * row_size + offs, tl.load(v_new + token * row_size + offs, mask=mask), mask=mask)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """k_cache[slots[i]] = k[i] (and v): caches [slots, kv_heads, d], k/v [T, kv_heads, d], all contiguous."""
    tokens = slots.numel()
    if tokens == 0:
        return
    row = k_cache[0].numel()
    block = min(1024, triton.next_power_of_2(row))
    _store_kernel[(tokens, triton.cdiv(row, block))](k_cache, v_cache, k.contiguous(), v.contiguous(), slots,
                                                     row, BLOCK=block)


def store_kv_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor) -> None:
    k_cache[slots] = k
    v_cache[slots] = v
