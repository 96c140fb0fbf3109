"""The in-process Python API: `LocalEngine(...).generate(...)`.

The engine prepares requests (`tokenizer/prepare.py`, as the tokenizer process does), feeds the
scheduler, runs steps until its requests are done, and assembles their results
(`tokenizer/output.py`); `choices` requests are scored as the served runtime scores them
(`tokenizer/choices.py`). The served runtime puts each part in its own process; the engine's
API stays the same. It owns only the stepping loop and the model it loaded; its control
operations (adapters, weight updates, the cache) go through the scheduler process's own path
(scheduler/control.py).
"""

from __future__ import annotations

from typing import Any

from radixlm.runtime.args import ServerArgs
from radixlm.runtime.constrained.grammar import compiler_factory
from radixlm.runtime.messages import GenerateRequest, TokenizedRequest, TokenOutput
from radixlm.runtime.model_config import resolve_model
from radixlm.runtime.native import BadRequest, GenerateAPI
from radixlm.runtime.scheduler.control import Control, Reply
from radixlm.runtime.scheduler.scheduler import Scheduler
from radixlm.runtime.tokenizer.choices import ChoiceScoring, answer, is_choices, record_score, scoring_requests
from radixlm.runtime.tokenizer.loader import chat_prompt, load_tokenizer
from radixlm.runtime.tokenizer.output import RequestOutput
from radixlm.runtime.tokenizer.prepare import RequestPreparer
from radixlm.runtime.worker.lora import LoraError
from radixlm.runtime.worker.model_worker import ModelWorker


class LocalEngine(GenerateAPI):
    def __init__(self, model_path: str | None = None, *, tokenizer: Any = None, model: Any = None,
                 draft_model: Any = None, **kwargs: Any) -> None:
        """Options are ServerArgs fields. `tokenizer` / `model` / `draft_model`: already-loaded ones
        to reuse (tests and benchmarks build several engines over one copy of the weights)."""
        self.args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        self.source = resolve_model(self.args.model_path)
        if tokenizer is None and not self.args.skip_tokenizer_init:
            tokenizer = load_tokenizer(self.source, self.args.tokenizer_path)
        self.tokenizer = tokenizer
        self.worker = ModelWorker(self.args, self.source, model=model, draft_model=draft_model)
        grammar = None
        if tokenizer is not None:
            cfg = self.worker.config
            grammar = compiler_factory(tokenizer, cfg.vocab_size, cfg.eos_token_ids, self.args.constraint_timeout,
                                       self.args.grammar_backend)
        self.scheduler = Scheduler(self.args, self.worker, decode=self._decode_plain if tokenizer else None,
                                   grammar=grammar)
        self.control = Control(self.scheduler, self.args.served_name(self.source))
        self.prep = RequestPreparer(tokenizer, self.worker.config.vocab_size, self.worker.context_length,
                                    self.worker.num_pages * self.worker.page_size, self.args.reasoning_parser)

    def _decode_plain(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> str:
        return chat_prompt(self.tokenizer, messages, tools, template_kwargs)

    def _run_requests(self, reqs: list[GenerateRequest]) -> list[dict[str, Any]]:
        # every request is prepared (and so checked) before any is submitted
        plans = [scoring_requests(self.prep, r) if is_choices(r) else self.prep.prepare(r) for r in reqs]
        rids = [r.rid for r in reqs]  # the scheduler trusts what it is given: no id twice (manager.py checks in flight)
        if len(set(rids)) < len(rids):
            raise BadRequest(f"request id {next(r for r in rids if rids.count(r) > 1)!r} is already in flight")
        trs = [tr for p in plans for tr in (p.requests if isinstance(p, ChoiceScoring) else [p])]
        collected = self._collect(trs)
        results = []
        for req, plan in zip(reqs, plans):
            if isinstance(plan, ChoiceScoring):
                results.append(self._choice_result(plan, collected))
            else:
                results.append(self._gathered(plan, collected[plan.rid], req.return_text_in_logprobs,
                                              req.return_prompt_token_ids).result())
        return results

    def run(self, requests: list[TokenizedRequest], text_in_logprobs: list[bool] | None = None) -> list[dict[str, Any]]:
        """Submit tokenized requests, step the scheduler until they finish, and return their results
        in order (`text_in_logprobs[i]`: request i's logprob entries carry their token's text)."""
        collected = self._collect(requests)
        texts = text_in_logprobs or [False] * len(requests)
        return [self._result(tr, collected[tr.rid], t) for tr, t in zip(requests, texts)]

    def _collect(self, requests: list[TokenizedRequest]) -> dict[str, list[TokenOutput]]:
        """Run `requests` to the end: each one's outputs. If the scheduler refuses one, those already
        submitted are aborted (no KV stays held) and its error raised."""
        for i, tr in enumerate(requests):
            try:
                self.scheduler.add_request(tr)
            except Exception:
                for earlier in requests[:i]:
                    self.scheduler.abort(earlier.rid)
                raise
        collected: dict[str, list[TokenOutput]] = {tr.rid: [] for tr in requests}
        pending = set(collected)
        while pending:
            for out in self.scheduler.step():
                if out.rid in collected:
                    collected[out.rid].append(out)
                    if out.finished:
                        pending.discard(out.rid)
            self.scheduler.wait_for_constraints(timeout=1.0)  # returns at once unless only compiles are left
        return collected

    def _gathered(self, tr: TokenizedRequest, outs: list[TokenOutput], with_text: bool = False,
                  with_prompt: bool = False) -> RequestOutput:
        gathered = RequestOutput(tr, self.tokenizer, with_text, with_prompt)
        for out in outs:
            gathered.add(out)
        return gathered

    def _result(self, tr: TokenizedRequest, outs: list[TokenOutput], with_text: bool = False) -> dict[str, Any]:
        return self._gathered(tr, outs, with_text).result()

    def _choice_result(self, scoring: ChoiceScoring, collected: dict[str, list[TokenOutput]]) -> dict[str, Any]:
        """The served runtime's answer to a `choices` request (a failed scoring request fails it: its
        finish reason, with the status, is the result's)."""
        group = scoring.group
        for slot, tr in enumerate(scoring.requests):
            gathered = self._gathered(tr, collected[tr.rid])
            if (gathered.finish_reason or {}).get("status"):
                return {"text": "", "output_ids": [], "meta_info": dict(gathered.meta(), id=group.rid)}
            record_score(group, slot, gathered)
        text, meta = answer(group)
        return {"text": text, "output_ids": [], "meta_info": meta}

    def check_accounting(self) -> None:
        self.scheduler.check_accounting()

    def flush_cache(self) -> bool:
        return self.control.flush_cache()["success"]

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Serve another PEFT adapter (LoraError names what cannot be served, or the name taken)."""
        _adapter_changed(self.control.load_lora(lora_name, lora_path))

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Stop serving an adapter (LoraError if none of that name is served, or requests run on it)."""
        _adapter_changed(self.control.unload_lora(lora_name))

    def update_weights_from_disk(self, model_path: str) -> tuple[bool, str]:
        """As Engine's (between calls nothing runs here, so the update is made at once)."""
        reply = self.control.begin_update(model_path) or self.control.finish_update()
        return reply["success"], reply["message"]

    def shutdown(self) -> None:
        """Stop the constraint compiler's processes (if constraints were used)."""
        self.scheduler.shutdown()


def _adapter_changed(reply: Reply) -> None:
    """An adapter op's refusal raised, as the in-process API reports it."""
    if not reply["success"]:
        raise LoraError(reply["message"])
