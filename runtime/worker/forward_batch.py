"""Everything one forward pass needs, as tensors: built once per step by the worker."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from radixlm.runtime.cache.kv_pool import KVPool, ReqToTokenTable
    from radixlm.runtime.worker.attention.base import AttentionBackend


class ForwardMode(Enum):
    EXTEND = "extend"  # new tokens after a (possibly empty) cached prefix: prefill chunks, decode rows beside them
    DECODE = "decode"  # exactly one new token per request


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] tokens of all requests, packed
    positions: torch.Tensor  # [T]
    out_slots: torch.Tensor  # [T] KV slot each new token's K/V is written to
    req_rows: torch.Tensor  # [B] rows of the request -> token table
    prefix_lens: torch.Tensor  # [B] tokens already in the pool before this step
    extend_lens: torch.Tensor  # [B] new tokens this step
    seq_lens: torch.Tensor  # [B] prefix + extend
    max_extend_len: int
    max_seq_len: int
    num_decode: int  # rows [0, num_decode) have one new token each and come first (every row in DECODE)
    kv_pool: KVPool
    req_to_token: ReqToTokenTable
    attn_backend: AttentionBackend
    attn_meta: Any = field(default=None)  # filled by the backend's prepare()

    @property
    def batch_size(self) -> int:
        return self.req_rows.shape[0]
