"""Attention on radixlm's native CPU kernels (kernels/cpu): the CPU default where they are built.

Per layer, one call rotates the step's q and k in the qkv projection and writes k and v to the
pool (`rope_store`), one more attends the decode rows (`decode_attention`: each row's query heads
over their keys read in place through the token table, no gather, no padding), and one the
extend rows' new tokens (`extend_attention`: prefill chunks, jump-forward text; the same table,
a row's tokens and one KV head's query heads attended together a block of keys at a time).
Nothing is gathered, padded or masked in torch, and nothing is planned per step but the rows'
lengths. The pool may be of any KV type the kernels read (`--kv-cache-dtype` fp32, fp16, bf16,
int8): rope_store writes rows in it and the attention kernels convert them as they load them. Models with q/k norms (Qwen3) rotate in the model and call `forward`, which stores with
torch and attends the same way. Sliding layers pass their window (each token's last `window`
keys, through the window space's table where the pool keeps one); soft-capped scores (Gemma 2)
are capped in the kernels too, and gpt-oss's sinks join their softmax there.

`invariant` (--deterministic): every token, decode or prefill, is one query of the decode
kernel over its keys up to its own position, so a token's attention is bitwise the same
whatever its step holds, however its prompt was chunked and whether it is decoded or
re-prefilled after a retraction; and the matmuls on the codes are batch invariant as they are.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from radixlm.kernels import cpu
from radixlm.runtime.worker.attention.base import AttentionBackend
from radixlm.runtime.worker.forward_batch import ForwardBatch


class InvariantMeta(NamedTuple):
    rows: torch.Tensor  # [T] each token's row of the token table
    lens: torch.Tensor  # [T] its position + 1: the keys it sees


class NativeMeta(NamedTuple):
    num_decode: int  # the step's first rows, one token each
    extend_rows: torch.Tensor | None  # [E] the other rows' token-table rows (None: no extend row)
    prefix_lens: torch.Tensor | None  # [E] their tokens already in the pool
    extend_lens: torch.Tensor | None  # [E] their new tokens


class NativeAttention(AttentionBackend):
    fuses_rotary = True

    def __init__(self, invariant: bool = False) -> None:
        cpu.load()
        self.invariant = invariant
        self._rope_store = torch.ops.radixlm.rope_store.default
        self._decode = torch.ops.radixlm.decode_attention.default
        self._extend = torch.ops.radixlm.extend_attention.default

    def prepare(self, fb: ForwardBatch) -> None:
        if self.invariant:  # every token a query over its keys up to itself
            fb.attn_meta = InvariantMeta(torch.repeat_interleave(fb.req_rows, fb.extend_lens), fb.positions + 1)
            return
        d = fb.num_decode
        if d == fb.batch_size:
            fb.attn_meta = NativeMeta(d, None, None, None)
        else:
            fb.attn_meta = NativeMeta(d, fb.req_rows[d:].contiguous(), fb.prefix_lens[d:].contiguous(),
                                      fb.extend_lens[d:].contiguous())

    def forward_qkv(self, qkv: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor, heads: int, kv_heads: int,
                    layer: int, scale: float, fb: ForwardBatch, window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        k_pool, v_pool = fb.kv_pool.k_heads[layer], fb.kv_pool.v_heads[layer]
        self._rope_store(qkv, fb.positions, cos2, sin2, k_pool, v_pool, fb.kv_layout(window)[1], heads, kv_heads, -1)
        return self._attend(qkv[:, : heads * fb.kv_pool.head_dim], k_pool, v_pool, scale, fb, window, softcap, sinks)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
                fb: ForwardBatch, window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        fb.kv_pool.store(layer, fb.kv_layout(window)[1], k, v)
        k_pool, v_pool = fb.kv_pool.k_heads[layer], fb.kv_pool.v_heads[layer]
        heads, dim = q.shape[1], q.shape[2]
        out = self._attend(q.reshape(-1, heads * dim), k_pool, v_pool, scale, fb, window, softcap, sinks)
        return out.view(-1, heads, dim)

    def _attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, scale: float,
                fb: ForwardBatch, window: int | None, softcap: float | None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, heads * d] (rows may be strided) -> [T, heads * d]."""
        meta = fb.attn_meta
        table = fb.kv_layout(window)[0]
        w, cap = window or 0, softcap or 0.0
        if isinstance(meta, InvariantMeta):
            return self._decode(q, k_pool, v_pool, table, meta.rows, meta.lens, scale, -1, w, cap, sinks)
        d = meta.num_decode
        if meta.extend_rows is None:
            return self._decode(q, k_pool, v_pool, table, fb.req_rows, fb.seq_lens, scale, -1, w, cap, sinks, False)
        out = q.new_empty(q.shape[0], q.shape[1])
        if d:
            out[:d] = self._decode(q, k_pool, v_pool, table, fb.req_rows[:d], fb.seq_lens[:d], scale, -1, w, cap,
                                   sinks, False)
        self._extend(q[d:], k_pool, v_pool, table, meta.extend_rows, meta.prefix_lens, meta.extend_lens, scale, out[d:],
                     -1, w, cap, sinks)
        return out
