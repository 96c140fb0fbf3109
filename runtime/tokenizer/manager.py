"""The tokenizer process: the hub that clients talk to.

Clients (the HTTP server, the Engine, the DSL) send `GenerateRequest`s on one ROUTER socket.
This process owns the traffic: it prepares each request (`prepare.py`, shared with LocalEngine:
chat template, tokenize, validate), forwards the `TokenizedRequest` to the scheduler, and routes
the scheduler's token outputs back to the client that asked, gathered by `output.py`'s
`RequestOutput` (also LocalEngine's) with the text decoded incrementally and early stop strings
caught here; streams go out in chunks. A `choices` request's scoring requests are planned and
scored by `choices.py`; this process only sends them and answers when the last returns.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq

from radixlm.runtime import ipc
from radixlm.runtime.args import ServerArgs
from radixlm.runtime.constrained.choices import ChoiceGroup
from radixlm.runtime.constrained.jump_forward import RETOKENIZE_TOKENS
from radixlm.runtime.constrained.vocabulary import detect_style, token_decoder
from radixlm.runtime.messages import (
    AbortRequest,
    BatchTokenOutput,
    ClientOutput,
    ControlOutput,
    ControlRequest,
    GenerateRequest,
    SchedulerLimits,
    TokenOutput,
)
from radixlm.runtime.native import BadRequest
from radixlm.runtime.sampling_params import SamplingParamsError
from radixlm.runtime.tokenizer.choices import answer, is_choices, record_score, scoring_requests
from radixlm.runtime.tokenizer.detokenizer import IncrementalDetokenizer
from radixlm.runtime.tokenizer.output import RequestOutput
from radixlm.runtime.tokenizer.prepare import RequestPreparer

log = logging.getLogger("radixlm.tokenizer")


@dataclass
class _InFlight:
    client: bytes  # ROUTER identity of the client that asked
    gathered: RequestOutput  # its outputs so far (ids, logprobs, counts)
    detok: IncrementalDetokenizer | None
    stream: bool = False
    text: str = ""  # all output text so far
    sent_tokens: int = 0
    sent_text: int = 0
    resent: int = 0  # streamed ids that jump-forward re-encoded: the next chunk's ids replace them
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    group: ChoiceGroup | None = None  # set on the scoring requests of a `choices` request
    group_slot: int = 0
    stream_interval: int = 1  # a stream's chunks carry at least this many new tokens (the last may carry fewer)


class TokenizerManager:
    def __init__(self, args: ServerArgs, client_addr: str, to_scheduler: str, from_scheduler: str) -> None:
        from radixlm.runtime.model_config import resolve_model
        from radixlm.runtime.tokenizer.loader import load_tokenizer

        self.args = args
        source = resolve_model(args.model_path)
        self.model_name = source.name
        self.vocab_size = self.context_length = 0  # the model's, from the scheduler's limits (run_forever)
        self.tokenizer = None if args.skip_tokenizer_init else load_tokenizer(source, args.tokenizer_path)
        self.prep: RequestPreparer  # once the scheduler's limits arrive (run_forever)
        self.ctx = zmq.Context()
        self.clients = ipc.socket(self.ctx, zmq.ROUTER, client_addr, bind=True)
        self.to_scheduler = ipc.socket(self.ctx, zmq.PUSH, to_scheduler, bind=True)
        self.from_scheduler = ipc.socket(self.ctx, zmq.PULL, from_scheduler, bind=True)
        self.in_flight: dict[str, _InFlight] = {}
        self.pending_control: dict[str, bytes] = {}
        self.pending_updates: dict[str, str] = {}  # weight updates asked for: their model_path
        self.choice_groups: dict[str, ChoiceGroup] = {}

    def ready_info(self) -> dict:
        """What the parent learns when this process is ready (launch.run_child sends it)."""
        return {"has_tokenizer": self.tokenizer is not None}

    def run_forever(self) -> None:
        # the scheduler's first message; clients wait in the socket until requests can be checked
        limits = ipc.decode(self.from_scheduler.recv())
        assert isinstance(limits, SchedulerLimits), limits
        self.vocab_size, self.context_length = limits.vocab_size, limits.context_length
        self.prep = RequestPreparer(self.tokenizer, self.vocab_size, self.context_length, limits.kv_pool_tokens,
                                    self.args.reasoning_parser)
        poller = zmq.Poller()
        poller.register(self.clients, zmq.POLLIN)
        poller.register(self.from_scheduler, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self.from_scheduler in ready:
                self._from_scheduler(ipc.decode(self.from_scheduler.recv()))
            if self.clients in ready:
                client, raw = self.clients.recv_multipart()
                self._from_client(client, raw)

    # ---- clients -----------------------------------------------------------------------------

    def _from_client(self, client: bytes, raw: bytes) -> None:
        try:
            msg = ipc.decode(raw)
        except Exception as e:  # noqa: BLE001 - a malformed message must not stop the hub
            log.warning("undecodable client message: %s", e)
            return
        if isinstance(msg, GenerateRequest):
            self._admit(client, msg)
        elif isinstance(msg, AbortRequest):
            if msg.rid in self.in_flight:
                self.to_scheduler.send(ipc.encode(msg))
            elif msg.rid in self.choice_groups:
                self._abort_choices(msg.rid)
        elif isinstance(msg, ControlRequest):
            self._control(client, msg)

    def _admit(self, client: bytes, req: GenerateRequest) -> None:
        try:
            if req.rid in self.in_flight or req.rid in self.choice_groups:
                raise BadRequest(f"request id {req.rid!r} is already in flight")
            if is_choices(req):
                self._admit_choices(client, req)
                return
            tr = self.prep.prepare(req)
        except (BadRequest, SamplingParamsError) as e:
            self._reply(client, ClientOutput(req.rid, finished=True, error=str(e), status=400))
            return
        params = tr.sampling_params
        detok = None
        if self.tokenizer is not None:
            replaceable = RETOKENIZE_TOKENS if tr.constraint is not None else 0
            detok = IncrementalDetokenizer(self.tokenizer, tr.input_ids, params.skip_special_tokens,
                                           params.spaces_between_special_tokens, params.stop, replaceable,
                                           keep_stop=params.no_stop_trim)
        out = RequestOutput(tr, self.tokenizer, req.return_text_in_logprobs, req.return_prompt_token_ids)
        self.in_flight[req.rid] = _InFlight(client, out, detok, req.stream, stream_interval=params.stream_interval)
        self.to_scheduler.send(ipc.encode(tr))

    def _admit_choices(self, client: bytes, req: GenerateRequest) -> None:
        """Score each choice with a prefill-only request; answer once all are scored."""
        scoring = scoring_requests(self.prep, req, client)
        for i, tr in enumerate(scoring.requests):
            self.in_flight[tr.rid] = _InFlight(client, RequestOutput(tr), None, group=scoring.group, group_slot=i)
            self.to_scheduler.send(ipc.encode(tr))
        self.choice_groups[req.rid] = scoring.group

    def _abort_choices(self, rid: str) -> None:
        group = self.choice_groups.pop(rid)
        for sub_rid in [r for r, st in self.in_flight.items() if st.group is group]:
            del self.in_flight[sub_rid]
            self.to_scheduler.send(ipc.encode(AbortRequest(sub_rid)))
        self._reply(group.client, ClientOutput(rid, "", [], {"id": rid, "finish_reason": {
            "type": "abort", "message": "aborted"}}, True))

    def _choice_scored(self, st: _InFlight) -> None:
        group = st.group
        record_score(group, st.group_slot, st.gathered)
        if not group.complete:
            return
        del self.choice_groups[group.rid]
        text, meta = answer(group)
        self._reply(group.client, ClientOutput(group.rid, text, [], meta, True))

    def _control(self, client: bytes, msg: ControlRequest) -> None:
        if msg.op in ("tokenize", "detokenize"):
            self._reply(client, ControlOutput(msg.rid, self._tokens(msg.op, msg.args or {})))
            return
        if msg.op == "model_info":
            self._reply(client, ControlOutput(msg.rid, {
                "model_path": self.args.model_path or self.model_name, "is_generation": True,
                "context_length": self.context_length, "vocab_size": self.vocab_size,
                "chat_template": getattr(self.tokenizer, "chat_template", None),
                "bos_token": getattr(self.tokenizer, "bos_token", None)}))
            return
        self.pending_control[msg.rid] = client
        if msg.op == "update_weights":  # model_info names the weights served once it succeeds
            self.pending_updates[msg.rid] = (msg.args or {}).get("model_path")
        self.to_scheduler.send(ipc.encode(msg))

    def _tokens(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """/tokenize, /detokenize and the Messages API's count_tokens, answered here (the tokenizer
        is this process's): `text` (with `add_special_tokens`: the tokenizer's own, as a text prompt
        is encoded) or chat `messages` (with `tools`, `chat_template_kwargs` and
        `add_generation_prompt`, rendered as a chat request's prompt is) -> `input_ids`; `ids` ->
        `text`; with `pieces`, each token's string ("tokens", vLLM's) or text ("text", llama.cpp's).
        A bad input: `error`, `status`."""
        if self.tokenizer is None:
            return {"error": "this server has no tokenizer (--skip-tokenizer-init)", "status": 400}
        try:
            if op == "detokenize":
                ids = args.get("ids")
                if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise BadRequest("tokens must be a list of integers")
                if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
                    raise BadRequest(f"tokens must lie in [0, {self.vocab_size})")
                out: dict[str, Any] = {"text": self.tokenizer.decode(ids, skip_special_tokens=False)}
            else:
                out = {"input_ids": self._tokenize(args)}
            pieces = args.get("pieces")
            if pieces:
                tokens = self.tokenizer.convert_ids_to_tokens(out.get("input_ids", args.get("ids")))
                out["pieces"] = tokens if pieces == "tokens" else [self._piece(t) for t in tokens]
            return out
        except BadRequest as e:
            return {"error": str(e), "status": 400}

    def _tokenize(self, args: dict[str, Any]) -> list[int]:
        if args.get("messages") is not None:
            req = GenerateRequest("tokenize", messages=args["messages"], tools=args.get("tools"),
                                  chat_template_kwargs=args.get("chat_template_kwargs"))
            text = self.prep.chat_prompt(req, args.get("add_generation_prompt", True))
            return self.tokenizer.encode(text, add_special_tokens=False)  # (the template writes them)
        if not isinstance(args.get("text"), str):
            raise BadRequest("give a prompt (a string) or messages to tokenize")
        if args.get("add_special_tokens"):
            return self.prep.encode(args["text"])  # as a text prompt is fed
        return self.tokenizer.encode(args["text"], add_special_tokens=False)

    @functools.cached_property
    def _token_bytes(self) -> Callable[[str], bytes]:
        return token_decoder(detect_style(self.tokenizer, self.tokenizer.get_vocab()))

    def _piece(self, token: str) -> str | list[int]:
        """llama.cpp's piece of a token: its text (" world", not the vocabulary's "Ġworld"), or its
        bytes where they are not UTF-8 on their own."""
        raw = self._token_bytes(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return list(raw)

    def _reply(self, client: bytes, msg: Any) -> None:
        self.clients.send_multipart([client, ipc.encode(msg)])

    # ---- scheduler ---------------------------------------------------------------------------

    def _from_scheduler(self, msg: Any) -> None:
        if isinstance(msg, ControlOutput):
            path = self.pending_updates.pop(msg.rid, None)
            if path is not None and msg.data.get("success"):
                self.args.model_path = path
            client = self.pending_control.pop(msg.rid, None)
            if client is not None:
                self._reply(client, msg)
            return
        assert isinstance(msg, BatchTokenOutput)
        for out in msg.outputs:
            state = self.in_flight.get(out.rid)
            if state is not None:
                self._progress(state, out)

    def _progress(self, st: _InFlight, out: TokenOutput) -> None:
        reason = out.finish_reason
        if reason is not None and reason.get("status"):  # refused by the scheduler
            del self.in_flight[out.rid]
            rid = st.group.rid if st.group is not None else out.rid
            if st.group is not None and self.choice_groups.pop(rid, None) is None:
                return  # the group already failed
            self._reply(st.client, ClientOutput(rid, finished=True, error=reason["message"], status=reason["status"]))
            return
        if out.replaced:
            keep = len(st.gathered.token_ids) - out.replaced
            st.resent += max(st.sent_tokens - keep, 0)
            st.sent_tokens = min(st.sent_tokens, keep)
        st.gathered.add(out)
        if st.first_token is None and out.new_token_ids:
            st.first_token = time.perf_counter()
        finished = reason is not None
        if st.group is not None:  # a choice's scoring request
            if finished:
                del self.in_flight[out.rid]
                self._choice_scored(st)
            return
        if st.detok is not None:
            st.text += st.detok.replace(out.replaced, out.new_token_ids, flush=finished)
            if st.detok.stopped_on is not None and not finished:
                # the text found a stop string before the scheduler did: end it here and free its KV
                self.to_scheduler.send(ipc.encode(AbortRequest(out.rid)))
                reason, finished = {"type": "stop", "matched": st.detok.stopped_on}, True
        if finished:
            del self.in_flight[out.rid]
        if finished or (st.stream and len(st.gathered.token_ids) - st.sent_tokens >= st.stream_interval):
            self._reply(st.client, self._client_output(st, reason, finished))

    def _client_output(self, st: _InFlight, reason: dict | None, finished: bool) -> ClientOutput:
        """The next output to the client: all of it, or (a stream) what is new since the last chunk;
        the text from the incremental detokenizer, the rest from the request's RequestOutput."""
        meta = st.gathered.meta(reason, first=not (st.sent_tokens or st.sent_text))
        if finished:
            now = time.perf_counter()
            meta["e2e_latency"] = now - st.arrival
            if st.first_token is not None:
                meta["time_to_first_token"] = st.first_token - st.arrival
        stream = st.stream
        meta.update(st.gathered.logprob_meta(st.sent_tokens if stream else 0))
        ids = st.gathered.token_ids[st.sent_tokens:] if stream else list(st.gathered.token_ids)
        if stream and st.resent:
            meta["replaced_tokens"], st.resent = st.resent, 0
        text = st.text[st.sent_text:] if stream else st.text
        st.sent_tokens, st.sent_text = len(st.gathered.token_ids), len(st.text)
        return ClientOutput(st.gathered.rid, text, ids, meta, finished)
