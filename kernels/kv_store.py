"""Write a step's new K/V rows into their pool slots (one program per token and KV head)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kernel(k_cache, v_cache, k_new, v_new, slots, stride_cs, stride_ch, stride_nt, stride_nh, head_dim,
                  BLOCK: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slots + token)
    offs = tl.arange(0, BLOCK)
    mask = offs < head_dim
    src = token * stride_nt + head * stride_nh + offs
    dst = slot * stride_cs + head * stride_ch + offs
    tl.store(k_cache + dst, tl.load(k_new + src, mask=mask), mask=mask)
    tl.store(v_cache + dst, tl.load(v_new + src, mask=mask), mask=mask)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """k_cache[slots[i]] = k[i] (and v): caches [slots, kv_heads, row] of any slot and head strides
    (the pool is head-major), k/v [T, kv_heads, row] rows already in the cache's type (the
    backend's `KVDtype.encode`); the row contiguous everywhere."""
    tokens = slots.numel()
    if tokens == 0:
        return
    k, v = k.contiguous(), v.contiguous()
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(2) == 1
    heads, dim = k_cache.shape[1], k_cache.shape[2]
    _store_kernel[(tokens, heads)](k_cache, v_cache, k, v, slots, k_cache.stride(0), k_cache.stride(1),
                                   k.stride(0), k.stride(1), dim, BLOCK=triton.next_power_of_2(dim))


def store_kv_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor) -> None:
    k_cache[slots] = k
    v_cache[slots] = v
