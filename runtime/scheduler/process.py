"""The scheduler process: receive requests, step the scheduler, send token outputs (started by
`launch.run_child`)."""

from __future__ import annotations

import logging
import signal
import uuid
from typing import Callable, TypeVar

import zmq

from radixlm.runtime import ipc
from radixlm.runtime.args import ServerArgs
from radixlm.runtime.constrained.grammar import compiler_factory
from radixlm.runtime.messages import (AbortRequest, BatchTokenOutput, ControlOutput, ControlRequest, SchedulerLimits,
                                      TokenizedRequest, TokenOutput)
from radixlm.runtime.native import BadRequest
from radixlm.runtime.scheduler.control import Control
from radixlm.runtime.scheduler.scheduler import DeviceLost, Scheduler
from radixlm.runtime.worker.parallel import init_group, place_rank, placement

log = logging.getLogger("radixlm.scheduler")
T = TypeVar("T")


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
        self.control = Control(self.scheduler, args.served_name(source))
        self.ctx = zmq.Context()
        self.inbox = ipc.socket(self.ctx, zmq.PULL, recv_from, bind=False)
        self.outbox = ipc.socket(self.ctx, zmq.PUSH, send_to, bind=False)
        # the tokenizer process checks requests against these before it takes any (TokenizerManager.run_forever)
        w = self.worker
        self.outbox.send(ipc.encode(SchedulerLimits(kv_pool_tokens=w.num_pages * w.page_size,
                                                    vocab_size=w.config.vocab_size, context_length=w.context_length)))
        self._stepping = self._stopping = False
        self._update_rid: str | None = None  # the request of the weight update waiting (control.begin_update)
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
            if self.control.update_ready:
                rid, self._update_rid = self._update_rid, None
                self.outbox.send(ipc.encode(ControlOutput(rid, self.control.finish_update())))
            self._receive(block=not s.has_runnable_work)
            if s.has_work:
                self._send(self._as_step(s.step))

    def _as_step(self, work: Callable[[], T]) -> T:
        """Run `work` as a step is run (a step, or a control op that may take one back): SIGTERM
        waits for it, and a device lost meanwhile ends the process (every request in flight
        answered with a 500), so that the server stops."""
        self._stepping = True
        try:
            return work()
        except DeviceLost as e:
            self._send(self.scheduler.fail_all(str(e)))
            log.critical("%s; the scheduler exits so that the server stops", e, exc_info=e)
            raise SystemExit(1) from None
        finally:
            self._stepping = False

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
            except BadRequest as e:  # its adapter is not served, or constrained decoding cannot start
                self._send([_refused(msg, str(e))])
            except Exception:  # noqa: BLE001 - our bug, on this request alone: a 500, and serve on
                error_id = uuid.uuid4().hex[:12]
                log.exception("taking request %s failed (error id %s)", msg.rid, error_id)
                self._send([_refused(msg, f"internal error while taking the request (error id {error_id})", 500)])
        elif isinstance(msg, AbortRequest):
            out = self.scheduler.abort(msg.rid)
            if out is not None:
                self._send([out])
        elif isinstance(msg, ControlRequest):
            reply = self._as_step(lambda: self._control(msg))
            if reply is not None:
                self.outbox.send(ipc.encode(ControlOutput(msg.rid, reply)))

    def _control(self, msg: ControlRequest) -> dict | None:
        """A control op's answer (control.py); None for a weight update, answered once it is made
        (`_loop`). An op that raises is a 500 naming an error id, and the scheduler serves on."""
        args = msg.args or {}
        try:
            if msg.op != "update_weights":
                return self.control.answer(msg.op, args)
            reply = self.control.begin_update(args.get("model_path"), bool(args.get("abort_all_requests")))
            if reply is None:
                self._update_rid = msg.rid
            return reply
        except DeviceLost:
            raise
        except Exception:  # noqa: BLE001 - our bug, on this op alone
            error_id = uuid.uuid4().hex[:12]
            log.exception("control op %s failed (error id %s)", msg.op, error_id)
            return {"success": False, "message": f"internal error in {msg.op} (error id {error_id})", "status": 500}

    def _send(self, outputs: list[TokenOutput]) -> None:
        if outputs:
            self.outbox.send(ipc.encode(BatchTokenOutput(outputs)))


def _refused(req: TokenizedRequest, message: str, status: int = 400) -> TokenOutput:
    return TokenOutput(req.rid, [], len(req.input_ids), 0, 0, finish_reason={"type": "abort", "message": message,
                                                                               "status": status})
