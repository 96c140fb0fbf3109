"""What the kernels share: interpreter detection, block sizes, and the online-softmax step."""

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
def load_kv(k_base, v_base, offs, mask, UPCAST: tl.constexpr):
    """One block of keys and values (fp32 when UPCAST)."""
    kb = tl.load(k_base + offs, mask=mask, other=0.0)
    vb = tl.load(v_base + offs, mask=mask, other=0.0)
    if UPCAST:
        kb = kb.to(tl.float32)
        vb = vb.to(tl.float32)
    return kb, vb


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs: exact ("ieee"); on a GPU tl.dot would otherwise round them to tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def attend_block(qv, kb, vb, visible, scale, m_i, l_i, acc, PRECISION: tl.constexpr):
    """One step of the online softmax: fold a block of keys/values into the running max `m_i`,
    normaliser `l_i` and unnormalised output `acc` of the queries `qv`."""
    scores = tl.dot(qv, tl.trans(kb), input_precision=PRECISION) * scale
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    p = tl.exp(scores - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=PRECISION)
    return m_new, l_i, acc
