"""Decode attention over the paged KV pool: one query token per request, split-KV.

Stage 1 gives every (request, KV head, split) one program: the split's range
of the request's context is read through the token table (any page size: the
table maps each position to its slot), and the query heads that share the KV
head (the GQA group, padded to a power of two of at least 16 for `tl.dot`) are
attended together, with an online softmax. Each writes a partial output and
its log-sum-exp. Stage 2 merges the splits per (request, head). Splitting the
context keeps the GPU busy when the batch is small and the context long. The
pool may be of any KV type (`common.pool_args`): rows are converted as loaded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.kernels.common import attend_block, block_size, dot_precision, head_dim_of, load_kv, pool_args
from radixlm.kernels.cpu.reference import decode_kv


@triton.jit
def _decode_stage1(
    q, k_cache, v_cache, k_scales, v_scales, table, rows, seq_lens, mid_out, mid_lse, scale,
    stride_qb, stride_qh, stride_cs, stride_ch, stride_t,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, SCALED: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(rows + b)
    seq_len = tl.load(seq_lens + b)
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    qv = tl.load(q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                 mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        qv = qv.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        slots = tl.load(table + row * stride_t + offs_n, mask=n_mask, other=0)
        rows_at = slots * stride_cs + kv_head * stride_ch
        kb, vb = load_kv(k_cache, v_cache, rows_at[:, None] + offs_d[None, :], n_mask[:, None] & d_mask[None, :],
                         UPCAST, k_scales, v_scales, (rows_at + HEAD_DIM) // 4, n_mask, SCALED)
        m_i, l_i, acc = attend_block(qv, kb, vb, n_mask[None, :], scale, m_i, l_i, acc, PRECISION, MASKED=True)

    has = l_i > 0  # an empty split (short context) contributes nothing
    safe_l = tl.where(has, l_i, 1.0)
    out_offs = b * stride_mb + heads[:, None] * stride_mh + split * stride_ms + offs_d[None, :]
    tl.store(mid_out + out_offs, acc / safe_l[:, None], mask=g_mask[:, None] & d_mask[None, :])
    lse = tl.where(has, m_i + tl.log(safe_l), float("-inf"))
    tl.store(mid_lse + b * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _decode_stage2(
    mid_out, mid_lse, out, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(mid_lse + b * stride_lb + head * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(lse > float("-inf"), tl.exp(lse - m), 0.0)
    parts = tl.load(mid_out + b * stride_mb + head * stride_mh + offs_s[:, None] * stride_ms + offs_d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    merged = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out + b * stride_ob + head * stride_oh + offs_d, merged.to(out.dtype.element_ty), mask=d_mask)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                     rows: torch.Tensor, seq_lens: torch.Tensor, scale: float, *, num_splits: int = 8,
                     out: torch.Tensor | None = None,
                     workspace: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention of q [B, heads, d] over each request's first seq_lens[b] positions, read from the
    caches [slots, kv_heads, row] (any KV type: `common.pool_args`) through table[rows[b], position].
    Returns [B, heads, d] in q's dtype.
    `workspace`: the splits' partial outputs [>= B, heads, num_splits, d] and log-sum-exps
    [>= B, heads, num_splits], float32, allocated once (`decode_workspace`): a captured CUDA graph
    must find them at the same addresses on every replay."""
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    assert heads % kv_heads == 0 and k_cache.stride(2) == 1 and q.stride(2) == 1 and head_dim_of(k_cache) == dim
    group = heads // kv_heads
    block_d = triton.next_power_of_2(dim)
    mid_out, mid_lse = workspace or decode_workspace(batch, heads, dim, num_splits, q.device)
    mid_out, mid_lse = mid_out[:batch], mid_lse[:batch]
    out = torch.empty_like(q) if out is None else out
    pools = pool_args(k_cache, v_cache, q)
    _decode_stage1[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, pools["k_scales"], pools["v_scales"], table, rows, seq_lens, mid_out, mid_lse, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), table.stride(0),
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEAD_DIM=dim, NUM_SPLITS=num_splits, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d, BLOCK_N=block_size(64), UPCAST=pools["UPCAST"], SCALED=pools["SCALED"],
        PRECISION=dot_precision(q.dtype),
    )
    _decode_stage2[(batch, heads)](
        mid_out, mid_lse, out, mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=dim, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
    )
    return out


def decode_workspace(batch: int, heads: int, dim: int, num_splits: int,
                     device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_attention`'s intermediate buffers for up to `batch` requests."""
    return (torch.empty((batch, heads, num_splits, dim), dtype=torch.float32, device=device),
            torch.empty((batch, heads, num_splits), dtype=torch.float32, device=device))


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """The same, one request at a time, in fp32 (rows read by the native kernels' reference: an int8
    row's codes times its scale)."""
    group = q.shape[1] // k_cache.shape[1]
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        slots = table[rows[b], : int(seq_lens[b])]
        k = decode_kv(k_cache[slots]).repeat_interleave(group, dim=1)  # [n, heads, d]
        v = decode_kv(v_cache[slots]).repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), k) * scale, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", weights, v).to(q.dtype)
    return out

