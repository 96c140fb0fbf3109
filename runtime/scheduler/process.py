"""The scheduler process: receive requests, step the scheduler, send token outputs (started by
`launch.run_child`)."""

from __future__ import annotations

import logging
import signal
import uuid

import zmq

from radixlm.runtime import ipc
from radixlm.runtime.args import ServerArgs
from radixlm.runtime.constrained.grammar import compiler_factory
from radixlm.runtime.messages import (AbortRequest, BatchTokenOutput, ControlOutput, ControlRequest, SchedulerLimits,
                                      TokenizedRequest, TokenOutput)
from radixlm.runtime.model_config import ModelSource
from radixlm.runtime.native import BadRequest
from radixlm.runtime.scheduler.scheduler import DeviceLost, Scheduler
from radixlm.runtime.worker.parallel import init_group, place_rank, placement

log = logging.getLogger("radixlm.scheduler")


class _Stop(Exception):
    """SIGTERM arrived outside a step."""


class SchedulerProcess:
    def __init__(self, args: ServerArgs, recv_from: str, send_to: str, cpus: list[int] | None = None) -> None:
        """`cpus`: tensor-parallel rank 0's share of the machine's cores (launch.start_processes), or None."""
        from radixlm.runtime.tokenizer.loader import load_tokenizer
        from radixlm.runtime.model_config import resolve_model
        from radixlm.runtime.worker.model_worker import ModelWorker

        place_rank(args, cpus)
        source = resolve_model(args.model_path)
        tokenizer = None if args.skip_tokenizer_init else load_tokenizer(source, args.tokenizer_path)
        decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=False)) if tokenizer else None
        self.worker = ModelWorker(args, source, tp=init_group(args, rank=0))
        grammar = None
        if tokenizer is not None:
            grammar = compiler_factory(tokenizer, self.worker.config.vocab_size, self.worker.config.eos_token_ids,
                                       args.constraint_timeout, args.grammar_backend)
        self.scheduler = Scheduler(args, self.worker, decode=decode, grammar=grammar)
        self.ctx = zmq.Context()
        self.inbox = ipc.socket(self.ctx, zmq.PULL, recv_from, bind=False)
        self.outbox = ipc.socket(self.ctx, zmq.PUSH, send_to, bind=False)
        # the tokenizer process checks requests against these before it takes any (TokenizerManager.run_forever)
        w = self.worker
        self.outbox.send(ipc.encode(SchedulerLimits(kv_pool_tokens=w.num_pages * w.page_size,
                                                    vocab_size=w.config.vocab_size, context_length=w.context_length)))
        self._stepping = self._stopping = False
        self._update: tuple[str, ModelSource] | None = None  # a weight update waiting for the running requests
        signal.signal(signal.SIGTERM, self._on_terminate)

    def _on_terminate(self, signum: int, frame: object) -> None:
        """The parent stops the runtime: leave the loop between steps, never inside one, so that
        the shutdown (the KV tier's last save) reads a consistent tree."""
        self._stopping = True
        if not self._stepping:
            raise _Stop

    def ready_info(self) -> dict:
        """What the parent learns when this process is ready (launch.run_child sends it)."""
        w = self.worker
        return {"context_length": w.context_length, "vocab_size": w.config.vocab_size,
                "max_total_tokens": w.num_pages * w.page_size, "page_size": w.page_size,
                "architecture": w.config.architecture, "dtype": str(w.dtype).removeprefix("torch."),
                "device": str(w.device), "placement": placement()}

    def run_forever(self) -> None:
        try:
            self._loop()
        except _Stop:
            pass
        self.scheduler.shutdown()

    def _loop(self) -> None:
        s = self.scheduler
        while not self._stopping:
            if self._update is not None and not s.busy:
                self._finish_update()
            self._receive(block=not s.has_runnable_work)
            if s.has_work:
                self._stepping = True
                try:
                    outputs = s.step()
                except DeviceLost as e:
                    self._send(s.fail_all(str(e)))
                    log.critical("%s; the scheduler exits so that the server stops", e, exc_info=e)
                    raise SystemExit(1) from None
                finally:
                    self._stepping = False
                self._send(outputs)

    def _receive(self, block: bool) -> None:
        """Take every message waiting; with `block`, first sleep until a message comes or, while
        requests wait on their constraints, a compile ends (never spinning meanwhile)."""
        if block:
            poller = zmq.Poller()
            poller.register(self.inbox, zmq.POLLIN)
            fd = self.scheduler.compile_wakeup_fd
            if fd is not None:
                poller.register(fd, zmq.POLLIN)
            poller.poll()
            if fd is not None:
                self.scheduler.grammar.drain_ready()
        while self.inbox.poll(0):
            self._handle(ipc.decode(self.inbox.recv()))

    def _handle(self, msg: object) -> None:
        if isinstance(msg, TokenizedRequest):
            try:
                self.scheduler.add_request(msg)
            except BadRequest as e:  # constrained decoding could not start for this model
                self._send([_refused(msg, str(e))])
            except Exception:  # noqa: BLE001 - our bug, on this request alone: a 500, and serve on
                error_id = uuid.uuid4().hex[:12]
                log.exception("taking request %s failed (error id %s)", msg.rid, error_id)
                self._send([_refused(msg, f"internal error while taking the request (error id {error_id})", 500)])
        elif isinstance(msg, AbortRequest):
            out = self.scheduler.abort(msg.rid)
            if out is not None:
                self._send([out])
        elif isinstance(msg, ControlRequest) and msg.op == "update_weights":
            self._begin_update(msg)
        elif isinstance(msg, ControlRequest) and msg.op in ("load_lora", "unload_lora"):
            self.outbox.send(ipc.encode(ControlOutput(msg.rid, self._lora_op(msg.op, msg.args or {}))))
        elif isinstance(msg, ControlRequest):
            self.outbox.send(ipc.encode(ControlOutput(msg.rid, self._control(msg.op, msg.args or {}))))

    def _lora_op(self, op: str, args: dict) -> dict:
        """/load_lora_adapter, /unload_lora_adapter: an adapter checked and laid out (or dropped)
        between steps. One that requests still name is not unloaded (409)."""
        from radixlm.runtime.worker.lora import LoraError

        name = args.get("lora_name")
        try:
            if op == "load_lora":
                self.worker.load_lora(name, args.get("lora_path"))
                return {"success": True, "message": f"adapter {name!r} loaded"}
            users = self.scheduler.lora_users(name)
            if users:
                return {"success": False, "status": 409,
                        "message": f"adapter {name!r} is in use by {users} request(s): unload it once they end"}
            self.worker.unload_lora(name)
            self.scheduler.kv.retire_lora_namespace(name)  # a later adapter of that name shares nothing cached
            return {"success": True, "message": f"adapter {name!r} unloaded"}
        except (LoraError, OSError) as e:
            return {"success": False, "status": 400, "message": str(e)}

    def _begin_update(self, msg: ControlRequest) -> None:
        """/update_weights_from_disk: the checkpoint checked now (a bad one is answered at once);
        then, as SGLang does, the running requests finish on the old weights (or, asked to, are
        aborted) while new ones wait, and the update is made once none runs (`_finish_update`)."""
        args = msg.args or {}
        if self._update is not None:
            reply = {"success": False, "message": "another weight update is in progress", "status": 409}
            self.outbox.send(ipc.encode(ControlOutput(msg.rid, reply)))
            return
        try:
            source = self.worker.check_update(args.get("model_path"))
        except ValueError as e:
            self.outbox.send(ipc.encode(ControlOutput(msg.rid, {"success": False, "message": str(e), "status": 400})))
            return
        if args.get("abort_all_requests"):
            self._send([out for rid in list(self.scheduler.live_ids) if (out := self.scheduler.abort(rid))])
        self.scheduler.admission_paused = True
        self._update = (msg.rid, source)

    def _finish_update(self) -> None:
        rid, source = self._update
        self._update = None
        try:
            self.scheduler.update_weights(source)
            reply = {"success": True, "message": f"serving the weights of {source.path}"}
        except Exception as e:  # noqa: BLE001 - the old weights serve on; the caller learns why
            self.scheduler.admission_paused = False
            error_id = uuid.uuid4().hex[:12]
            log.exception("updating the weights from %s failed (error id %s)", source.path, error_id)
            reply = {"success": False, "message": f"loading {source.path} failed: {type(e).__name__}: {e} "
                                                  f"(error id {error_id}); the old weights serve on", "status": 500}
        self.outbox.send(ipc.encode(ControlOutput(rid, reply)))

    def _control(self, op: str, args: dict) -> dict:
        if op == "flush_cache":
            return {"success": self.scheduler.flush_cache()}
        if op == "server_info":
            s = self.scheduler
            return {
                "running_requests": len(s.running), "waiting_requests": len(s.waiting),
                "kv_pool_tokens": s.kv.num_pages * s.kv.page_size, "page_size": s.kv.page_size,
                "free_tokens": s.kv.allocator.num_free_pages * s.kv.page_size,
                "cached_tokens": (s.kv.cache.evictable_pages + s.kv.cache.locked_pages) * s.kv.page_size,
                # sliding-window models: tokens whose sliding layers' K/V are held (the rest: global layers only)
                "window_tokens": s.kv.window_bound_tokens,
                "num_retractions": s.num_retractions,
                "overlap_schedule": s.overlap, "overlapped_steps": s.overlapped_steps,
                "context_length": s.context_length,
                "speculative_stats": s.speculator.stats() if s.speculator is not None else None,
                "kv_tier": s.kv.tier.store.info() if s.kv.tier is not None else None,
                **s.worker.weights_info(), **s.worker.kv_info(),
            }
        if op == "check_accounting":
            try:
                self.scheduler.check_accounting()
            except AssertionError as e:
                return {"ok": False, "error": str(e)}
            kv = self.scheduler.kv
            return {"ok": True, "idle": not self.scheduler.has_work, "locked_pages": kv.cache.locked_pages,
                    "free_pages": kv.allocator.num_free_pages, "evictable_pages": kv.cache.evictable_pages,
                    "pool_pages": kv.num_pages, "live": self._live_requests()}
        if op == "dashboard":
            return self._dashboard(args.get("since"))
        return {"error": f"unknown control op {op!r}"}

    def _dashboard(self, since: float | None, max_nodes: int = 64, text_tokens: int = 64) -> dict:
        """What the live view shows: the queues, the latest step, the KV pages by state, the step
        log after `since` (step_log.py), and the radix tree's largest prefixes (each node's first
        `text_tokens` tokens decoded), taken now."""
        s, kv = self.scheduler, self.scheduler.kv
        free, evictable, locked = kv.allocator.num_free_pages, kv.cache.evictable_pages, kv.cache.locked_pages
        tree = kv.cache.snapshot(max_nodes, text_tokens)
        if s.decode is not None:
            stack = [tree]
            while stack:
                node = stack.pop()
                node["head_text"] = s.decode(node["head"])
                stack.extend(node["children"])
        return {"running_requests": len(s.running), "waiting_requests": len(s.waiting),
                "pending_requests": len(s.pending), "chunked_request": s.chunked is not None,
                **s.step_log.activity(), **s.step_log.history(since),
                "page_size": kv.page_size, "pool_pages": kv.num_pages, "free_pages": free,
                "evictable_pages": evictable, "locked_pages": locked,
                "request_pages": kv.num_pages - free - evictable - locked, "tree": tree}

    def _live_requests(self, limit: int = 8) -> list[dict]:
        """Where the requests in flight stand (the first `limit`), so a check that finds the
        scheduler busy can say with what."""
        s = self.scheduler
        where = [("chunked", [s.chunked] if s.chunked is not None else []), ("running", s.running),
                 ("waiting", s.waiting), ("pending", s.pending)]
        return [{"rid": r.rid, "where": name, "prompt_tokens": len(r.prompt_ids),
                 "output_tokens": len(r.output_ids), "max_new_tokens": r.params.max_new_tokens}
                for name, reqs in where for r in reqs][:limit]

    def _send(self, outputs: list[TokenOutput]) -> None:
        if outputs:
            self.outbox.send(ipc.encode(BatchTokenOutput(outputs)))


def _refused(req: TokenizedRequest, message: str, status: int = 400) -> TokenOutput:
    return TokenOutput(req.rid, [], len(req.input_ids), 0, 0, finish_reason={"type": "abort", "message": message,
                                                                               "status": status})
