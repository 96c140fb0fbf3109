"""Batch-invariant attention (`--deterministic`): a token's attention output is bitwise the same
whatever else is in its step, however its prompt was chunked, and whether its prefix came from
the cache or was computed now.

Every new token, prefill or decode alike, is one query over its own keys 0..position, read from
the pool in blocks of KEY_BLOCK keys (in the pool's type, each row converted to fp32 alone: the
same values whatever else is gathered). The arithmetic has one shape whatever the batch: each
(query, KV head, block) is a [group, d] x [d, KEY_BLOCK] product; the softmax's max is exact;
the block sums are accumulated in block order by `cumsum`, so the all-masked blocks that pad a
short context to its slice's longest add exact zeros (as do the blocks a sliding layer's window
has left behind: its mask also hides keys a window or more behind the query; a sink, gpt-oss's
per-head logit, joins the max and the sum). Costlier than the default backend (keys
are gathered per query, not per request; no shared-prefix pass); `benchmarks/step_cost.py`
prints what it costs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from radixlm.runtime.utils import ragged_arange
from radixlm.runtime.worker.attention.base import AttentionBackend
from radixlm.runtime.worker.attention.torch_backend import gather, soft_cap
from radixlm.runtime.worker.forward_batch import ForwardBatch

KEY_BLOCK = 64
# queries attended at once: bounds the memory of the gathered keys; the result does not depend on it
QUERY_SLICE = 32


class InvariantMeta(NamedTuple):
    slots: torch.Tensor  # [T, blocks * KEY_BLOCK] each token's key slots (padding: its first key, masked)
    visible: torch.Tensor  # [T, blocks * KEY_BLOCK] True for keys 0..the token's position
    blocks: list[int]  # per query slice, the blocks its longest context needs
    positions: torch.Tensor  # [T] each token's position


class InvariantAttention(AttentionBackend):
    def prepare(self, fb: ForwardBatch) -> None:
        positions = torch.repeat_interleave(fb.prefix_lens, fb.extend_lens) + ragged_arange(fb.extend_lens)
        width = -(-fb.max_seq_len // KEY_BLOCK) * KEY_BLOCK
        key_pos = torch.arange(width, device=positions.device)
        visible = key_pos[None, :] <= positions[:, None]
        longest = positions.tolist()
        blocks = [max(longest[i : i + QUERY_SLICE]) // KEY_BLOCK + 1 for i in range(0, len(longest), QUERY_SLICE)]
        fb.attn_meta = InvariantMeta(_key_slots(fb, fb.req_to_token.table, visible), visible, blocks, positions)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
                fb: ForwardBatch, window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        table, out_slots = fb.kv_layout(window)
        fb.kv_pool.store(layer, out_slots, k, v)
        meta: InvariantMeta = fb.attn_meta
        if window is not None:  # a sliding layer: the same keys, those a window behind hidden too
            if window not in fb.window_meta:
                key_pos = torch.arange(meta.visible.shape[1], device=meta.positions.device)
                visible = meta.visible & (key_pos[None, :] > meta.positions[:, None] - window)
                slots = meta.slots if table is fb.req_to_token.table else _key_slots(fb, table, visible)
                fb.window_meta[window] = meta._replace(slots=slots, visible=visible)
            meta = fb.window_meta[window]
        k_pool, v_pool, kv = fb.kv_pool.k[layer], fb.kv_pool.v[layer], fb.kv_pool.dtype
        tokens, heads, dim = q.shape
        kv_heads = k_pool.shape[1]
        group = heads // kv_heads
        qg = q.float().view(tokens, kv_heads, 1, group, dim) * scale
        sink = None if sinks is None else sinks.float().view(1, kv_heads, 1, group, 1)
        out = torch.empty(tokens, kv_heads, group, dim, dtype=torch.float32, device=q.device)
        for i, blocks in enumerate(meta.blocks):
            part = slice(i * QUERY_SLICE, (i + 1) * QUERY_SLICE)
            n, width = qg[part].shape[0], blocks * KEY_BLOCK
            slots, visible = meta.slots[part, :width], meta.visible[part, :width]
            # one contiguous bmm of [group, d] x [d, KEY_BLOCK] per (query, KV head, block): strided or
            # broadcast operands let torch pick other kernels, whose sums differ in the last bit
            keys = kv.decode(gather(k_pool, slots), torch.float32).view(n, blocks, KEY_BLOCK, kv_heads, dim)
            values = kv.decode(gather(v_pool, slots), torch.float32).view(n, blocks, KEY_BLOCK, kv_heads, dim)
            keys, values = keys.permute(0, 3, 1, 4, 2), values.permute(0, 3, 1, 2, 4)
            queries = qg[part].expand(n, kv_heads, blocks, group, dim).contiguous().view(-1, group, dim)
            scores = torch.bmm(queries, keys.contiguous().view(-1, dim, KEY_BLOCK)).view(n, kv_heads, blocks, group, KEY_BLOCK)
            scores = soft_cap(scores, softcap)
            scores = scores.masked_fill_(~visible.view(n, 1, blocks, 1, KEY_BLOCK), float("-inf"))
            top = scores.amax(dim=(2, 4), keepdim=True)  # exact: the same whatever the padding
            if sink is not None:  # gpt-oss: one more logit in the softmax, with no value
                top = torch.maximum(top, sink)
            p = torch.exp(scores - top)
            norm = p.sum(-1).cumsum(2)[:, :, -1]  # [n, kv_heads, group], block by block in order
            if sink is not None:
                norm = norm + torch.exp(sink - top).view(n, kv_heads, group)
            acc = torch.bmm(p.view(-1, group, KEY_BLOCK), values.contiguous().view(-1, KEY_BLOCK, dim))
            acc = acc.view(n, kv_heads, blocks, group, dim).cumsum(2)[:, :, -1]  # [n, kv_heads, group, d]
            out[part] = acc / norm[..., None]
        return out.view(tokens, heads, dim).to(q.dtype)



def _key_slots(fb: ForwardBatch, table: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Each token's key slots in `table`, [T, width]: those it cannot see read position 0's (a slot
    in the pool whatever it holds: masked out)."""
    owner = torch.repeat_interleave(fb.req_rows, fb.extend_lens)
    key_pos = torch.arange(visible.shape[1], device=visible.device).clamp(max=table.shape[1] - 1)
    slots = table[owner[:, None], key_pos[None, :]]
    return torch.where(visible, slots, slots[:, :1])
