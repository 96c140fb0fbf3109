"""The scheduler: one event loop step at a time, it picks a batch, runs it, and processes the results.

Prefill goes first (chunked when a prompt is longer than the chunk budget), else
every running request decodes one token; when jump-forward appended forced text
to some of them, that step is one extend batch instead, in which those requests
compute the KV of all their new tokens and the others of their one. Requests
are admitted only when their KV fits; when decode runs out of pages the least
advanced requests are retracted to the front of the queue (their tokens kept)
and prefilled again later. The scheduler does no I/O: `add_request`, `abort`
and `step` are its API.
"""

from __future__ import annotations

import logging
import select
import uuid
from dataclasses import dataclass
from typing import Callable

import torch
from outlines_core import Guide

from runtime.args import ServerArgs
from runtime.constrained.grammar import (
    GrammarCompiler,
    GrammarError,
    constraint_key,
    grammar_bitmask,
)
from runtime.constrained.jump_forward import RETOKENIZE_TOKENS, Forced, JumpForward
from runtime.messages import TokenizedRequest, TokenOutput
from runtime.scheduler.kv_manager import KVManager, pages_for
from runtime.scheduler.policy import Budget, order_waiting, reserved_decode_tokens
from runtime.scheduler.req import Finish, FinishKind, Req
from runtime.utils import ragged_arange
from runtime.worker.forward_batch import ForwardMode
from runtime.worker.model_worker import ModelWorker, WorkerBatch, WorkerOutput
from runtime.worker.sampler import SamplingBatch

log = logging.getLogger(__name__)

# A waiting request that shares this many uncached tokens with one admitted in the same
# step waits a step instead, so that it reuses that request's prefill.
IN_BATCH_SHARE_MIN = 32


class RequestError(ValueError):
    """A request the scheduler cannot take (the message says why)."""


class DeviceLost(RuntimeError):
    """The model raised and the device cannot serve on (see ModelWorker.usable_after_fault): the
    process must end so that the server stops instead of failing every request from now on."""


@dataclass
class ScheduledBatch:
    mode: ForwardMode
    reqs: list[Req]
    extend_lens: list[int]
    sampled: list[Req]  # requests that get a new token from this step, in sample-row order
    logprob_spans: list[tuple[Req, int, int]]  # (req, first prompt position, count) of prompt logprobs computed
    mixed: bool = False  # decode step as an extend batch, for requests jump-forward extended
    slotted: int = 0  # how many of `reqs` (in order) have been given KV slots for this step


class Scheduler:
    def __init__(self, args: ServerArgs, worker: ModelWorker, decode: Callable[[list[int]], str] | None = None,
                 grammar: Callable[[], GrammarCompiler] | None = None) -> None:
        """`grammar` makes the constraint compiler on first use (building the vocabulary takes a moment);
        without it, constrained requests are refused."""
        self.args = args
        self._make_grammar = grammar
        self._grammar: GrammarCompiler | None = None
        self.pending: list[Req] = []  # waiting for their constraint to compile
        self.worker = worker
        self.decode = decode  # token ids -> text, for stop strings
        self.device = worker.device
        self.context_length = worker.context_length
        self.eos_ids = list(worker.config.eos_token_ids)
        self.kv = KVManager(worker.num_pages, worker.page_size, worker.req_to_token,
                            not args.disable_radix_cache, worker.device)
        self.waiting: list[Req] = []
        self.running: list[Req] = []  # decoding
        self.chunked: Req | None = None  # mid-prefill between chunks
        self.new_token_ratio = args.init_new_token_ratio
        self._arrivals = 0
        self.num_retractions = 0
        self.jump_forward = not args.disable_jump_forward
        # counters: batches run, the sum of their sizes (a request's forward passes), tokens jumped
        self.forward_passes = 0
        self.request_passes = 0
        self.jumped_tokens = 0
        self._ended: list[TokenOutput] = []  # outputs of requests ended while scheduling
        self._live: dict[str, Req] = {}  # every request not yet ended, by id

    # ---- API ---------------------------------------------------------------------------------

    def add_request(self, tr: TokenizedRequest) -> None:
        if not tr.input_ids:
            raise RequestError("the prompt is empty")
        if len(tr.input_ids) >= self.context_length:
            raise RequestError(
                f"the prompt has {len(tr.input_ids)} tokens; the context length is {self.context_length} "
                "(prompt plus at least one new token must fit)"
            )
        vocab = self.worker.config.vocab_size
        if max(tr.input_ids) >= vocab or min(tr.input_ids) < 0:
            raise RequestError(f"input token ids must lie in [0, {vocab})")
        if tr.rid in self._live:
            raise RequestError(f"request id {tr.rid!r} is already in flight")
        if pages_for(len(tr.input_ids), self.kv.page_size) > self.kv.num_pages:
            raise RequestError(f"the prompt has {len(tr.input_ids)} tokens; the KV cache pool holds "
                               f"{self.kv.num_pages * self.kv.page_size} (raise --max-total-tokens)")
        tr.sampling_params.validate(vocab)
        room = self.context_length - len(tr.input_ids)
        if tr.sampling_params.max_new_tokens > room:
            raise RequestError(
                f"max_new_tokens={tr.sampling_params.max_new_tokens} does not fit: the prompt has "
                f"{len(tr.input_ids)} tokens and the context length is {self.context_length}, so at most {room}"
            )
        req = Req(tr, self._arrivals)
        req.grammar_key = constraint_key(tr.sampling_params)
        if req.grammar_key is not None:
            self._compiler().submit(req.grammar_key)
        self._live[tr.rid] = req
        (self.pending if req.grammar_key is not None else self.waiting).append(req)
        self._arrivals += 1

    def abort(self, rid: str) -> TokenOutput | None:
        """End a request wherever it is; returns its final output, or None if it is unknown."""
        req = self._live.get(rid)
        if req is None:
            return None
        self._dequeue(req)
        return self._end(req, Finish(FinishKind.ABORT, "aborted"))

    def fail_all(self, message: str) -> list[TokenOutput]:
        """Final outputs (500s) for every request in flight, touching no device memory: for a
        scheduler that is about to exit because its device is gone."""
        outputs = [TokenOutput(rid=req.rid, new_token_ids=[], prompt_tokens=req.prompt_len,
                               completion_tokens=len(req.output_ids), cached_tokens=req.cached_tokens,
                               finish_reason={"type": "abort", "message": message, "status": 500})
                   for req in self._live.values()]
        self._live.clear()
        return outputs

    def _dequeue(self, req: Req) -> None:
        if req is self.chunked:
            self.chunked = None
        if req in self.pending:
            self._leave_pending(req)
        for queue in (self.waiting, self.running):
            if req in queue:
                queue.remove(req)

    def _leave_pending(self, req: Req) -> None:
        self.pending.remove(req)
        self.grammar.forget(req.grammar_key)  # a compile that no one else waits on may be dropped

    @property
    def grammar(self) -> GrammarCompiler:
        """The constraint compiler; only after a constrained request was admitted (`_compiler`)."""
        assert self._grammar is not None
        return self._grammar

    def _compiler(self) -> GrammarCompiler:
        if self._grammar is None:
            if self._make_grammar is None:
                raise RequestError("constrained decoding (regex, json_schema) needs a tokenizer")
            try:
                self._grammar = self._make_grammar()
            except Exception as e:  # noqa: BLE001 - e.g. a model without an EOS token: refuse, serve on
                log.exception("the constraint compiler could not start")
                raise RequestError(f"constrained decoding is not available for this model: {e}") from None
        return self._grammar

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.pending)

    @property
    def has_runnable_work(self) -> bool:
        """Whether `step` has something to do now; else only constraints are compiling (`compile_wakeup_fd`)."""
        return bool(self.waiting or self.running or self.chunked or self._ended)

    @property
    def compile_wakeup_fd(self) -> int | None:
        """Readable once a constraint compile has ended: what a caller with nothing runnable sleeps on."""
        return self._grammar.ready_fd if self.pending else None

    def wait_for_constraints(self, timeout: float) -> None:
        """Sleep until a constraint compile ends (or `timeout`), when nothing else is runnable."""
        fd = self.compile_wakeup_fd
        if fd is not None and not self.has_runnable_work:
            select.select([fd], [], [], timeout)
            self.grammar.drain_ready()

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.pending) + (self.chunked is not None)

    def step(self) -> list[TokenOutput]:
        """Run one batch; returns the outputs of every request that advanced."""
        if self.pending:
            self._promote_compiled()
        batch = self._schedule_prefill() or self._schedule_jumped() or self._schedule_decode()
        if batch is None:
            ended, self._ended = self._ended, []
            return ended
        # NOTE: everything from here to the results is inside the fault boundary: a fault fails
        # this batch's requests alone, unless it leaves the device unusable
        try:
            worker_batch = self._to_worker_batch(batch)
        except Exception:  # noqa: BLE001 - our own code raised on this batch: it fails, the rest serve on
            return self._fail(batch, "building the batch")
        try:
            result = self.worker.forward(worker_batch)
        except Exception as e:  # noqa: BLE001 - as above, unless the device is gone
            if not self.worker.usable_after_fault():
                raise DeviceLost(f"the model raised and the device is unusable: {type(e).__name__}: {e}") from e
            return self._fail(batch, "running the model")
        self.forward_passes += 1
        self.request_passes += len(batch.reqs)
        outputs = self._process(batch, result)
        if self.args.debug_accounting:
            self.check_accounting()
        return outputs

    def _promote_compiled(self) -> None:
        """Requests whose constraint finished compiling join the queue (or fail with its error)."""
        for req in list(self.pending):
            try:
                result = self.grammar.poll(req.grammar_key)
                if result is None:
                    continue
                self._leave_pending(req)
                if isinstance(result, GrammarError):
                    self._ended.append(self._end(req, Finish(FinishKind.ABORT, str(result), status=400)))
                    continue
                req.grammar = result
                req.guide = Guide(result.index, max_rollback=RETOKENIZE_TOKENS)
            except Exception:  # noqa: BLE001 - one request's constraint must not stop the scheduler
                self._dequeue(req)
                self._ended.append(self._end(req, self._internal_error(req, "starting its constraint")))
                continue
            self.waiting.append(req)

    def shutdown(self) -> None:
        if self._grammar is not None:
            self._grammar.shutdown()

    def check_accounting(self) -> None:
        self.kv.check_accounting(self._reqs_with_rows())

    def flush_cache(self) -> bool:
        """Drop every cached prefix; only possible when no request is in flight."""
        if self.has_work:
            return False
        self.kv.flush()
        return True

    def _reqs_with_rows(self) -> list[Req]:
        reqs = self.running + [r for r in self.waiting if r.row is not None]
        return reqs + ([self.chunked] if self.chunked else [])

    # ---- choosing a batch --------------------------------------------------------------------

    def _schedule_prefill(self) -> ScheduledBatch | None:
        if not self.waiting and self.chunked is None:
            return None
        budget = Budget(
            tokens=self.args.max_prefill_tokens,
            chunk=self.args.chunk_size,
            pages=self.kv.available_pages - self._reserved_pages(),
        )
        reqs, lens = [], []
        if self.chunked is not None:
            req, self.chunked = self.chunked, None
            n = self._chunk_len(req, budget, first=True)
            budget.take(n, 0)  # its pages were counted when it was admitted
            if n < req.extend_len:
                self.chunked = req
            reqs.append(req)
            lens.append(n)
        share_in_batch = self.args.schedule_policy in ("lpm", "dfs-weight") and not self.args.disable_radix_cache
        room = self.args.max_running_requests - len(self.running) - len(reqs)
        matches: dict[int, tuple[int, object]] = {}  # one prefix match per request per step

        def match(req: Req) -> tuple[int, object]:
            if id(req) not in matches:
                matches[id(req)] = self.kv.match_len(req)
            return matches[id(req)]

        candidates = order_waiting(self.args.schedule_policy, self.waiting, match) if room > 0 else []
        for req in candidates:
            if len(self.running) + len(reqs) >= self.args.max_running_requests or self.chunked is not None:
                break
            if share_in_batch and reqs and self._shares_uncached_prefix(req, match(req)[0], reqs):
                continue  # next step its prefix will be cached by the request it shares with
            n = self._try_admit(req, budget, first=not reqs)
            if n == 0:
                break
            self.waiting.remove(req)
            reqs.append(req)
            lens.append(n)
        if not reqs:
            return None
        return self._extend_batch(reqs, lens)

    @staticmethod
    def _shares_uncached_prefix(req: Req, cached: int, batch: list[Req]) -> bool:
        """Whether `req` shares at least IN_BATCH_SHARE_MIN tokens past its `cached` prefix with
        a request already in this batch: prefilled together, neither would reuse the other."""
        end = cached + IN_BATCH_SHARE_MIN
        if end > req.seq_len - 1:
            return False
        head = req.tokens(0, end)
        return any(other.seq_len >= end and other.tokens(0, end) == head for other in batch)

    def _try_admit(self, req: Req, budget: Budget, first: bool) -> int:
        """Admit `req` if its whole remaining prefill and reserved decode fit; returns its extend length now."""
        evictable_before = self.kv.cache.evictable_pages
        self.kv.admit(req)
        page = self.kv.page_size
        need = pages_for(req.seq_len, page) - req.prefix_len // page
        alone = first and not self.running  # nothing to wait for: admit if the prompt itself fits
        if not alone:
            need += pages_for(reserved_decode_tokens(req, self.new_token_ratio), page)
        # locking the matched prefix took its pages out of the evictable ones the budget counted
        need += evictable_before - self.kv.cache.evictable_pages
        n = self._chunk_len(req, budget, first)
        if need > budget.pages or n == 0:
            self.kv.undo_admit(req)
            if alone and need > budget.pages:
                self._reject_oversized(req)
            return 0
        budget.take(n, need)
        if n < req.extend_len:
            self.chunked = req
        return n

    def _reject_oversized(self, req: Req) -> None:
        """A request that cannot fit even with the whole pool to itself would wait forever: end it.
        (Prompts are checked against the pool on arrival, so this is a retracted request that grew
        past it: it ends at the pool's limit, like one that reaches it while decoding.)"""
        self.waiting.remove(req)
        log.warning("request %s needs KV for %d tokens, more than the pool holds; it ends there", req.rid, req.seq_len)
        self._ended.append(self._end(req, Finish(FinishKind.LENGTH, len(req.output_ids))))

    def _chunk_len(self, req: Req, budget: Budget, first: bool) -> int:
        n = req.extend_len
        if budget.chunk is not None:
            n = min(n, budget.chunk)
        if n > budget.tokens and not first:
            return 0  # whole prompts only, unless it is the first of the batch
        return max(n, 0)

    def _reserved_pages(self) -> int:
        reqs = self.running + ([self.chunked] if self.chunked else [])
        tokens = sum(reserved_decode_tokens(r, self.new_token_ratio) for r in reqs)
        if self.chunked is not None:
            tokens += self.chunked.extend_len
        return pages_for(tokens, self.kv.page_size) + (len(reqs) if self.kv.page_size > 1 else 0) + self._owed_pages()

    def _owed_pages(self) -> int:
        """Pages that jumped requests still need for their extend step."""
        return sum(self.kv.pages_to_extend(r, r.extend_len) for r in self.running if r.extend_len > 1)

    def _schedule_jumped(self) -> ScheduledBatch | None:
        """When jump-forward appended tokens to running requests, all running requests go in one
        extend batch: the jumped ones with all their new tokens, the others with their one."""
        jumped = [r for r in self.running if r.extend_len > 1]
        if not jumped:
            return None
        page = self.kv.page_size
        need = self._owed_pages() + sum(1 for r in self.running if r.extend_len == 1 and r.cached_len % page == 0)
        if need > self.kv.available_pages:  # a prefill took the pages: the jumped ones prefill later
            for req in jumped:
                self._retract(req)
            return None
        reqs = list(self.running)
        batch = self._extend_batch(reqs, [r.extend_len for r in reqs])
        batch.mixed = True
        return batch

    def _schedule_decode(self) -> ScheduledBatch | None:
        if not self.running:
            return None
        self._retract_until_fits()
        if not self.running:
            return None
        self.new_token_ratio = max(self.args.min_new_token_ratio, self.new_token_ratio - self.args.new_token_ratio_decay)
        reqs = list(self.running)
        return ScheduledBatch(ForwardMode.DECODE, reqs, [1] * len(reqs), reqs, [])

    def _retract_until_fits(self) -> None:
        while True:
            need = sum(1 for r in self.running if r.cached_len % self.kv.page_size == 0)
            if need <= self.kv.available_pages:
                return
            if len(self.running) == 1:  # it has the whole pool to itself: it ends at the pool's limit
                req = self.running.pop()
                log.warning("request %s filled the KV cache pool alone; it ends there", req.rid)
                self._ended.append(self._end(req, Finish(FinishKind.LENGTH, len(req.output_ids))))
                return
            self._retract(min(self.running, key=lambda r: (len(r.output_ids), -r.prompt_len)))

    def _retract(self, req: Req) -> None:
        """Back to the front of the queue, its KV so far handed to the prefix cache."""
        self.running.remove(req)
        self.kv.release(req)
        self.waiting.insert(0, req)
        self.new_token_ratio = self.args.init_new_token_ratio
        self.num_retractions += 1

    # ---- building the worker's batch ---------------------------------------------------------

    def _extend_batch(self, reqs: list[Req], lens: list[int]) -> ScheduledBatch:
        sampled, spans = [], []
        for req, n in zip(reqs, lens):
            if req.cached_len + n == req.seq_len and req.params.max_new_tokens > 0:
                sampled.append(req)
            span = self._logprob_span(req, n)
            if span is not None:
                spans.append(span)
        return ScheduledBatch(ForwardMode.EXTEND, reqs, lens, sampled, spans)

    @staticmethod
    def _logprob_span(req: Req, n: int) -> tuple[Req, int, int] | None:
        """Hidden positions of this chunk whose next-token logprob belongs to the prompt logprobs."""
        if not req.wants_input_logprobs or req.input_logprobs_done:
            return None
        first = max(req.cached_len, req.logprob_start_len - 1, 0)
        last = min(req.cached_len + n, req.prompt_len - 1)
        return (req, first, last - first) if last > first else None

    def _to_worker_batch(self, b: ScheduledBatch) -> WorkerBatch:
        dev = self.device
        sampling = self._sampling(b.sampled)  # before any page is taken: a fault here has nothing to undo
        rows = torch.tensor([r.row for r in b.reqs], dtype=torch.int64, device=dev)
        prefix = torch.tensor([r.cached_len for r in b.reqs], dtype=torch.int64, device=dev)
        ext = torch.tensor(b.extend_lens, dtype=torch.int64, device=dev)
        if b.mode is ForwardMode.DECODE:
            input_ids, positions, out_slots, sample_rows = self._decode_inputs(b, rows, prefix)
        else:
            input_ids, positions, out_slots, sample_rows = self._extend_inputs(b, prefix, ext)
        wb = WorkerBatch(
            mode=b.mode, input_ids=input_ids, positions=positions, out_slots=out_slots, req_rows=rows,
            prefix_lens=prefix, extend_lens=ext, seq_lens=prefix + ext, max_extend_len=max(b.extend_lens),
            max_seq_len=max(r.cached_len + n for r, n in zip(b.reqs, b.extend_lens)),
            sample_rows=sample_rows, sampling=sampling,
            return_logprob=any(r.return_logprob for r in b.sampled) or bool(b.logprob_spans),
            top_logprobs_num=max([r.top_logprobs_num for r in b.reqs if r.return_logprob] or [0]),
        )
        if b.logprob_spans:
            wb.prompt_rows, wb.prompt_targets = self._prompt_logprob_inputs(b)
        return wb

    def _decode_inputs(self, b: ScheduledBatch, rows: torch.Tensor, prefix: torch.Tensor) -> tuple[torch.Tensor, ...]:
        input_ids = torch.tensor([r.output_ids[-1] for r in b.reqs], dtype=torch.int64, device=self.device)
        need_page = prefix % self.kv.page_size == 0
        out_slots = self.kv.decode_slots(rows, prefix, need_page, int(need_page.sum()))
        b.slotted = len(b.reqs)
        return input_ids, prefix, out_slots, torch.arange(len(b.reqs), device=self.device)

    def _extend_inputs(self, b: ScheduledBatch, prefix: torch.Tensor, ext: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ids: list[int] = []
        slots = []
        for req, n in zip(b.reqs, b.extend_lens):
            ids.extend(req.tokens(req.cached_len, req.cached_len + n))
            slots.append(self.kv.extend_slots(req, n))
            b.slotted += 1
        ends = torch.cumsum(ext, 0)
        sampled = {id(r) for r in b.sampled}
        last_rows = [int(e) - 1 for r, e in zip(b.reqs, ends.tolist()) if id(r) in sampled]
        positions = torch.repeat_interleave(prefix, ext) + ragged_arange(ext)
        return (torch.tensor(ids, dtype=torch.int64, device=self.device), positions, torch.cat(slots),
                torch.tensor(last_rows, dtype=torch.int64, device=self.device))

    def _prompt_logprob_inputs(self, b: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed-token rows whose hidden state scores the next prompt token, and those tokens."""
        offset_of, offset = {}, 0
        for req, n in zip(b.reqs, b.extend_lens):
            offset_of[id(req)] = offset - req.cached_len  # packed index of the request's position 0
            offset += n
        rows: list[int] = []
        targets: list[int] = []
        for req, first, count in b.logprob_spans:
            base = offset_of[id(req)]
            rows.extend(range(base + first, base + first + count))
            targets.extend(req.prompt_ids[first + 1 : first + 1 + count])
        return (torch.tensor(rows, dtype=torch.int64, device=self.device),
                torch.tensor(targets, dtype=torch.int64, device=self.device))

    def _sampling(self, reqs: list[Req]) -> SamplingBatch | None:
        if not reqs:
            return None
        batch = SamplingBatch.build(
            [r.params for r in reqs], [r.prompt_ids for r in reqs], [r.output_ids for r in reqs],
            self.eos_ids, self.worker.config.vocab_size, self.device,
        )
        batch.grammar_mask = grammar_bitmask([(r.guide, r.grammar) if r.guide is not None else None for r in reqs],
                                             self.worker.config.vocab_size, self.eos_ids[0] if self.eos_ids else -1)
        return batch

    # ---- processing results ------------------------------------------------------------------

    def _process(self, b: ScheduledBatch, out: WorkerOutput) -> list[TokenOutput]:
        for req, n in zip(b.reqs, b.extend_lens):
            req.cached_len += n
            if b.mode is ForwardMode.EXTEND and not b.mixed:
                self.kv.share_prefill(req)
        self._store_prompt_logprobs(b, out)
        faulted: dict[str, Finish] = {}  # requests whose own bookkeeping raised: they alone fail
        for i, req in enumerate(b.sampled):
            try:
                self._append_sampled(req, out, i)
            except Exception:  # noqa: BLE001 - a bug in one request's constraint must not stop the rest
                faulted[req.rid] = self._internal_error(req, "taking its sampled token")
        outputs, self._ended = self._ended, []
        for req in b.reqs:
            if b.mode is ForwardMode.EXTEND and req is self.chunked:
                continue
            finish = faulted.get(req.rid)
            if finish is None:
                try:
                    finish = self._check_finish(req)
                    if finish is None and self._may_jump(req):
                        changed = self._jump_forward(req, len(b.reqs))
                        if changed is not None:
                            finish = self._stop_token_in(req, changed) or self._check_finish(req)
                except Exception:  # noqa: BLE001 - as above
                    finish = self._internal_error(req, "checking its stop conditions or jumping forward")
            if finish is not None:
                if b.mode is ForwardMode.DECODE or b.mixed:
                    self.running.remove(req)
                outputs.append(self._end(req, finish))
            else:
                if b.mode is ForwardMode.EXTEND and not b.mixed:
                    self.running.append(req)
                outputs.append(self._output(req))
        return outputs

    def _append_sampled(self, req: Req, out: WorkerOutput, i: int) -> None:
        token = out.next_token_ids[i]
        req.output_ids.append(token)
        if req.guide is not None and token not in self.eos_ids:
            # NOTE: is_finished() only means "accepting": more tokens may still follow
            req.guide.advance(token, return_tokens=False)
        if req.return_logprob:
            req.output_logprobs.append(out.logprobs[i])
            if req.top_logprobs_num:
                k = req.top_logprobs_num
                req.output_top_logprobs.append(list(zip(out.top_logprobs[i][:k], out.top_logprob_ids[i][:k])))

    def _internal_error(self, req: Req, doing: str) -> Finish:
        """How a request ends when our own code raised on it after a good forward pass: a 500
        naming an error id (the log has the traceback under it). Its output may be half updated,
        so none of its own KV goes to the prefix cache: only the prefix it already shared stays."""
        error_id = uuid.uuid4().hex[:12]
        log.exception("request %s failed while %s (error id %s)", req.rid, doing, error_id)
        self.kv.truncate(req, req.prefix_len)
        return Finish(FinishKind.ABORT, f"internal error (error id {error_id})", status=500)

    def _fail(self, b: ScheduledBatch, doing: str) -> list[TokenOutput]:
        """Building or running batch `b` raised: its requests end with a 500 naming an error id (the
        log has the traceback under it); their KV up to this step goes to the cache, the pages
        this step allocated are freed, and every other request carries on."""
        error_id = uuid.uuid4().hex[:12]
        log.exception("%s failed on requests %s (error id %s)", doing, [r.rid for r in b.reqs], error_id)
        message = f"internal error while {doing} (error id {error_id})"
        outputs, self._ended = self._ended, []
        for i, (req, n) in enumerate(zip(b.reqs, b.extend_lens)):
            computed = req.cached_len
            if i < b.slotted:
                req.cached_len += n  # the slots this step was given: hand its pages back
            self.kv.truncate(req, computed)
            self._dequeue(req)
            outputs.append(self._end(req, Finish(FinishKind.ABORT, message, status=500)))
        return outputs

    # ---- jump-forward ------------------------------------------------------------------------

    def _may_jump(self, req: Req) -> bool:
        # NOTE: forced tokens are not sampled, so they would have no logprobs: such requests decode them
        return (self.jump_forward and req.guide is not None and not req.return_logprob
                and req.output_ids[-1] not in self.eos_ids and self.grammar.jump_forward is not None)

    def _jump_forward(self, req: Req, batch_size: int) -> int | None:
        """Append the text the constraint forces next, re-encoded with the last output tokens;
        end with EOS when nothing else may follow. Returns the index of the first output token
        that changed, or None when none did."""
        jf = self.grammar.jump_forward
        forced = jf.forced(req.grammar, req.guide.get_state())
        changed = self._jump(req, jf, forced, batch_size) if forced.text else None
        if changed is not None:
            forced = jf.forced(req.grammar, req.guide.get_state())
        p = req.params
        if (forced.ends and not forced.text and not p.ignore_eos and len(req.output_ids) < p.max_new_tokens
                and len(req.output_ids) + 1 >= p.min_new_tokens):
            req.output_ids.append(jf.eos_token_id)  # finishes the request: it needs no KV
            return len(req.output_ids) - 1 if changed is None else changed
        return changed

    def _jump(self, req: Req, jf: JumpForward, forced: Forced, batch_size: int) -> int | None:
        """Re-encode the last output tokens with the forced text; returns the first changed index."""
        out = req.output_ids
        # tokens in the shared prefix cache cannot be re-encoded; the guide keeps RETOKENIZE_TOKENS
        # states, and holds none for an EOS (sampled under ignore_eos: the guide never takes it)
        movable = len(out) - max(req.prefix_len - req.prompt_len, 0)
        window = min(RETOKENIZE_TOKENS, movable, req.guide.get_allowed_rollback(), self._since_eos(out))
        plan = jf.retokenize(out[len(out) - window:], forced.text, forced.ends, forced.next_bytes)
        if plan is None:
            return None
        start = len(out) - window + plan.keep  # the first output token that changes
        room = min(req.params.max_new_tokens, self.context_length - req.prompt_len) - start
        tokens = plan.tokens[:room]
        old_bytes = sum(len(jf.token_bytes[t]) for t in out[start:])
        if sum(len(jf.token_bytes[t]) for t in tokens) <= old_bytes:
            return None  # no room to add anything past what is already there
        keep_kv = min(req.cached_len, req.prompt_len + start)
        need = pages_for(req.prompt_len + start + len(tokens), self.kv.page_size) - pages_for(keep_kv, self.kv.page_size)
        if need > self.kv.available_pages - len(self.running) - batch_size - self._owed_pages():
            return None  # leave the pages to decoding
        req.guide.rollback_state(len(out) - start)
        if not req.guide.accepts_tokens(tokens):  # cannot happen for a tokenization of allowed text
            for t in out[start:]:
                req.guide.advance(t, return_tokens=False)
            log.warning("jump-forward: the guide refused the re-encoded text of %s; decoding it instead", req.rid)
            return None
        for t in tokens:
            req.guide.advance(t, return_tokens=False)
        if keep_kv < req.cached_len:
            self.kv.truncate(req, keep_kv)
        self.jumped_tokens += len(tokens) - (len(out) - start)
        if req.sent_len > start:
            req.replaced += req.sent_len - start
            req.sent_len = start
        out[start:] = tokens
        return start

    def _since_eos(self, out: list[int]) -> int:
        """How many of the last RETOKENIZE_TOKENS outputs follow the last EOS among them."""
        tail = out[-RETOKENIZE_TOKENS:]
        for back, token in enumerate(reversed(tail)):
            if token in self.eos_ids:
                return back
        return len(tail)

    def _stop_token_in(self, req: Req, start: int) -> Finish | None:
        """A stop token among the outputs from `start` on (jump-forward appends many at once) ends
        the request there, as it would have had the tokens come one by one."""
        out = req.output_ids
        for i in range(max(start, req.params.min_new_tokens - 1), len(out) - 1):  # the last: _check_finish's
            if self._is_stop_token(req, out[i]):
                del out[i + 1:]  # (tokens past the first of this step's have no KV yet)
                return Finish(FinishKind.STOP, out[i])
        return None

    def _is_stop_token(self, req: Req, token: int) -> bool:
        return token in req.params.stop_token_ids or (token in self.eos_ids and not req.params.ignore_eos)

    def _store_prompt_logprobs(self, b: ScheduledBatch, out: WorkerOutput) -> None:
        at = 0
        for req, first, count in b.logprob_spans:
            if req.input_logprobs is None:
                # position logprob_start_len's logprob; position 0 has none
                start = req.logprob_start_len
                req.input_logprobs = [None] if start == 0 else []
                req.input_top_logprobs = [None] if start == 0 else []
            req.input_logprobs.extend(out.prompt_logprobs[at : at + count])
            if req.top_logprobs_num:
                k = req.top_logprobs_num
                for vals, ids in zip(out.prompt_top_logprobs[at : at + count], out.prompt_top_logprob_ids[at : at + count]):
                    req.input_top_logprobs.append(list(zip(vals[:k], ids[:k])))
            at += count

    def _check_finish(self, req: Req) -> Finish | None:
        p = req.params
        if not req.output_ids:
            return Finish(FinishKind.LENGTH, 0) if req.params.max_new_tokens == 0 else None
        last = req.output_ids[-1]
        if self._is_stop_token(req, last) and len(req.output_ids) >= p.min_new_tokens:
            return Finish(FinishKind.STOP, last)
        if p.stop and self.decode is not None and len(req.output_ids) >= p.min_new_tokens:
            matched = self._match_stop_string(req)
            if matched is not None:
                return Finish(FinishKind.STOP, matched)
        if len(req.output_ids) >= p.max_new_tokens:
            return Finish(FinishKind.LENGTH, len(req.output_ids))
        if req.seq_len >= self.context_length:
            return Finish(FinishKind.LENGTH, len(req.output_ids))
        return None

    def _match_stop_string(self, req: Req) -> str | None:
        # A stop string of n characters spans at most n tokens (plus one partial token on each side),
        # and may start in any token not yet reported (jump-forward adds many at once).
        window = max(len(s) for s in req.params.stop) + 2 + len(req.output_ids) - req.sent_len
        tail = self.decode(req.output_ids[-window:])
        for s in req.params.stop:
            if s in tail:
                return s
        return None

    def _end(self, req: Req, finish: Finish) -> TokenOutput:
        req.finish = finish
        del self._live[req.rid]
        if req.row is not None:
            self.kv.release(req)
        return self._output(req)

    def _output(self, req: Req) -> TokenOutput:
        new = req.output_ids[req.sent_len :]
        out = TokenOutput(
            rid=req.rid, new_token_ids=new, prompt_tokens=req.prompt_len, completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens, finish_reason=req.finish.to_dict() if req.finish else None,
            replaced=req.replaced,
        )
        req.replaced = 0
        if req.return_logprob:
            out.output_logprobs = req.output_logprobs[req.sent_len :]
            out.output_top_logprobs = req.output_top_logprobs[req.sent_len :]
            if req.input_logprobs is not None and not req.input_logprobs_sent and (req.output_ids or req.finish):
                out.input_logprobs, out.input_top_logprobs = req.input_logprobs, req.input_top_logprobs
                req.input_logprobs_sent = True
        req.sent_len = len(req.output_ids)
        return out

