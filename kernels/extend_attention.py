"""Extend attention: new tokens after a cached prefix (prefill, prefill chunks, jump-forward).

One program per (request, query head, block of the request's new tokens), tiled as
FlashAttention-2: a block of queries stays in registers while blocks of keys and values stream
past it. The new tokens' K/V are in the pool already (the backend stores them first), so its
queries attend to the keys up to the block's last query in one pass through the token table,
the cached prefix and the new tokens alike, with one online softmax: a chunk of a long prompt
(whose prefix is the earlier chunks) costs what its own attention costs, and a token sees its
neighbours' keys as the pool holds them (in its type: `common.pool_args`), as every later token
will. The pass is in two parts: the key blocks every query of the block sees whole (the prefix
and the new tokens before the block's first query), with no causal mask, then the few blocks
along the diagonal, masked. Programs start with each request's last query blocks (the most
keys), so the long ones are not left for the end. Requests of any prefix and extend length share
one launch; block sizes, warps and pipeline stages come from `extend_config` (per GPU
generation; gpu_check measures the alternatives).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixlm.kernels.common import attend_block, dot_precision, head_dim_of, interpreting, load_kv, pool_args
from radixlm.kernels.cpu.reference import decode_kv


@triton.jit
def _extend_kernel(
    q, k_cache, v_cache, k_scales, v_scales, out, table, rows, prefix_lens, extend_lens, q_starts, scale,
    stride_qt, stride_qh, stride_cs, stride_ch, stride_ot, stride_oh, stride_t,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, SCALED: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.num_programs(2) - 1 - tl.program_id(2)  # the most keys first
    extend = tl.load(extend_lens + b)
    if m_block * BLOCK_M >= extend:
        return
    prefix = tl.load(prefix_lens + b)
    q0 = tl.load(q_starts + b)
    row = tl.load(rows + b)
    kv_head = head // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the request's new tokens
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < extend
    d_mask = offs_d < HEAD_DIM
    qv = tl.load(q + (q0 + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                 mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        qv = qv.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # positions 0 .. the block's last query, through the token table; query j sees prefix + j and
    # before, so every query of the block sees positions before prefix + m_block * BLOCK_M + 1
    # (`whole`: those in whole key blocks), and only the rest needs the causal mask
    end = prefix + tl.minimum(extend, (m_block + 1) * BLOCK_M)
    whole = (prefix + m_block * BLOCK_M + 1) // BLOCK_N * BLOCK_N
    for n0 in range(0, whole, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        slots = tl.load(table + row * stride_t + offs_n)
        rows_at = slots * stride_cs + kv_head * stride_ch
        everywhere = offs_n < whole  # (all true: the loads take a row mask)
        kb, vb = load_kv(k_cache, v_cache, rows_at[:, None] + offs_d[None, :], everywhere[:, None] & d_mask[None, :],
                         UPCAST, k_scales, v_scales, (rows_at + HEAD_DIM) // 4, everywhere, SCALED)
        m_i, l_i, acc = attend_block(qv, kb, vb, 0, scale, m_i, l_i, acc, PRECISION, MASKED=False)
    for n0 in range(whole, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        slots = tl.load(table + row * stride_t + offs_n, mask=n_mask, other=0)
        rows_at = slots * stride_cs + kv_head * stride_ch
        kb, vb = load_kv(k_cache, v_cache, rows_at[:, None] + offs_d[None, :], n_mask[:, None] & d_mask[None, :],
                         UPCAST, k_scales, v_scales, (rows_at + HEAD_DIM) // 4, n_mask, SCALED)
        visible = (offs_n[None, :] <= prefix + offs_m[:, None]) & n_mask[None, :]
        m_i, l_i, acc = attend_block(qv, kb, vb, visible, scale, m_i, l_i, acc, PRECISION, MASKED=True)

    result = acc / l_i[:, None]
    tl.store(out + (q0 + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             result.to(out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@dataclass(frozen=True)
class ExtendConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=None)  # (asked on every layer of every step)
def extend_config(dim: int, dtype: torch.dtype, device: torch.device) -> ExtendConfig:
    """Query and key block sizes, warps and pipeline stages: FlashAttention-2's shape on Ampere and
    later for 16-bit queries (128 queries a program, 64 keys a block, 8 warps where a head is
    wider than 64, keys prefetched 2-3 blocks ahead), smaller for fp32 queries and on older GPUs
    (their blocks would not fit in shared memory); 16 x 16 under the interpreter, where a block is
    numpy work."""
    if interpreting() or device.type != "cuda":
        return ExtendConfig(16, 16, 4, 1)
    major, _ = torch.cuda.get_device_capability(device)
    if major >= 8 and dtype.itemsize == 2:
        return ExtendConfig(128, 64 if dim <= 128 else 32, 8 if dim > 64 else 4, 3 if major >= 9 else 2)
    return ExtendConfig(64, 64 if dim <= 128 else 32, 4, 1)


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                     rows: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor, scale: float, *,
                     max_extend_len: int | None = None, out: torch.Tensor | None = None,
                     config: ExtendConfig | None = None) -> torch.Tensor:
    """q [T, heads, d]: the new tokens of every request, packed in request order (extend_lens[b]
    each). Token j of request b sits at position prefix_lens[b] + j and sees positions 0..that
    through table[rows[b]] in the caches [slots, kv_heads, row] (any KV type), its request's new
    tokens' K/V already stored there. `config`: extend_config's unless given (gpu_check times
    the alternatives)."""
    tokens, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    assert heads % kv_heads == 0 and q.stride(2) == 1 and k_cache.stride(2) == 1 and head_dim_of(k_cache) == dim
    batch = extend_lens.shape[0]
    q_starts = torch.cumsum(extend_lens, 0) - extend_lens
    if max_extend_len is None:
        max_extend_len = int(extend_lens.max())
    config = config or extend_config(dim, q.dtype, q.device)
    out = torch.empty_like(q) if out is None else out
    grid = (batch, heads, triton.cdiv(max_extend_len, config.block_m))
    pools = pool_args(k_cache, v_cache, q)
    _extend_kernel[grid](
        q, k_cache, v_cache, pools["k_scales"], pools["v_scales"], out, table, rows, prefix_lens, extend_lens,
        q_starts, scale, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
        table.stride(0), GROUP=heads // kv_heads, HEAD_DIM=dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_D=triton.next_power_of_2(dim), UPCAST=pools["UPCAST"], SCALED=pools["SCALED"],
        PRECISION=dot_precision(q.dtype), num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def extend_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                               rows: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """The same, one request at a time, in fp32, with an explicit causal mask."""
    group = q.shape[1] // k_cache.shape[1]
    out = torch.empty_like(q)
    start = 0
    for b in range(extend_lens.shape[0]):
        prefix, extend = int(prefix_lens[b]), int(extend_lens[b])
        slots = table[rows[b], : prefix + extend]
        k = decode_kv(k_cache[slots]).repeat_interleave(group, dim=1)
        v = decode_kv(v_cache[slots]).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:start + extend].float(), k) * scale
        visible = torch.arange(prefix + extend)[None, :] <= prefix + torch.arange(extend)[:, None]
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
        out[start:start + extend] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v).to(q.dtype)
        start += extend
    return out
