"""The tokenizer process: the hub that clients talk to.

Clients (the HTTP server, the Engine, the DSL) send `GenerateRequest`s on one
ROUTER socket. This process applies chat templates, tokenizes, validates,
forwards `TokenizedRequest`s to the scheduler, and turns the scheduler's token
outputs back into text incrementally, routed to the client that asked.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import zmq

from radixlm.runtime import ipc
from radixlm.runtime.args import ServerArgs
from radixlm.runtime.constrained.choices import (
    METHODS,
    ChoiceGroup,
    choice_boundary,
    greedy_run,
    result_meta,
)
from radixlm.runtime.constrained.grammar import constraint_key
from radixlm.runtime.constrained.jump_forward import RETOKENIZE_TOKENS
from radixlm.runtime.messages import (
    AbortRequest,
    BatchTokenOutput,
    ClientOutput,
    ControlOutput,
    ControlRequest,
    GenerateRequest,
    TokenizedRequest,
    TokenOutput,
)
from radixlm.runtime.native import BadRequest
from radixlm.runtime.reasoning import end_tag_ids, gate_ids
from radixlm.runtime.sampling_params import SamplingParams, SamplingParamsError
from radixlm.runtime.tokenizer.detokenizer import IncrementalDetokenizer

log = logging.getLogger("radixlm.tokenizer")


@dataclass
class _InFlight:
    client: bytes  # ROUTER identity of the client that asked
    req: GenerateRequest
    prompt_ids: list[int]
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)  # all output ids so far
    text: str = ""  # all output text so far
    sent_tokens: int = 0
    sent_text: int = 0
    resent: int = 0  # streamed ids that jump-forward re-encoded: the next chunk's ids replace them
    logprobs: list[list[Any]] = field(default_factory=list)
    top_logprobs: list[Any] = field(default_factory=list)
    input_logprobs: list[list[Any]] | None = None
    input_top_logprobs: list[Any] | None = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    group: ChoiceGroup | None = None  # set on the scoring requests of a `choices` request
    group_slot: int = 0
    stream_interval: int = 1  # a stream's chunks carry at least this many new tokens (the last may carry fewer)


class TokenizerManager:
    def __init__(self, args: ServerArgs, client_addr: str, to_scheduler: str, from_scheduler: str) -> None:
        from radixlm.runtime.tokenizer.loader import load_tokenizer
        from radixlm.runtime.worker.loader import load_config, resolve_model

        self.args = args
        source = resolve_model(args.model_path)
        config = load_config(source)
        self.vocab_size = config.vocab_size
        self.context_length = min(config.context_length, args.context_length or 1 << 62)
        self.model_name = source.name
        self.tokenizer = None if args.skip_tokenizer_init else load_tokenizer(source, args.tokenizer_path)
        self.reasoning_end_ids = end_tag_ids(args.reasoning_parser, self.tokenizer)
        self.ctx = zmq.Context()
        self.clients = ipc.socket(self.ctx, zmq.ROUTER, client_addr, bind=True)
        self.to_scheduler = ipc.socket(self.ctx, zmq.PUSH, to_scheduler, bind=True)
        self.from_scheduler = ipc.socket(self.ctx, zmq.PULL, from_scheduler, bind=True)
        self.in_flight: dict[str, _InFlight] = {}
        self.pending_control: dict[str, bytes] = {}
        self.choice_groups: dict[str, ChoiceGroup] = {}

    def run_forever(self) -> None:
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
            prompt_ids = self._prompt_ids(req)
            if "choices" in (req.sampling_params or {}):
                self._admit_choices(client, req, prompt_ids)
                return
            params = self._sampling_params(req, len(prompt_ids))
            gate = self._reasoning_gate(req, params)
        except (BadRequest, SamplingParamsError) as e:
            self._reply(client, ClientOutput(req.rid, finished=True, error=str(e), status=400))
            return
        detok = None
        if self.tokenizer is not None:
            replaceable = RETOKENIZE_TOKENS if constraint_key(params) is not None else 0
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens,
                                           params.spaces_between_special_tokens, params.stop, replaceable,
                                           keep_stop=params.no_stop_trim)
        self.in_flight[req.rid] = _InFlight(client, req, prompt_ids, detok, stream_interval=params.stream_interval)
        self.to_scheduler.send(ipc.encode(TokenizedRequest(
            req.rid, prompt_ids, params, req.return_logprob, req.logprob_start_len, req.top_logprobs_num, gate)))

    def _reasoning_gate(self, req: GenerateRequest, params: SamplingParams) -> list[int]:
        try:
            return gate_ids(req.require_reasoning, self.reasoning_end_ids, constraint_key(params) is not None)
        except ValueError as e:
            raise BadRequest(str(e)) from None

    def _admit_choices(self, client: bytes, req: GenerateRequest, prompt_ids: list[int]) -> None:
        """Score each choice with a prefill-only request; answer once all are scored."""
        raw = dict(req.sampling_params)
        choices, method = raw.pop("choices"), raw.pop("choices_method", METHODS[0])
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise BadRequest("choices must be a non-empty list of non-empty strings")
        if method not in METHODS:
            raise BadRequest(f"choices_method must be one of {', '.join(METHODS)}")
        if self.tokenizer is None:
            raise BadRequest("choices need a tokenizer")
        params = SamplingParams.from_dict({k: v for k, v in raw.items() if k != "max_new_tokens"} | {"max_new_tokens": 0})
        prompt_text = self.tokenizer.decode(prompt_ids) if req.text is None else req.text
        scored = []  # (ids, logprob start) per scoring request
        for choice in choices:
            full = self.tokenizer.encode(prompt_text + choice, add_special_tokens=False)
            scored.append((full, choice_boundary(prompt_ids, full)))
        group = ChoiceGroup(req.rid, client, choices, method, [b for _, b in scored], prompt_tokens=len(prompt_ids))
        if method == "unconditional_likelihood_normalized":
            # the same tokens after nothing but a start-of-text token
            start_token = self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.tokenizer.eos_token_id
            scored += [([start_token, *self.tokenizer.encode(c, add_special_tokens=False)], 1) for c in choices]
        for i, (ids, _) in enumerate(scored):  # check everything before sending anything
            if len(ids) >= self.context_length:
                raise BadRequest(f"prompt plus choice {i % len(choices)} exceeds the context length")
            if len(ids) < 2:
                raise BadRequest(f"choice {choices[i % len(choices)]!r} is too short to score without the prompt")
        for i, (ids, start) in enumerate(scored):
            sub = GenerateRequest(f"{req.rid}\x00choice{i}", input_ids=ids, return_logprob=True, logprob_start_len=start)
            self.in_flight[sub.rid] = _InFlight(client, sub, ids, None, group=group, group_slot=i)
            top = 1 if method == "greedy_token" else 0
            self.to_scheduler.send(ipc.encode(TokenizedRequest(sub.rid, ids, params, True, start, top)))
        self.choice_groups[req.rid] = group

    def _abort_choices(self, rid: str) -> None:
        group = self.choice_groups.pop(rid)
        for sub_rid in [r for r, st in self.in_flight.items() if st.group is group]:
            del self.in_flight[sub_rid]
            self.to_scheduler.send(ipc.encode(AbortRequest(sub_rid)))
        self._reply(group.client, ClientOutput(rid, "", [], {"id": rid, "finish_reason": {
            "type": "abort", "message": "aborted"}}, True))

    def _choice_scored(self, st: _InFlight, out: TokenOutput) -> None:
        group, n = st.group, len(st.group.choices)
        logprobs = [lp for lp, *_ in (st.input_logprobs or []) if lp is not None]
        if st.group_slot < n:
            group.conditional[st.group_slot] = logprobs
            group.cached_tokens = max(group.cached_tokens, out.cached_tokens)
            if group.method == "greedy_token":
                group.greedy_runs[st.group_slot] = greedy_run(st.input_logprobs or [], st.input_top_logprobs or [])
        else:
            group.unconditional[st.group_slot - n] = logprobs
        if not group.complete:
            return
        del self.choice_groups[group.rid]
        best, meta = result_meta(group)
        meta.update({"id": group.rid, "prompt_tokens": group.prompt_tokens, "completion_tokens": 0,
                     "cached_tokens": group.cached_tokens, "finish_reason": {"type": "stop", "matched": None}})
        self._reply(group.client, ClientOutput(group.rid, group.choices[best], [], meta, True))

    def _prompt_ids(self, req: GenerateRequest) -> list[int]:
        given = [x is not None for x in (req.text, req.input_ids, req.messages)]
        if sum(given) != 1:
            raise BadRequest("give exactly one of text, input_ids or messages")
        if req.input_ids is not None:
            ids = req.input_ids
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise BadRequest("input_ids must be a list of integers")
            if any(t < 0 or t >= self.vocab_size for t in ids):
                raise BadRequest(f"input_ids must lie in [0, {self.vocab_size})")
        else:
            if self.tokenizer is None:
                raise BadRequest("this server has no tokenizer (--skip-tokenizer-init): send input_ids")
            text = req.text if req.text is not None else self._chat_prompt(req)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise BadRequest("the prompt is empty")
        if len(ids) >= self.context_length:
            raise BadRequest(f"the prompt has {len(ids)} tokens; the context length is {self.context_length} "
                             "(prompt plus at least one new token must fit)")
        return list(ids)

    def _chat_prompt(self, req: GenerateRequest) -> str:
        from radixlm.runtime.tokenizer.loader import chat_prompt

        try:
            return chat_prompt(self.tokenizer, req.messages, req.tools, req.chat_template_kwargs)
        except ValueError as e:
            raise BadRequest(str(e)) from None

    def _sampling_params(self, req: GenerateRequest, prompt_len: int) -> SamplingParams:
        raw = dict(req.sampling_params or {})
        if raw.get("max_new_tokens", 0) is None:  # "as many as fit"
            raw["max_new_tokens"] = self.context_length - prompt_len
        params = SamplingParams.from_dict(raw)
        params.validate(self.vocab_size)
        if req.logprob_start_len >= prompt_len:
            raise BadRequest(f"logprob_start_len {req.logprob_start_len} must be below the prompt length {prompt_len}")
        if req.top_logprobs_num < 0 or req.top_logprobs_num > 20:
            raise BadRequest("top_logprobs_num must lie in [0, 20]")
        return params

    def _control(self, client: bytes, msg: ControlRequest) -> None:
        if msg.op == "model_info":
            self._reply(client, ControlOutput(msg.rid, {
                "model_path": self.args.model_path or self.model_name, "is_generation": True,
                "context_length": self.context_length, "vocab_size": self.vocab_size,
                "chat_template": getattr(self.tokenizer, "chat_template", None),
                "bos_token": getattr(self.tokenizer, "bos_token", None)}))
            return
        self.pending_control[msg.rid] = client
        self.to_scheduler.send(ipc.encode(msg))

    def _reply(self, client: bytes, msg: Any) -> None:
        self.clients.send_multipart([client, ipc.encode(msg)])

    # ---- scheduler ---------------------------------------------------------------------------

    def _from_scheduler(self, msg: Any) -> None:
        if isinstance(msg, ControlOutput):
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
            keep = len(st.token_ids) - out.replaced
            del st.token_ids[keep:]
            st.resent += max(st.sent_tokens - keep, 0)
            st.sent_tokens = min(st.sent_tokens, keep)
        st.token_ids.extend(out.new_token_ids)
        if st.first_token is None and out.new_token_ids:
            st.first_token = time.perf_counter()
        st.logprobs.extend([lp, t] for lp, t in zip(out.output_logprobs, out.new_token_ids))
        st.top_logprobs.extend(out.output_top_logprobs)
        if out.input_logprobs is not None:
            start = max(st.req.logprob_start_len, 0)
            st.input_logprobs = [[lp, t] for lp, t in zip(out.input_logprobs, st.prompt_ids[start:])]
            st.input_top_logprobs = out.input_top_logprobs
        finished = reason is not None
        if st.group is not None:  # a choice's scoring request
            if finished:
                del self.in_flight[out.rid]
                self._choice_scored(st, out)
            return
        if st.detok is not None:
            st.text += st.detok.replace(out.replaced, out.new_token_ids, flush=finished)
            if st.detok.stopped_on is not None and not finished:
                # the text found a stop string before the scheduler did: end it here and free its KV
                self.to_scheduler.send(ipc.encode(AbortRequest(out.rid)))
                reason, finished = {"type": "stop", "matched": st.detok.stopped_on}, True
        if finished:
            del self.in_flight[out.rid]
        if finished or (st.req.stream and len(st.token_ids) - st.sent_tokens >= st.stream_interval):
            self._reply(st.client, self._client_output(st, out, reason, finished))

    def _with_text(self, st: _InFlight, entries: list | None) -> list | None:
        """SGLang's logprob entries: [logprob, id, text], the text None unless the request asked for it."""
        if entries is None:
            return None
        if not st.req.return_text_in_logprobs or self.tokenizer is None:
            return [[e[0], e[1], None] for e in entries]
        return [[e[0], e[1], self.tokenizer.decode([e[1]])] for e in entries]

    def _client_output(self, st: _InFlight, out: TokenOutput, reason: dict | None, finished: bool) -> ClientOutput:
        meta: dict[str, Any] = {
            "id": st.req.rid, "prompt_tokens": out.prompt_tokens, "completion_tokens": len(st.token_ids),
            "cached_tokens": out.cached_tokens, "finish_reason": reason,
        }
        if finished:
            now = time.perf_counter()
            meta["e2e_latency"] = now - st.arrival
            if st.first_token is not None:
                meta["time_to_first_token"] = st.first_token - st.arrival
        stream = st.req.stream
        if st.req.return_logprob:
            lo = st.sent_tokens if stream else 0
            meta["output_token_logprobs"] = self._with_text(st, st.logprobs[lo:])
            meta["output_top_logprobs"] = [self._with_text(st, top) for top in st.top_logprobs[lo:]]
            # SGLang always has the prompt's lists: empty when none were asked for (logprob_start_len -1)
            meta["input_token_logprobs"] = self._with_text(st, st.input_logprobs or [])
            meta["input_top_logprobs"] = [self._with_text(st, top) for top in st.input_top_logprobs or []]
        ids = st.token_ids[st.sent_tokens:] if stream else st.token_ids
        if stream and st.resent:
            meta["replaced_tokens"], st.resent = st.resent, 0
        text = st.text[st.sent_text:] if stream else st.text
        st.sent_tokens, st.sent_text = len(st.token_ids), len(st.text)
        return ClientOutput(st.req.rid, text, ids, meta, finished)


def run_tokenizer_process(args: ServerArgs, client_addr: str, to_scheduler: str, from_scheduler: str,
                          ready: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    ipc.die_with_parent("radixlm-tok")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        manager = TokenizerManager(args, client_addr, to_scheduler, from_scheduler)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which exits with it
        log.exception("tokenizer failed to start")
        ready.send({"error": f"{type(e).__name__}: {e}"})
        return
    ready.send({"ok": True, "has_tokenizer": manager.tokenizer is not None})
    manager.run_forever()
