"""A step's tokens as tensors, and the forward pass's view of them.

`StepTokens`: which tokens a step runs and where their K/V goes, the fields every
tensor-parallel rank receives (`parallel.send_batch` sends exactly these). Two batches extend it, one per
boundary: `WorkerBatch` (scheduler → worker: plus the rows to sample and how) and
`ForwardBatch` (worker → model and attention backend: plus the KV pool and the backend's
metadata), built from a step by `ForwardBatch.of`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from radixlm.runtime.cache.kv_pool import KVPool, ReqToTokenTable
    from radixlm.runtime.worker.attention.base import AttentionBackend
    from radixlm.runtime.worker.sampler import SamplingBatch


FUTURE_BASE = -2  # the first future token id (-1 is draft_model.DRAFT_PENDING)


def future_id(sample_row: int) -> int:
    """The placeholder of the token a step samples in `sample_row`, for a step built before it is known."""
    return FUTURE_BASE - sample_row


class ForwardMode(Enum):
    EXTEND = "extend"  # new tokens after a (possibly empty) cached prefix: prefill chunks, decode rows beside them
    DECODE = "decode"  # exactly one new token per request


@dataclass
class StepTokens:
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

    @property
    def batch_size(self) -> int:
        return self.req_rows.shape[0]


@dataclass
class WorkerBatch(StepTokens):
    """What the scheduler hands the worker for one step (all tensors on the worker's device): the
    step's tokens, the rows whose next token is sampled and how, the prompt logprobs asked for."""

    sample_rows: torch.Tensor  # [S] packed-token index whose hidden state predicts a request's next token
    sampling: SamplingBatch | None  # for those S rows
    return_logprob: bool = False
    top_logprobs_num: int = 0
    prompt_rows: torch.Tensor | None = None  # [P] packed-token indices whose next-token logprob is wanted
    prompt_targets: torch.Tensor | None = None  # [P] the token that follows each of them
    embed_rows: torch.Tensor | None = None  # [E] packed-token indices whose final hidden state is pooled
    window_slots: torch.Tensor | None = None  # [T] out_slots in the sliding layers' slot space (window pages)
    # LoRA (lora.py): the step's adapters, and each token's index among them (-1: the base model);
    # None where no row has one
    lora_names: list[str] = field(default_factory=list)
    lora_rows: torch.Tensor | None = None
    # overlap scheduling: input ids <= FUTURE_BASE are the previous step's sampled tokens, not yet
    # known when this step was built (-(id - FUTURE_BASE) is the sample row), read on the device
    future_ids: bool = False
    # verify rows whose drafts the draft model makes in this step (draft_model.py):
    draft_rows: torch.Tensor | None = None  # [D] their batch rows
    draft_starts: torch.Tensor | None = None  # [D] packed index of each one's last real token
    draft_lens: list[int] = field(default_factory=list)  # [D] the drafts each one gets


@dataclass
class ForwardBatch(StepTokens):
    """What one forward pass reads: the step's tokens and the pool they attend over."""

    kv_pool: KVPool
    req_to_token: ReqToTokenTable
    attn_backend: AttentionBackend
    attn_meta: Any = field(default=None)  # filled by the backend's prepare()
    window_meta: dict[int, Any] = field(default_factory=dict)  # the same for sliding layers, by window
    window_slots: torch.Tensor | None = None  # WorkerBatch's: where sliding layers store (window pages)

    @classmethod
    def of(cls, step: StepTokens, kv_pool: KVPool, req_to_token: ReqToTokenTable,
           attn_backend: AttentionBackend) -> ForwardBatch:
        return cls(**{f.name: getattr(step, f.name) for f in fields(StepTokens)}, kv_pool=kv_pool,
                   req_to_token=req_to_token, attn_backend=attn_backend,
                   window_slots=getattr(step, "window_slots", None))

    def kv_layout(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The token table and this step's store slots of a layer: a sliding layer's (`window`)
        are the window space's where the pool keeps one (allocator.WindowedPageAllocator)."""
        if window is not None and self.window_slots is not None:
            return self.req_to_token.window_table, self.window_slots
        return self.req_to_token.table, self.out_slots
