"""Attention with the Triton kernels in `kernels/`: the K/V store, extend and split-KV decode.

The default on CUDA. On a CPU it runs only under Triton's interpreter
(TRITON_INTERPRET=1 set before triton is first imported): slow, for tests. Pools of
every KV type: rows converted to the pool's type before the store (`KVDtype.encode`),
and back as the kernels load them.
"""

from __future__ import annotations

import torch

from radixlm.kernels.common import interpreting
from radixlm.runtime.worker.attention.base import AttentionBackend
from radixlm.runtime.worker.forward_batch import ForwardBatch, ForwardMode

# context splits per request in decode (merged in a second, tiny kernel); the interpreter runs
# each program in Python, so there fewer is faster
DECODE_SPLITS = 2 if interpreting() else 8


class TritonAttention(AttentionBackend):
    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" and not interpreting():
            raise RuntimeError("the triton attention backend needs CUDA, or on a CPU Triton's interpreter: "
                               "set TRITON_INTERPRET=1 before starting (slow; for tests), or use --attention-backend torch")
        from radixlm.kernels.decode_attention import decode_attention, decode_workspace
        from radixlm.kernels.extend_attention import extend_attention
        from radixlm.kernels.kv_store import store_kv

        self._decode, self._extend, self._store = decode_attention, extend_attention, store_kv
        self._make_workspace = decode_workspace
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None  # decode's splits, once reserved

    def reserve(self, batch: int, heads: int, dim: int, device: torch.device) -> None:
        """Allocate decode's intermediate buffers for up to `batch` requests once, before CUDA graphs
        capture steps that use them; larger decode batches allocate their own."""
        self._workspace = self._make_workspace(batch, heads, dim, DECODE_SPLITS, device)

    def _splits(self, batch: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        w = self._workspace
        return w if w is not None and w[0].shape[0] >= batch else None

    def prepare(self, fb: ForwardBatch) -> None:
        fb.attn_meta = None  # the kernels read the batch's own tensors

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
                fb: ForwardBatch, window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        if window is not None or softcap is not None or sinks is not None:
            raise NotImplementedError("the triton attention backend has no sliding window, soft cap or sinks")
        k_cache, v_cache = fb.kv_pool.k[layer], fb.kv_pool.v[layer]
        kv = fb.kv_pool.dtype
        self._store(k_cache, v_cache, fb.out_slots, kv.encode(k).contiguous(), kv.encode(v).contiguous())
        q = q.contiguous()
        table = fb.req_to_token.table
        if fb.mode is ForwardMode.DECODE:
            return self._decode(q, k_cache, v_cache, table, fb.req_rows, fb.seq_lens, scale,
                                num_splits=DECODE_SPLITS, workspace=self._splits(q.shape[0]))
        d = fb.num_decode
        if not d:
            return self._extend(q, k_cache, v_cache, table, fb.req_rows, fb.prefix_lens, fb.extend_lens, scale,
                                max_extend_len=fb.max_extend_len)
        # a mixed batch: its one-token rows (packed first) on the split-KV decode kernel
        out = torch.empty_like(q)
        self._decode(q[:d], k_cache, v_cache, table, fb.req_rows[:d], fb.seq_lens[:d], scale,
                     num_splits=DECODE_SPLITS, out=out[:d], workspace=self._splits(d))
        self._extend(q[d:], k_cache, v_cache, table, fb.req_rows[d:], fb.prefix_lens[d:], fb.extend_lens[d:], scale,
                     max_extend_len=fb.max_extend_len, out=out[d:])
        return out
