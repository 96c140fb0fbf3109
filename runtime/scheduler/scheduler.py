"""The scheduler: one event-loop step at a time, it picks a batch, runs it, and processes the results.

Every step carries all running requests (one token each, or a jump-forward's forced text)
and, in what is left of its token budget, prefill: the request being chunked, then waiting
requests in policy order (`admission.py`). A decoder never waits a whole step for someone
else's prompt. When the running requests' tokens do not fit in the pool, the least advanced
step back (`retraction.py`). The batch goes to the worker packed (`batch.py`); after it,
sampled tokens are taken, stop conditions checked and forced text appended
(`jump_forward.py`). This file keeps the queues, the step, finishing and outputs. The
scheduler does no I/O: `add_request`, `abort` and `step` are its API.
"""

from __future__ import annotations

import logging
import math
import re
import select
import time
import uuid
from typing import Callable

from radixlm.runtime.args import ServerArgs
from radixlm.runtime.cache.continuations import TreeContinuations
from radixlm.runtime.cache.kv_tier import BLOCK_TOKENS, FileTier, KVTier
from radixlm.runtime.constrained.backend import GrammarError, constraint_key
from radixlm.runtime.constrained.grammar import GrammarCompiler
from radixlm.runtime.constrained.reasoning_gate import ReasoningGate
from radixlm.runtime.messages import CONSTRAINT_NOT_GIVEN, TokenizedRequest, TokenOutput
from radixlm.runtime.model_config import ModelSource
from radixlm.runtime.native import BadRequest
from radixlm.runtime.sampling_params import STOP_REGEX_WINDOW
from radixlm.runtime.scheduler.admission import Admitted, admit, step_budget
from radixlm.runtime.scheduler.batch import PenaltyTracker, ScheduledBatch, make_batch, sampling_batch, to_worker_batch
from radixlm.runtime.scheduler.jump_forward import RETOKENIZE_TOKENS, JumpForwarder
from radixlm.runtime.scheduler.kv_manager import KVManager, pages_for
from radixlm.runtime.scheduler.overlap import InFlight, StepThread, may_overlap
from radixlm.runtime.scheduler.req import Finish, FinishKind, Req
from radixlm.runtime.scheduler.retraction import make_room
from radixlm.runtime.scheduler.speculation import Speculator, kept_prefix
from radixlm.runtime.scheduler.step_log import StepLog, StepRecord
from radixlm.runtime.worker.forward_batch import WorkerBatch, future_id
from radixlm.runtime.worker.model_worker import ModelWorker, WorkerOutput

log = logging.getLogger(__name__)


class DeviceLost(RuntimeError):
    """The model raised and the device cannot serve on (see ModelWorker.usable_after_fault): the
    process must end so that the server stops instead of failing every request from now on."""


def _kv_tier(args: ServerArgs, worker: ModelWorker) -> KVTier | None:
    """The second tier under the prefix cache (`--kv-tier-path`): blocks of a whole number of
    pages, in a folder named by what the KV depends on."""
    if args.kv_tier_path is None:
        return None
    block = math.lcm(BLOCK_TOKENS, worker.page_size)
    store = FileTier(args.kv_tier_path, f"{worker.kv_identity()};block={block}", args.kv_tier_size)
    return KVTier(store, worker.kv_pools, block)


def _count_extended(b: ScheduledBatch) -> None:
    """A step's tokens count as cached once it ran (plain) or was launched (overlapped)."""
    for req, n in zip(b.reqs, b.extend_lens):
        req.cached_len += n


def _uncount_extended(b: ScheduledBatch) -> ScheduledBatch:
    """Undo `_count_extended` for a launched step that raised, as if it had never run."""
    for req, n in zip(b.reqs, b.extend_lens):
        req.cached_len -= n
    return b


def _mixed(b: ScheduledBatch) -> bool:
    """Prefill rows beside decodes: a fault there can be told apart by running the decodes alone."""
    return bool(b.prefilling) and len(b.prefilling) < len(b.reqs)


def _overlap(args: ServerArgs, worker: ModelWorker) -> bool:
    """Whether steps overlap (overlap.py): --overlap-schedule, auto on CUDA; never beside speculation,
    whose drafts need each step's tokens before the next step is built."""
    wanted = args.overlap_schedule == "on" or (args.overlap_schedule == "auto" and worker.device.type == "cuda")
    if wanted and args.speculative != "off":
        log.info("overlap scheduling is off beside --speculative %s", args.speculative)
        return False
    return wanted


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
        tree_index = TreeContinuations() if args.speculative in ("auto", "radix") else None
        self.kv = KVManager(worker.num_pages, worker.page_size, worker.req_to_token,
                            not args.disable_radix_cache, worker.device, tree_index, _kv_tier(args, worker),
                            window=worker.config.sliding_window if worker.req_to_token.window_table is not None else None,
                            rollback=RETOKENIZE_TOKENS + args.speculative_num_draft_tokens + 1)
        self.speculator = (None if args.speculative == "off" else
                           Speculator(args.speculative, args.speculative_num_draft_tokens, self.kv,
                                      self.context_length, self.eos_ids, args.speculative_max_batch_size))
        self.waiting: list[Req] = []
        self.running: list[Req] = []  # decoding
        self.chunked: Req | None = None  # mid-prefill between chunks
        self.admission_paused = False  # a weight update waits for the running requests: none join them
        self.new_token_ratio = args.init_new_token_ratio
        self._arrivals = 0
        self.num_retractions = 0
        self.jump_forward = not args.disable_jump_forward
        self._jumper: JumpForwarder | None = None  # made with the constraint compiler
        # counters: batches run, the sum of their sizes (a request's forward passes)
        self.forward_passes = 0
        self.request_passes = 0
        self._ended: list[TokenOutput] = []  # outputs of requests ended while scheduling
        self.step_log = StepLog()  # for people watching: the dashboard
        self._live: dict[str, Req] = {}  # every request not yet ended, by id
        self.penalties = PenaltyTracker(worker.req_to_token.table.shape[0], worker.config.vocab_size, worker.device)
        # overlap scheduling (overlap.py): the step running now, and requests ended while one held them
        self._steps = StepThread(worker) if _overlap(args, worker) else None
        self._in_flight: InFlight | None = None
        self._deferred: list[Req] = []
        self.overlapped_steps = 0  # steps built while the one before them ran

    # ---- API ---------------------------------------------------------------------------------

    def add_request(self, tr: TokenizedRequest) -> None:
        """Queue a request. The front doors checked it (tokenizer/prepare.py, the one place a request
        is checked, and the tokenizer process or LocalEngine for ids in flight); here its invariants
        are asserted, not checked again. BadRequest only for what the scheduler alone knows: its
        adapter is not served (any more: `lora_adapter`), or constrained decoding cannot start."""
        lora = self.lora_adapter(tr)
        ids, params = tr.input_ids, tr.sampling_params
        assert tr.rid not in self._live, f"request id {tr.rid!r} is already in flight"
        assert ids and 0 <= min(ids) and max(ids) < self.worker.config.vocab_size, f"{tr.rid}: ids outside the vocabulary"
        assert len(ids) + params.max_new_tokens <= self.context_length, f"{tr.rid}: does not fit the context"
        assert pages_for(len(ids), self.kv.page_size) <= self.kv.num_pages, f"{tr.rid}: the prompt outgrows the pool"
        req = Req(tr, self._arrivals)
        if lora is not None:
            req.lora, req.key_offset = lora, self.kv.lora_namespace(lora)
        req.grammar_key = tr.constraint  # worked out once, by prepare
        if req.grammar_key is CONSTRAINT_NOT_GIVEN:  # a request made by hand (tests, benchmarks)
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
            assert self._make_grammar is not None, "a constrained request without a tokenizer (prepare refuses it)"
            try:
                self._grammar = self._make_grammar()
            except Exception as e:  # noqa: BLE001 - e.g. a model without an EOS token: refuse, serve on
                log.exception("the constraint compiler could not start")
                raise BadRequest(f"constrained decoding is not available for this model: {e}") from None
        return self._grammar

    @property
    def overlap(self) -> bool:
        return self._steps is not None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.pending or self._in_flight or self._ended)

    @property
    def busy(self) -> bool:
        """Whether any request holds KV or a step is out (waiting ones aside)."""
        return bool(self.running or self.chunked or self._in_flight)

    @property
    def has_runnable_work(self) -> bool:
        """Whether `step` has something to do now; else only constraints are compiling (`compile_wakeup_fd`)."""
        return bool(self.waiting or self.running or self.chunked or self._ended or self._in_flight)

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

    def lora_adapter(self, tr: TokenizedRequest) -> str | None:
        """The adapter a request runs on, among those served now (the worker's table, which only
        control.py changes, between steps): the one its `lora_path` names (BadRequest if none of
        that name is served: it may have been unloaded since the request was sent), else the one
        its OpenAI `model` names, if served (any other name means the base model: None)."""
        served = self.worker.loras
        if tr.lora_path is None:
            return tr.model if tr.model in served else None
        if tr.lora_path not in served:
            raise BadRequest(f"unknown LoRA adapter {tr.lora_path!r} (served: {', '.join(sorted(served)) or 'none'})")
        return tr.lora_path

    def lora_users(self, name: str) -> int:
        """How many requests not yet ended run on the LoRA adapter `name`."""
        return sum(r.lora == name for r in self._live.values())

    @property
    def live_ids(self) -> list[str]:
        """The ids of every request not yet ended."""
        return list(self._live)

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.pending) + (self.chunked is not None)

    def settle(self) -> None:
        """Take back the step in flight (overlap.py), if any: until the next `step`, nothing reads
        the worker's state, which may then change (control.py: adapters loaded and unloaded). Its
        outputs come with the next `step`."""
        if self._in_flight is not None:
            launched, self._in_flight = self._in_flight, None
            outputs = self._take_back(launched)  # (it takes `_ended` into its outputs)
            self._ended.extend(outputs)

    def abort_all(self) -> None:
        """End every request not yet ended; their final outputs come with the next `step`."""
        for rid in list(self._live):
            self._ended.append(self.abort(rid))

    def step(self) -> list[TokenOutput]:
        """Run one batch; returns the outputs of every request that advanced. Two loops side by
        side: the plain one, and the overlapped one (overlap.py), which launches the batch and
        returns the outputs of the one launched before it."""
        if self.pending:
            self._promote_compiled()
        return self._step_overlapped() if self._steps is not None else self._step_plain()

    def _step_plain(self) -> list[TokenOutput]:
        started = time.perf_counter()  # (what a step costs, for speculation: choosing its drafts too)
        batch = self._schedule()
        if batch is None:
            ended, self._ended = self._ended, []
            return ended
        produced = sum(len(r.output_ids) for r in batch.sampled)
        outputs, _ = self._run(batch)
        self._record(batch, sum(len(r.output_ids) for r in batch.sampled) - produced, started)
        return outputs

    def _record(self, batch: ScheduledBatch, produced: int, started: float) -> None:
        if self.speculator is not None:
            tokens = sum(batch.extend_lens)
            self.speculator.observe_step(batch.num_decode < len(batch.reqs), tokens, time.perf_counter() - started)
        kv = self.kv
        prompt, cached = kv.take_admitted()
        free, evictable, locked = kv.allocator.num_free_pages, kv.cache.evictable_pages, kv.cache.locked_pages
        prefill = len(batch.prefilling)
        self.step_log.add(StepRecord(
            time.monotonic(), len(batch.reqs) - prefill - batch.num_verify, prefill, batch.prefill_tokens,
            batch.num_verify, produced, len(self.running), len(self.waiting) + len(self.pending), prompt, cached,
            free, evictable, locked, kv.num_pages - free - evictable - locked, kv.tier_pages))
        if self.args.debug_accounting:
            self.check_accounting()

    def _build(self, batch: ScheduledBatch) -> WorkerBatch:
        # sampling first, before any page is taken: a fault there has nothing to undo
        batch.sampling = sampling_batch(batch.sampled, self.eos_ids, self.worker.config.vocab_size, self.device,
                                        self.penalties, batch.sample_counts)
        return to_worker_batch(batch, self.kv, self.device)

    def _device_check(self, e: Exception) -> None:
        """After the model raised: DeviceLost if the device cannot serve on (else the caller's fault path)."""
        if not self.worker.usable_after_fault():
            raise DeviceLost(f"the model raised and the device is unusable: {type(e).__name__}: {e}") from e

    def _run(self, batch: ScheduledBatch, isolate: bool = True) -> tuple[list[TokenOutput], bool]:
        """Build and run `batch`, then take its results; the outputs, and whether the pass ran.
        Everything here is inside the fault boundary: a fault fails this batch's requests alone,
        unless it leaves the device unusable. A mixed batch that faults first runs its decodes
        alone, to tell whose fault it was."""
        doing = "building the batch"
        try:
            worker_batch = self._build(batch)
            doing = "running the model"
            try:
                result = self.worker.forward(worker_batch).settle()
            except Exception as e:  # noqa: BLE001 - the rest serve on, unless the device is gone
                self._device_check(e)
                raise
        except DeviceLost:
            raise
        except Exception:  # noqa: BLE001 - our own code or the model raised on this batch
            return self._batch_failed(batch, doing, isolate), False
        self.forward_passes += 1
        self.request_passes += len(batch.reqs)
        _count_extended(batch)
        return self._process(batch, result), True

    def _batch_failed(self, batch: ScheduledBatch, doing: str, isolate: bool) -> list[TokenOutput]:
        message = self._logged_failure(batch, doing)
        if isolate and _mixed(batch):
            return self._isolate(batch, message)
        return self._fail(batch, batch.reqs, message)

    # ---- overlap (overlap.py) ----------------------------------------------------------------

    def _step_overlapped(self) -> list[TokenOutput]:
        """Build and launch the next batch, then take back the one running (its tokens, stop
        checks and outputs) while the new one runs."""
        started = time.perf_counter()
        outputs: list[TokenOutput] = []
        previous, self._in_flight = self._in_flight, None
        if previous is not None and not may_overlap(previous.batch, self.running, self.kv):
            outputs += self._take_back(previous)
            previous = None
        batch = self._schedule()
        launched = None
        if batch is not None:
            try:
                worker_batch = self._build(batch)
            except Exception:  # noqa: BLE001 - as in _run: the rest serve on
                if previous is not None:  # the batch's decodes read its tokens: take it back first
                    outputs += self._take_back(previous)
                    previous = None
                outputs += self._batch_failed(batch, "building the batch", isolate=True)
            else:
                launched = self._in_flight = self._launch(batch, worker_batch, previous is not None, started)
        if previous is not None:
            outputs += self._take_back(previous)
        if launched is not None:
            self._hold_placeholders(launched.batch)
            if all(r.finish is not None for r in launched.batch.reqs):  # all ended meanwhile: only their
                self._in_flight = None                                   # pages to take back, now
                outputs += self._take_back(launched)
        ended, self._ended = self._ended, []
        return outputs + ended

    def _launch(self, batch: ScheduledBatch, worker_batch: WorkerBatch, overlapped: bool, started: float) -> InFlight:
        """Start `batch` on the step thread; its lengths count from now (the next batch is built
        on them), and its requests are held by one more launched step."""
        worker_batch.future_ids = overlapped
        self.overlapped_steps += overlapped
        _count_extended(batch)
        for req in batch.reqs:
            req.in_flight += 1
        return InFlight(batch, self._steps.launch(worker_batch), started)

    def _hold_placeholders(self, b: ScheduledBatch) -> None:
        """Each sampled request of a launched step holds a placeholder for the token to come
        (one sample row each: no drafts beside overlap), so the next batch can be built on it."""
        for row, req in enumerate(b.sampled):
            if req.finish is None:
                req.output_ids.append(future_id(row))
                req.awaiting = True

    def _drop_placeholders(self, b: ScheduledBatch) -> None:
        for req in b.sampled:
            if req.awaiting:
                req.output_ids.pop()
                req.awaiting = False

    def _take_back(self, step: InFlight) -> list[TokenOutput]:
        """Wait for a launched step and take its results, as `_run` does after a forward pass."""
        b = step.batch
        failure = None
        try:
            try:
                result = step.result.result().settle()
            except Exception as e:  # noqa: BLE001 - the rest serve on, unless the device is gone
                self._device_check(e)
                raise
        except DeviceLost:
            raise
        except Exception:  # noqa: BLE001 - the model raised on this batch: its requests fail
            failure = self._logged_failure(b, "running the model")
        for req in b.reqs:  # the step is over: only steps launched after it still hold its requests
            req.in_flight -= 1
        self._drop_placeholders(b)
        if failure is None:
            produced = sum(1 for r in b.sampled if r.finish is None)
            self.forward_passes += 1
            self.request_passes += len(b.reqs)
            outputs = self._process(b, result)
            self._record(b, produced, step.started)
        elif _mixed(b) and self._in_flight is None:
            outputs = self._isolate(_uncount_extended(b), failure)
        else:
            outputs = self._fail_launched(b, failure)
        self._release_deferred()
        return outputs

    def _release_deferred(self) -> None:
        """Requests that ended while a launched step held them: their rows and pages are released
        once no launched step does."""
        held = [r for r in self._deferred if r.in_flight]
        for req in self._deferred:
            if not req.in_flight:
                if req.drop_kv:
                    self.kv.truncate(req, req.prefix_len)
                self.kv.release(req)
        self._deferred = held

    def _fail_launched(self, b: ScheduledBatch, message: str) -> list[TokenOutput]:
        """A launched step raised, with no prefill beside its decodes to blame (or with a step
        launched after it, which read its placeholders): its requests end with a 500 and none of
        their own KV is kept (what the step wrote, and what a step launched after it writes, is
        not to be trusted)."""
        outputs, self._ended = self._ended, []
        for req in b.reqs:
            if req.finish is None:
                self._dequeue(req)
                self._drop_own_kv(req)
                outputs.append(self._end(req, Finish(FinishKind.ABORT, message, status=500)))
        return outputs

    # ---- fault isolation (both loops) ---------------------------------------------------------

    def _logged_failure(self, b: ScheduledBatch, doing: str) -> str:
        """Log the exception being handled under a fresh error id; the message the requests get."""
        error_id = uuid.uuid4().hex[:12]
        log.exception("%s failed on requests %s (error id %s)", doing, [r.rid for r in b.reqs], error_id)
        return f"internal error while {doing} (error id {error_id})"

    def _isolate(self, b: ScheduledBatch, message: str) -> list[TokenOutput]:
        """A mixed batch raised (built, or run, plainly or launched: a launched one comes here
        taken back, with nothing launched after it, since a step with prefill rows is never
        overlapped). Its decodes run again alone: if they pass, the fault was the prefill rows'
        and they fail; if not, the decodes fail and the prefill rows step back to the queue, to
        run without them. So a bad prompt fails only the requests it was prefilled with, as it
        would in a prefill-only step, and never every running request."""
        self._hand_back_slots(b)
        prefill = [r for r in b.reqs if b.is_prefill(r)]
        if self.chunked in prefill:
            self.chunked = None
        retry = make_batch(self.running, [], [])
        outputs, ran = self._run(retry, isolate=False)
        if not ran:  # the decodes' fault
            for req in prefill:
                self.kv.release(req)
            self.waiting[:0] = prefill
            return outputs
        return outputs + self._fail(b, prefill, message, slots_given_back=True)

    def _hand_back_slots(self, b: ScheduledBatch) -> None:
        """Free the pages this step gave `b`'s rows (the requests' lengths never counted them)."""
        if b.new_pages is not None:
            self.kv.allocator.free(b.new_pages)
            b.new_pages = None

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
                req.guide = self.grammar.matcher(result)
                if req.reasoning_end_ids:
                    req.guide = ReasoningGate(req.guide, req.reasoning_end_ids)
            except Exception:  # noqa: BLE001 - one request's constraint must not stop the scheduler
                self._dequeue(req)
                self._ended.append(self._end(req, self._internal_error(req, "starting its constraint")))
                continue
            self.waiting.append(req)

    def shutdown(self) -> None:
        if self._steps is not None:
            self._steps.shutdown()
        if self._grammar is not None:
            self._grammar.shutdown()
        self.kv.shutdown()

    def check_accounting(self) -> None:
        self.kv.check_accounting(self._reqs_with_rows())

    def update_weights(self, source: ModelSource) -> None:
        """Serve `source`'s weights (`ModelWorker.check_update`'s) from the next step on, with an
        empty prefix cache (the KV of every cached prefix came from the old weights) and, with a
        KV tier, a tier under the new weights' identity. Only between requests: the caller waits
        for the running ones (`admission_paused` holds new ones back meanwhile)."""
        assert not self.busy, "weights are updated only when no request holds KV"
        self.worker.update_weights(source)
        self.kv.flush()
        if self.kv.tier is not None:
            self.kv.tier.store.close()
            self.kv.tier = _kv_tier(self.args, self.worker)
            self.kv.cache.on_evict = self.kv.tier.save
        self.admission_paused = False

    def flush_cache(self) -> bool:
        """Drop every cached prefix; only possible when no request is in flight."""
        if self.has_work:
            return False
        self.kv.flush()
        return True

    def _reqs_with_rows(self) -> list[Req]:
        reqs = self.running + [r for r in self.waiting if r.row is not None] + self._deferred
        reqs += [self.chunked] if self.chunked else []
        if self._in_flight is not None:  # its admissions join `running` only when it is taken back
            reqs += [r for r in self._in_flight.batch.reqs if r.finish is None]
        return list({id(r): r for r in reqs}.values())

    # ---- choosing a batch --------------------------------------------------------------------

    def _schedule(self) -> ScheduledBatch | None:
        """The running requests' tokens first, then prefill in what is left of the step's budget."""
        if self.running:
            self._make_room()
        admitted = self._admit() if self.waiting or self.chunked else Admitted()
        if not self.running and not admitted.reqs:
            return None
        if self.running:
            self.new_token_ratio = max(self.args.min_new_token_ratio,
                                       self.new_token_ratio - self.args.new_token_ratio_decay)
            if self.speculator is not None:
                self._speculate(admitted)
        return make_batch(self.running, admitted.reqs, admitted.lens)

    def _speculate(self, admitted: Admitted) -> None:
        """Drafts for the running requests (speculation.py), in the pages this step leaves spare
        beyond one more token for each running request."""
        kv = self.kv
        need = sum(kv.pages_to_extend(r, r.extend_len) for r in self.running)
        need += sum(kv.pages_to_extend(r, n) for r, n in zip(admitted.reqs, admitted.lens))
        tokens = sum(r.extend_len for r in self.running) + sum(admitted.lens)
        extend = bool(admitted.reqs) or any(r.extend_len > 1 for r in self.running)
        self.speculator.plan(self.running, kv.available_pages - need - len(self.running), tokens, extend)
        faulted, self.speculator.faulted = self.speculator.faulted, []
        for req, e in faulted:
            self._fail_one(req, "choosing its drafts", e)

    def _admit(self) -> Admitted:
        budget = step_budget(self.args, self.kv, self.running, self.chunked, self.new_token_ratio)
        waiting = [] if self.admission_paused else self.waiting  # (a chunked prompt still goes on)
        admitted = admit(self.args, self.kv, waiting, self.running, self.chunked, self.new_token_ratio, budget)
        self.chunked = admitted.chunked
        for req, e in admitted.faulted:
            self._fail_one(req, "admitting it", e)
        for req in admitted.oversized:
            # prompts are checked against the pool on arrival, so this is a retracted request that
            # grew past it: it ends at the pool's limit, like one that reaches it while decoding
            log.warning("request %s needs KV for %d tokens, more than the pool holds; it ends there",
                        req.rid, req.seq_len)
            self._ended.append(self._end(req, Finish(FinishKind.LENGTH, len(req.output_ids))))
        return admitted

    def _make_room(self) -> None:
        r = make_room(self.kv, self.running, self.chunked)
        for req in r.retracted:
            req.draft = []
        if r.retracted:
            if self.chunked in r.retracted:
                self.chunked = None
            self.waiting[:0] = r.retracted
            self.new_token_ratio = self.args.init_new_token_ratio
            self.num_retractions += len(r.retracted)
        if r.ended is not None:
            self._ended.append(self._end(r.ended, Finish(FinishKind.LENGTH, len(r.ended.output_ids))))

    # ---- processing results ------------------------------------------------------------------

    def _process(self, b: ScheduledBatch, out: WorkerOutput) -> list[TokenOutput]:
        """Take a step's results, its lengths counted (`_count_extended`) and any placeholders
        dropped. The rows of requests that ended while it ran (a launched step) are dropped."""
        if out.drafts:  # the draft model's tokens in place of the placeholders, in packed order
            made = iter(out.drafts)
            for req in b.sampled:
                if req.drafts_pending:
                    req.draft = next(made)
        for req in b.reqs:
            if b.is_prefill(req) and req.finish is None:
                self.kv.share_prefill(req)
        self._store_prompt_logprobs(b, out)
        self._store_embeddings(b, out)
        faulted: dict[str, Finish] = {}  # requests whose own bookkeeping raised: they alone fail
        row = 0
        for req, count in zip(b.sampled, b.sample_counts):
            if req.finish is not None:  # ended while the step ran
                row += count
                continue
            try:
                if count == 1:
                    self._append_sampled(req, out, row)
                else:
                    self._take_verified(req, out, row)
            except Exception:  # noqa: BLE001 - a bug in one request's constraint must not stop the rest
                faulted[req.rid] = self._internal_error(req, "taking its sampled token")
            row += count
        outputs, self._ended = self._ended, []
        for req in b.reqs:
            if req is self.chunked or req.finish is not None:
                continue
            prefill = b.is_prefill(req)
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
                if not prefill:
                    self.running.remove(req)
                outputs.append(self._end(req, finish))
            else:
                if prefill:
                    self.running.append(req)
                outputs.append(self._output(req))
        return outputs

    def _append_sampled(self, req: Req, out: WorkerOutput, i: int) -> None:
        token = out.next_token_ids[i]
        req.output_ids.append(token)
        if req.guide is not None and token not in self.eos_ids:
            # NOTE: is_finished() only means "accepting": more tokens may still follow
            req.guide.advance(token)
        if req.return_logprob:
            req.output_logprobs.append(out.logprobs[i])
            if req.top_logprobs_num:
                k = req.top_logprobs_num
                req.output_top_logprobs.append(list(zip(out.top_logprobs[i][:k], out.top_logprob_ids[i][:k])))

    def _take_verified(self, req: Req, out: WorkerOutput, row: int) -> None:
        """A verify row's result (speculation.py): its drafts up to the first that differs from the
        token sampled in its place, then the token sampled after them, taken one by one as
        decoding would, so a stop ends it where it would have; the KV of what was not kept is freed."""
        draft, req.draft = req.draft, []
        kept = kept_prefix(draft, out.next_token_ids[row : row + len(draft)])
        for j in range(kept + 1):
            self._append_sampled(req, out, row + j)
            if j < kept and self._check_finish(req) is not None:
                break
        self.kv.truncate(req, req.seq_len - 1)  # the last token's KV comes with the next step, as always
        self.speculator.verified(req, len(draft), kept)

    def _internal_error(self, req: Req, doing: str, exc: BaseException | None = None) -> Finish:
        """How a request ends when our own code raised on it (`exc`, or the exception being
        handled): a 500 naming an error id (the log has the traceback under it). Its output may
        be half updated, so none of its own KV goes to the prefix cache: only the prefix it
        already shared stays."""
        error_id = uuid.uuid4().hex[:12]
        log.error("request %s failed while %s (error id %s)", req.rid, doing, error_id, exc_info=exc or True)
        if req.row is not None:
            self._drop_own_kv(req)
        return Finish(FinishKind.ABORT, f"internal error (error id {error_id})", status=500)

    def _fail_one(self, req: Req, doing: str, exc: Exception) -> None:
        """Our code raised on `req` while scheduling (admitting it, choosing its drafts): it alone
        ends, with a 500; everything else is scheduled as if it had never come."""
        self._dequeue(req)
        self._ended.append(self._end(req, self._internal_error(req, doing, exc)))

    def _drop_own_kv(self, req: Req) -> None:
        """Free a failed request's own KV (past its shared prefix); while a launched step still
        writes its pages, only once that step is taken back, so no page is handed out meanwhile
        (a KV tier would write into it at admission, while the step does too)."""
        if req.in_flight:
            req.drop_kv = True
        else:
            self.kv.truncate(req, req.prefix_len)

    def _fail(self, b: ScheduledBatch, reqs: list[Req], message: str, slots_given_back: bool = False) -> list[TokenOutput]:
        """Building or running batch `b` raised: `reqs` end with a 500 whose `message` names an error
        id (the log has the traceback under it); their KV up to this step goes to the cache, the
        pages this step allocated are freed, and every other request carries on."""
        if not slots_given_back:
            self._hand_back_slots(b)
        outputs, self._ended = self._ended, []
        for req in reqs:
            self._dequeue(req)
            outputs.append(self._end(req, Finish(FinishKind.ABORT, message, status=500)))
        return outputs

    # ---- jump-forward ------------------------------------------------------------------------

    @property
    def jumped_tokens(self) -> int:
        return self._jumper.jumped_tokens if self._jumper is not None else 0

    def _may_jump(self, req: Req) -> bool:
        if not self.jump_forward or req.guide is None:
            return False
        if self._jumper is None:
            jf = self.grammar.jump_forward
            if jf is None:
                return False
            self._jumper = JumpForwarder(jf, self.kv, self.eos_ids, self.context_length)
        return self._jumper.may_jump(req)

    def _jump_forward(self, req: Req, batch_size: int) -> int | None:
        """Forced text appended to `req` (see JumpForwarder.apply): the first output index that
        changed, or None. The pages it may take leave room for every request's next token."""
        owed = sum(self.kv.pages_to_extend(r, r.extend_len) for r in self.running if r.extend_len > 1)
        return self._jumper.apply(req, self.kv.available_pages - len(self.running) - batch_size - owed)

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

    def _store_embeddings(self, b: ScheduledBatch, out: WorkerOutput) -> None:
        """Embedding requests' hidden states of this step, pooled as they come (a mean's chunks summed).
        A chunk from position 0 starts the pool afresh: a mean's prompt is prefilled again from the
        start after a retraction (none of it comes from the cache), and its positions count once."""
        at = 0
        for req, first, count in b.embed_spans:
            part = out.embed_hidden[at : at + count].double().sum(0)
            if first == 0 or req.embed == "last":
                req.embed_sum, req.embed_count = part, count
            else:
                req.embed_sum, req.embed_count = req.embed_sum + part, req.embed_count + count
            at += count

    def _store_prompt_logprobs(self, b: ScheduledBatch, out: WorkerOutput) -> None:
        at = 0
        for req, first, count in b.logprob_spans:
            if req.input_logprobs is None:
                # position logprob_start_len's logprob; position 0 has none
                start = req.logprob_start_len
                req.input_logprobs = [None] if start == 0 else []
                req.input_top_logprobs = [None] if start == 0 else []
                req.input_ranks = [None] if start == 0 else []
            req.input_logprobs.extend(out.prompt_logprobs[at : at + count])
            req.input_ranks.extend(out.prompt_ranks[at : at + count])
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
        if (p.stop or p.stop_regex) and self.decode is not None and len(req.output_ids) >= p.min_new_tokens:
            matched = self._match_stop_string(req) if p.stop else None
            if matched is None and p.stop_regex:
                matched = self._match_stop_regex(req)
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

    def _match_stop_regex(self, req: Req) -> str | None:
        """The first stop regex found in the output's last STOP_REGEX_WINDOW characters (and the
        tokens not yet reported); SGLang's finish reason names the pattern, not the text."""
        window = STOP_REGEX_WINDOW + len(req.output_ids) - req.sent_len
        tail = self.decode(req.output_ids[-window:])[-window:]
        return next((r for r in req.params.stop_regex if re.search(r, tail)), None)

    def _end(self, req: Req, finish: Finish) -> TokenOutput:
        req.finish = finish
        del self._live[req.rid]
        if req.awaiting:  # a running step's token it will never take
            req.output_ids.pop()
            req.awaiting = False
        if req.row is not None:
            if req.in_flight:  # a launched step still reads its row and writes its pages
                self._deferred.append(req)
            else:
                self.kv.release(req)
        return self._output(req)

    def _output(self, req: Req) -> TokenOutput:
        new = req.output_ids[req.sent_len :]
        out = TokenOutput(
            rid=req.rid, new_token_ids=new, prompt_tokens=req.prompt_len, completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens, finish_reason=req.finish.to_dict() if req.finish else None,
            replaced=req.replaced, spec_verify_ct=req.spec_verify_ct, spec_proposed_tokens=req.spec_proposed,
            spec_accepted_tokens=req.spec_accepted,
        )
        req.replaced = 0
        if req.finish is not None and req.embed_count:
            out.embedding = (req.embed_sum / req.embed_count).float().tolist()
        if req.return_logprob:
            out.output_logprobs = req.output_logprobs[req.sent_len :]
            out.output_top_logprobs = req.output_top_logprobs[req.sent_len :]
            if req.input_logprobs is not None and not req.input_logprobs_sent and (req.output_ids or req.finish):
                out.input_logprobs, out.input_top_logprobs = req.input_logprobs, req.input_top_logprobs
                out.input_ranks = req.input_ranks
                req.input_logprobs_sent = True
        req.sent_len = len(req.output_ids)
        return out

