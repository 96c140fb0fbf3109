"""Batch building: one step's requests, in the worker's packed order, turned into tensors.

A step holds the running requests (each decodes its one token, or, after a jump-forward,
computes the KV of its forced tokens) and the prefill rows (the request being chunked, then
admissions). The worker sees one packed batch: every row with a single new token first
(`num_decode` of them: the attention backend runs those on its decode path), then the rows
with more. These are plain functions of the batch, the KV manager and the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from radixlm.runtime.constrained.grammar import fill_rows, grammar_bitmask
from radixlm.runtime.scheduler.kv_manager import KVManager, StepSlots
from radixlm.runtime.token_mask import allocate_mask
from radixlm.runtime.scheduler.req import Req
from radixlm.runtime.worker.forward_batch import ForwardMode, WorkerBatch
from radixlm.runtime.worker.sampler import PenaltyCounts, SamplingBatch
from radixlm.runtime.worker.staging import stage, to_device


@dataclass
class ScheduledBatch:
    """The scheduler's own record of a step: which requests run and with how many tokens. It never
    leaves the scheduler; `to_worker_batch` turns it into the `WorkerBatch` that crosses to the
    worker, and after the step the scheduler reads the results back against it."""

    reqs: list[Req]  # packed order: the num_decode one-token rows, then the rest
    extend_lens: list[int]
    num_decode: int
    prefilling: set[int]  # id() of the rows that were not running: the chunked request and admissions
    sampled: list[Req]  # requests that get a new token from this step, in packed order
    sample_counts: list[int]  # per sampled request, its sample rows: 1, or 1 + its drafts (a verify row)
    logprob_spans: list[tuple[Req, int, int]]  # (req, first prompt position, count) of prompt logprobs computed
    embed_spans: list[tuple[Req, int, int]] = field(default_factory=list)  # (req, first position, count) pooled
    num_verify: int = 0  # running rows that check drafts (speculation.py)
    prefill_tokens: int = 0  # the prefill rows' tokens
    new_pages: torch.Tensor | None = None  # the pages this step took, once it took them
    sampling: SamplingBatch | None = field(default=None, repr=False)

    @property
    def mode(self) -> ForwardMode:
        return ForwardMode.DECODE if self.num_decode == len(self.reqs) else ForwardMode.EXTEND

    def is_prefill(self, req: Req) -> bool:
        return id(req) in self.prefilling


def make_batch(running: list[Req], prefill: list[Req], prefill_lens: list[int]) -> ScheduledBatch:
    """The step's batch: every running request with all its uncomputed tokens (one, or a jump's
    forced text) and its drafts (speculation.py), and the prefill rows with the chunk each was given."""
    rows = [(r, r.extend_len + len(r.draft)) for r in running] + list(zip(prefill, prefill_lens))
    packed = [row for row in rows if row[1] == 1] + [row for row in rows if row[1] != 1]
    reqs = [r for r, _ in packed]
    lens = [n for _, n in packed]
    prefilling = {id(r) for r in prefill}
    sampled, counts, spans, embeds = [], [], [], []
    verify = 0
    for req, n in packed:
        if id(req) not in prefilling:  # running: its tokens end the sequence, its prompt logprobs are done
            sampled.append(req)
            counts.append(1 + len(req.draft))
            verify += bool(req.draft)
            continue
        if req.cached_len + n == req.seq_len and req.params.max_new_tokens > 0:
            sampled.append(req)
            counts.append(1)
        span = _logprob_span(req, n)
        if span is not None:
            spans.append(span)
        if req.embed == "mean":  # every prompt position of the chunk
            embeds.append((req, req.cached_len, n))
        elif req.embed == "last" and req.cached_len + n == req.prompt_len:  # the chunk that holds the last
            embeds.append((req, req.prompt_len - 1, 1))
    num_decode = sum(1 for n in lens if n == 1)
    return ScheduledBatch(reqs, lens, num_decode, prefilling, sampled, counts, spans, embed_spans=embeds,
                          num_verify=verify, prefill_tokens=sum(prefill_lens))


def _logprob_span(req: Req, n: int) -> tuple[Req, int, int] | None:
    """Hidden positions of this chunk whose next-token logprob belongs to the prompt logprobs."""
    if not req.wants_input_logprobs or req.input_logprobs_done:
        return None
    first = max(req.cached_len, req.logprob_start_len - 1, 0)
    last = min(req.cached_len + n, req.prompt_len - 1)
    return (req, first, last - first) if last > first else None


class PenaltyTracker:
    """Token counts of the requests that use penalties, kept on the device across steps by request
    row (`PenaltyCounts`): a row is counted in full when a request takes it (admission, a retracted
    request's return, outputs rewritten by jump-forward), then grows by each step's new tokens, so
    a step's cost does not grow with the context."""

    def __init__(self, rows: int, vocab_size: int, device: torch.device) -> None:
        self.rows, self.vocab_size, self.device = rows, vocab_size, device
        self._counts: PenaltyCounts | None = None  # made on first use: 5 bytes x vocabulary per row
        self._owner: dict[int, Req] = {}  # row -> the request its counts are of

    def counts_for(self, reqs: list[Req]) -> tuple[torch.Tensor, torch.Tensor] | None:
        users = [r for r in reqs if r.params.uses_penalties]
        if not users:
            return None
        if self._counts is None:
            self._counts = PenaltyCounts(self.rows, self.vocab_size, self.device)
        rows, tokens = [], []
        for r in users:
            out = r.output_ids
            if self._owner.get(r.row) is not r or not 0 <= r.penalty_counted <= len(out):
                self._counts.reset(r.row, r.prompt_ids, out)
                self._owner[r.row] = r
            else:
                rows.extend([r.row] * (len(out) - r.penalty_counted))
                tokens.extend(out[r.penalty_counted:])
            r.penalty_counted = len(out)
        if rows:
            self._counts.add(*stage([np.asarray(rows, np.int64), np.asarray(tokens, np.int64)], self.device))
        return self._counts.gather(to_device([r.row for r in reqs], torch.int64, self.device))


def sampling_batch(reqs: list[Req], eos_ids: list[int], vocab_size: int, device: torch.device,
                   penalties: PenaltyTracker | None = None, sample_counts: list[int] | None = None) -> SamplingBatch | None:
    """The sample rows' settings as tensors, with their constraints' allowed-token bitmask. A
    request with drafts has 1 + len(draft) rows: row j is sampled as its step after the first j
    drafts (that output length, seed step and min-tokens block, that constraint state)."""
    if not reqs:
        return None
    verifies = sample_counts is not None and len(sample_counts) < sum(sample_counts)
    rows, lens = reqs, None
    if verifies:
        rows = [r for r, c in zip(reqs, sample_counts) for _ in range(c)]
        lens = [len(r.output_ids) + j for r, c in zip(reqs, sample_counts) for j in range(c)]  # j drafts ahead
    counts = penalties.counts_for(rows) if penalties is not None else None  # (no verify row has penalties)
    batch = SamplingBatch.build([r.params for r in rows], [r.prompt_ids for r in rows], [r.output_ids for r in rows],
                                eos_ids, vocab_size, device, counts, output_lens=lens)
    mask = _draft_masks(reqs, sample_counts, vocab_size) if verifies else grammar_bitmask([r.guide for r in reqs], vocab_size)
    batch.grammar_mask = None if mask is None else to_device(mask, torch.int32, device)
    return batch


def _draft_masks(reqs: list[Req], sample_counts: list[int], vocab_size: int) -> torch.Tensor | None:
    """Allowed-token bits of every sample row: a verify row's j-th from its constraint after its
    first j drafts (the matcher walks them and rolls back), the others' as `grammar_bitmask`'s."""
    if all(r.guide is None for r in reqs):
        return None
    at = [0]
    for c in sample_counts:
        at.append(at[-1] + c)
    mask = allocate_mask(at[-1], vocab_size)
    fill_rows(mask, [(at[i], r.guide) for i, (r, c) in enumerate(zip(reqs, sample_counts)) if r.guide is not None and c == 1])
    for i, (req, c) in enumerate(zip(reqs, sample_counts)):
        if req.guide is None or c == 1:
            continue
        for j in range(c):
            req.guide.fill_mask(mask[at[i] + j : at[i] + j + 1])
            if j < c - 1:
                req.guide.advance(req.draft[j])
        req.guide.rollback(c - 1)
    return mask


def to_worker_batch(b: ScheduledBatch, kv: KVManager, device: torch.device) -> WorkerBatch:
    """The tensors of one step, one per field, sent in one copy. Takes the step's KV slots (pages
    when needed), kept in `b.new_pages` so that a fault can hand them back."""
    d = b.num_decode
    starts = np.fromiter((r.cached_len for r in b.reqs), np.int64, len(b.reqs))
    lens = np.asarray(b.extend_lens, dtype=np.int64)
    ids = [r.token_at(r.cached_len) for r in b.reqs[:d]]
    drafted: list[tuple[int, int, int]] = []  # (batch row, packed index of its last token, k) per model-drafted row
    for i, (req, n) in enumerate(zip(b.reqs[d:], b.extend_lens[d:]), start=d):
        draft = [] if b.is_prefill(req) else req.draft
        if draft and req.drafts_pending:
            drafted.append((i, len(ids) + n - len(draft) - 1, len(draft)))
        ids.extend(req.tokens(req.cached_len, req.cached_len + n - len(draft)))
        ids.extend(draft)
    if d == len(b.reqs) and len(b.sampled) == d:
        sample_rows = np.arange(d)
    else:
        sample_rows = _last_rows(b, lens)
    plan, new_pages = StepSlots.host_arrays(starts, lens, kv.page_size)
    rows = np.fromiter((r.row for r in b.reqs), np.int64, len(b.reqs))
    (rows_t, ext_t, seq_t, ids_t, sample_t, starts_t, token_row, token_index, positions, page_index,
     page_offset) = stage([rows, lens, starts + lens, np.asarray(ids, dtype=np.int64), sample_rows, *plan], device)
    kv.drop_windows(b.reqs, starts)  # (sliding-window models) what the rows' windows left behind
    b.new_pages = kv.alloc_pages(new_pages)  # from here a fault hands them back
    out_slots, window_slots = kv.step_slots(rows_t, StepSlots(starts_t, token_row, token_index, positions, page_index,
                                                              page_offset, new_pages), b.new_pages)
    wb = WorkerBatch(
        mode=b.mode, input_ids=ids_t, positions=positions, out_slots=out_slots, window_slots=window_slots, req_rows=rows_t,
        prefix_lens=starts_t, extend_lens=ext_t, seq_lens=seq_t, max_extend_len=int(lens.max()),
        max_seq_len=int((starts + lens).max()), num_decode=d, sample_rows=sample_t, sampling=b.sampling,
        return_logprob=any(r.return_logprob for r in b.sampled) or bool(b.logprob_spans),
        top_logprobs_num=max([r.top_logprobs_num for r in b.reqs if r.return_logprob] or [0]),
    )
    if any(r.lora is not None for r in b.reqs):  # each token's adapter, among the step's
        wb.lora_names = sorted({r.lora for r in b.reqs if r.lora is not None})
        index = {name: i for i, name in enumerate(wb.lora_names)}
        per_req = np.fromiter((-1 if r.lora is None else index[r.lora] for r in b.reqs), np.int64, len(b.reqs))
        (wb.lora_rows,) = stage([np.repeat(per_req, lens)], device)
    if b.logprob_spans:
        wb.prompt_rows, wb.prompt_targets = _prompt_logprob_inputs(b, device)
    if b.embed_spans:
        offset_of = _position_zero(b)
        rows_ = [offset_of[id(req)] + p for req, first, count in b.embed_spans for p in range(first, first + count)]
        (wb.embed_rows,) = stage([np.asarray(rows_, np.int64)], device)
    if drafted:
        rows_, starts_, wb.draft_lens = (list(t) for t in zip(*drafted))
        wb.draft_rows, wb.draft_starts = stage([np.asarray(rows_, np.int64), np.asarray(starts_, np.int64)], device)
    return wb


def _last_rows(b: ScheduledBatch, lens: np.ndarray) -> np.ndarray:
    """Packed index of each sampled request's last new token, or of its last 1 + len(draft)
    (sampled keeps the packed order)."""
    ends = np.cumsum(lens)
    count = {id(r): c for r, c in zip(b.sampled, b.sample_counts)}
    rows = []
    for r, e in zip(b.reqs, ends.tolist()):
        c = count.get(id(r))
        if c:
            rows.extend(range(e - c, e))
    return np.asarray(rows, dtype=np.int64)


def _position_zero(b: ScheduledBatch) -> dict[int, int]:
    """id(req) -> the packed index its position 0 would have (its first new token's, minus its
    cached length)."""
    offset_of, offset = {}, 0
    for req, n in zip(b.reqs, b.extend_lens):
        offset_of[id(req)] = offset - req.cached_len
        offset += n
    return offset_of


def _prompt_logprob_inputs(b: ScheduledBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed-token rows whose hidden state scores the next prompt token, and those tokens."""
    offset_of = _position_zero(b)
    rows: list[int] = []
    targets: list[int] = []
    for req, first, count in b.logprob_spans:
        base = offset_of[id(req)]
        rows.extend(range(base + first, base + first + count))
        targets.extend(req.prompt_ids[first + 1 : first + 1 + count])
    rows_t, targets_t = stage([np.asarray(rows, np.int64), np.asarray(targets, np.int64)], device)
    return rows_t, targets_t
