"""What the kernels share: interpreter detection, block sizes, reading pools of every KV type, and
the online-softmax step."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported) runs kernels on a CPU;
    it computes bf16/fp16 wrongly, so kernels upcast their loads to fp32 there."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def block_size(gpu: int) -> int:
    """`gpu` on a GPU; 16 under the interpreter, where a block is numpy work and small is fast."""
    return 16 if interpreting() else gpu


@triton.jit
def load_kv(k_base, v_base, offs, mask, UPCAST: tl.constexpr, k_scales, v_scales, scale_offs, row_mask,
            SCALED: tl.constexpr):
    """One block of keys and values, fp32 when UPCAST. SCALED: an int8 pool's rows, each times its
    scale (the fp32 after its codes: k_scales / v_scales are the pools' memory as fp32, scale_offs
    each row's scale there), so fp32."""
    kb = tl.load(k_base + offs, mask=mask, other=0.0)
    vb = tl.load(v_base + offs, mask=mask, other=0.0)
    if SCALED:
        kb = kb.to(tl.float32) * tl.load(k_scales + scale_offs, mask=row_mask, other=0.0)[:, None]
        vb = vb.to(tl.float32) * tl.load(v_scales + scale_offs, mask=row_mask, other=0.0)[:, None]
    elif UPCAST:
        kb = kb.to(tl.float32)
        vb = vb.to(tl.float32)
    return kb, vb


def pool_args(k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor) -> dict:
    """What the kernels need to read pools of any KV type (`--kv-cache-dtype`; caches [slots,
    kv_heads, row] views of the head-major pools) against queries `q`: the pools' memory as fp32 for
    an int8 pool's scales (each row: its head_dim codes, then its fp32 scale), and whether loads
    upcast to fp32 (under the interpreter, for fp32 queries, and for a pool of another type than
    the queries': fp16, bf16 or fp8 rows, or int8 codes times their scales)."""
    scaled = k_cache.dtype == torch.int8
    return dict(k_scales=k_cache.view(torch.float32) if scaled else k_cache,
                v_scales=v_cache.view(torch.float32) if scaled else v_cache,
                SCALED=scaled, UPCAST=interpreting() or q.dtype == torch.float32 or k_cache.dtype != q.dtype)


def head_dim_of(cache: torch.Tensor) -> int:
    """The head dimension a pool's rows hold (an int8 row also holds its scale's 4 bytes)."""
    return cache.shape[-1] - 4 if cache.dtype == torch.int8 else cache.shape[-1]


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs: exact ("ieee"); on a GPU tl.dot would otherwise round them to tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def attend_block(qv, kb, vb, visible, scale, m_i, l_i, acc, PRECISION: tl.constexpr, MASKED: tl.constexpr):
    """One step of the online softmax: fold a block of keys/values into the running max `m_i`,
    normaliser `l_i` and unnormalised output `acc` of the queries `qv`. MASKED: only where
    `visible` (else every query sees every key of the block, and `visible` is not read)."""
    scores = tl.dot(qv, tl.trans(kb), input_precision=PRECISION) * scale
    if MASKED:
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    p = tl.exp(scores - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=PRECISION)
    return m_new, l_i, acc
