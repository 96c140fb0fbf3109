"""Reference attention over the paged KV pool with torch's scaled_dot_product_attention.

Requests are padded to one rectangle per step: queries to [B, heads, Qmax, d] and
keys/values gathered through the token table to [B, kv_heads, Kmax, d], with a
boolean mask that encodes both the padding and causality. The gather indices
and the mask are built once per step and reused by every layer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from runtime.worker.attention.base import AttentionBackend
from runtime.utils import ragged_arange
from runtime.worker.forward_batch import ForwardBatch, ForwardMode


class TorchAttnMeta(NamedTuple):
    kv_slots: torch.Tensor  # [B, Kmax] slot of each key position (padding points at a real, masked slot)
    query_dest: torch.Tensor | None  # [T] flat index of each packed token in the [B * Qmax] padded queries
    mask: torch.Tensor  # [B, 1, Qmax, Kmax] True where attention is allowed


class TorchAttention(AttentionBackend):
    def prepare(self, fb: ForwardBatch) -> None:
        kmax = fb.max_seq_len
        device = fb.input_ids.device
        kv_slots = fb.req_to_token.table[fb.req_rows, :kmax]
        key_pos = torch.arange(kmax, device=device)
        if fb.mode is ForwardMode.DECODE:
            mask = (key_pos[None, :] < fb.seq_lens[:, None])[:, None, None, :]
            fb.attn_meta = TorchAttnMeta(kv_slots, None, mask)
            return
        qmax = fb.max_extend_len
        q_idx = torch.arange(qmax, device=device)
        # token j of request b sits at absolute position prefix_b + j and sees keys 0..prefix_b + j
        limit = fb.prefix_lens[:, None] + q_idx[None, :]  # [B, Qmax]
        mask = key_pos[None, None, :] <= limit[:, :, None]
        # padded query rows attend to key 0 only, so softmax never sees an all-masked row
        valid_q = q_idx[None, :] < fb.extend_lens[:, None]
        mask = mask & valid_q[:, :, None] | (~valid_q[:, :, None] & (key_pos == 0)[None, None, :])
        starts = torch.arange(fb.batch_size, device=device) * qmax
        query_dest = torch.repeat_interleave(starts, fb.extend_lens) + ragged_arange(fb.extend_lens)
        fb.attn_meta = TorchAttnMeta(kv_slots, query_dest, mask[:, None])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
                fb: ForwardBatch) -> torch.Tensor:
        fb.kv_pool.store(layer, fb.out_slots, k, v)
        meta: TorchAttnMeta = fb.attn_meta
        bsz, heads, dim = fb.batch_size, q.shape[1], q.shape[2]
        keys = fb.kv_pool.k[layer][meta.kv_slots].transpose(1, 2)  # [B, kv_heads, Kmax, d]
        values = fb.kv_pool.v[layer][meta.kv_slots].transpose(1, 2)
        if meta.query_dest is None:  # decode: one query per request, no padding
            queries = q.view(bsz, 1, heads, dim).transpose(1, 2)
        else:
            padded = q.new_zeros(bsz * fb.max_extend_len, heads, dim)
            padded[meta.query_dest] = q
            queries = padded.view(bsz, fb.max_extend_len, heads, dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.mask, scale=scale,
                                             enable_gqa=heads != keys.shape[1])
        out = out.transpose(1, 2).reshape(-1, heads, dim)  # [B * Qmax, heads, d]
        return out if meta.query_dest is None else out[meta.query_dest]

