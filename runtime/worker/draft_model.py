"""A draft model: a smaller model of the same tokenizer that proposes speculative drafts.

It lives beside the target in the worker and uses the target's pages: its KV is a pool of its
own layers over the same slots, so the scheduler's allocator, token table and prefix cache serve
both, and the accounting does not change. The invariant that makes this work: every slot that
holds the target's KV also holds the draft's, for the same token. The worker keeps it by running
the draft over every step's tokens too (`shadow`), before the target: prefill chunks, decode
rows and verify rows alike (it computes no logits there, only KV). A prefix shared from the cache
therefore comes with the draft's KV as well.

A verify row's drafts are made in the step that checks them (`propose`): the scheduler gives the
row 1 + k tokens whose last k are placeholders (`DRAFT_PENDING`), and the slots for all of them;
the draft decodes k tokens greedily into those slots, one decode step of all the drafted rows at
a time, and writes its tokens over the placeholders before the target runs. Which drafts are kept
is the verify's business (scheduler/speculation.py): a proposal is kept only where the target
would have produced it, so the output does not depend on the draft model at all.
"""

from __future__ import annotations

import itertools

import torch

from radixlm.runtime.cache.kv_pool import KVPool, ReqToTokenTable
from radixlm.runtime.worker import gemm
from radixlm.runtime.worker.attention.base import AttentionBackend
from radixlm.runtime.worker.forward_batch import ForwardBatch, ForwardMode, StepTokens, WorkerBatch

DRAFT_PENDING = -1  # a verify row's input id that the draft model fills in during the step


class DraftModel:
    def __init__(self, model: torch.nn.Module, linear_mode: gemm.LinearMode, kv_pool: KVPool,
                 attn_backend: AttentionBackend) -> None:
        self.model = model
        self.linear_mode = linear_mode
        self.kv_pool = kv_pool
        self.attn_backend = attn_backend

    def _run(self, step: StepTokens, table: ReqToTokenTable) -> torch.Tensor:
        fb = ForwardBatch.of(step, self.kv_pool, table, self.attn_backend)
        self.attn_backend.prepare(fb)
        with gemm.linear_mode(self.linear_mode):
            return self.model(fb)

    def shadow(self, b: StepTokens, table: ReqToTokenTable) -> None:
        """The draft's KV for every token of the step (the target computes its own after)."""
        self._run(b, table)

    def propose(self, b: WorkerBatch, table: ReqToTokenTable) -> list[list[int]]:
        """Each drafted row's k tokens, decoded greedily from its last token and written into
        `b.input_ids` over the placeholders; returned in the order of `b.draft_starts`."""
        starts, lens, rows = b.draft_starts, b.draft_lens, b.draft_rows
        firsts = b.prefix_lens[rows].tolist()  # each drafted row's position of its last real token
        for j in range(max(lens)):
            live = [i for i, k in enumerate(lens) if k > j]  # rows still drafting at depth j
            pick = torch.tensor(live, dtype=torch.int64, device=starts.device)
            at = starts[pick] + j  # packed index of each live row's j-th input
            pre = b.prefix_lens[rows[pick]] + j
            step = StepTokens(
                mode=ForwardMode.DECODE, input_ids=b.input_ids[at], positions=b.positions[at], out_slots=b.out_slots[at],
                req_rows=b.req_rows[rows[pick]], prefix_lens=pre, extend_lens=torch.ones_like(pre), seq_lens=pre + 1,
                max_extend_len=1, max_seq_len=max(firsts[i] for i in live) + j + 1, num_decode=len(live))
            b.input_ids[at + 1] = self.model.compute_logits(self._run(step, table)).argmax(dim=-1)
        drafted = torch.cat([b.input_ids[s + 1 : s + 1 + k] for s, k in zip(starts.tolist(), lens)]).tolist()
        ends = list(itertools.accumulate(lens))
        return [drafted[e - k : e] for e, k in zip(ends, lens)]
