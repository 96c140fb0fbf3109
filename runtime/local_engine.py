"""The in-process Python API: `LocalEngine(...).generate(...)`.

The engine tokenizes, feeds the scheduler, runs steps until its requests are
done, and detokenizes. (The served runtime puts each part in its own process;
the engine's API stays the same.)
"""

from __future__ import annotations

from typing import Any

from radixlm.runtime.args import ServerArgs
from radixlm.runtime.constrained.grammar import compiler_factory, constraint_key
from radixlm.runtime.messages import GenerateRequest, TokenizedRequest, TokenOutput
from radixlm.runtime.native import GenerateAPI
from radixlm.runtime.reasoning import end_tag_ids, gate_ids
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler.scheduler import Scheduler
from radixlm.runtime.tokenizer.loader import chat_prompt, load_tokenizer
from radixlm.runtime.worker.loader import resolve_model
from radixlm.runtime.worker.model_worker import ModelWorker


class LocalEngine(GenerateAPI):
    def __init__(self, model_path: str | None = None, *, tokenizer: Any = None, model: Any = None,
                 **kwargs: Any) -> None:
        """Options are ServerArgs fields. `tokenizer` / `model`: already-loaded ones to reuse
        (tests and benchmarks build several engines over one copy of the weights)."""
        self.args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        self.source = resolve_model(self.args.model_path)
        if tokenizer is None and not self.args.skip_tokenizer_init:
            tokenizer = load_tokenizer(self.source, self.args.tokenizer_path)
        self.tokenizer = tokenizer
        self.worker = ModelWorker(self.args, self.source, model=model)
        grammar = None
        if tokenizer is not None:
            cfg = self.worker.config
            grammar = compiler_factory(tokenizer, cfg.vocab_size, cfg.eos_token_ids, self.args.constraint_timeout,
                                       self.args.grammar_backend)
        self.scheduler = Scheduler(self.args, self.worker, decode=self._decode_plain if tokenizer else None,
                                   grammar=grammar)

    def _decode_plain(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> str:
        return chat_prompt(self.tokenizer, messages, tools, template_kwargs)

    def _run_requests(self, reqs: list[GenerateRequest]) -> list[dict[str, Any]]:
        return self.run([self._tokenized(r) for r in reqs], [r.return_text_in_logprobs for r in reqs])

    def _tokenized(self, req: GenerateRequest) -> TokenizedRequest:
        if req.input_ids is not None:
            ids = req.input_ids
        elif self.tokenizer is None:
            raise ValueError("this engine has no tokenizer (skip_tokenizer_init): give input_ids")
        else:
            text = req.text if req.text is not None else self.apply_chat_template(
                req.messages, req.tools, req.chat_template_kwargs)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        params = SamplingParams.from_dict(req.sampling_params)
        gate = gate_ids(req.require_reasoning, end_tag_ids(self.args.reasoning_parser, self.tokenizer),
                        constraint_key(params) is not None)
        return TokenizedRequest(req.rid, list(ids), params, req.return_logprob, req.logprob_start_len,
                                req.top_logprobs_num, gate)

    def run(self, requests: list[TokenizedRequest], text_in_logprobs: list[bool] | None = None) -> list[dict[str, Any]]:
        """Submit tokenized requests, step the scheduler until they finish, and return their results
        in order (`text_in_logprobs[i]`: request i's logprob entries carry their token's text)."""
        for tr in requests:
            self.scheduler.add_request(tr)
        collected: dict[str, list[TokenOutput]] = {tr.rid: [] for tr in requests}
        pending = set(collected)
        while pending:
            for out in self.scheduler.step():
                if out.rid in collected:
                    collected[out.rid].append(out)
                    if out.finished:
                        pending.discard(out.rid)
            self.scheduler.wait_for_constraints(timeout=1.0)  # returns at once unless only compiles are left
        texts = text_in_logprobs or [False] * len(requests)
        return [self._result(tr, collected[tr.rid], t) for tr, t in zip(requests, texts)]

    def _entries(self, pairs: Any, with_text: bool) -> list[list[Any]]:
        """SGLang's logprob entries: [logprob, id, text or None]."""
        return [[lp, t, self.tokenizer.decode([t]) if with_text and self.tokenizer else None] for lp, t in pairs]

    def _result(self, tr: TokenizedRequest, outs: list[TokenOutput], with_text: bool = False) -> dict[str, Any]:
        ids: list[int] = []
        for o in outs:
            del ids[len(ids) - o.replaced:]
            ids.extend(o.new_token_ids)
        last = outs[-1]
        params = tr.sampling_params
        text = self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens) if self.tokenizer else ""
        reason = last.finish_reason or {}
        matched = reason.get("matched")
        if reason.get("type") == "stop" and matched in params.stop and matched in text:  # not a stop_regex's pattern
            text = text[: text.find(matched) + (len(matched) if params.no_stop_trim else 0)]
        meta: dict[str, Any] = {
            "id": tr.rid,
            "prompt_tokens": last.prompt_tokens,
            "completion_tokens": last.completion_tokens,
            "cached_tokens": last.cached_tokens,
            "finish_reason": last.finish_reason,
        }
        if tr.return_logprob:
            logprobs = [lp for o in outs for lp in o.output_logprobs]
            meta["output_token_logprobs"] = self._entries(zip(logprobs, ids), with_text)
            meta["output_top_logprobs"] = [self._entries(t, with_text) for o in outs for t in o.output_top_logprobs]
            first = next((o for o in outs if o.input_logprobs is not None), None)
            start = max(tr.logprob_start_len, 0)
            meta["input_token_logprobs"] = [] if first is None else self._entries(
                zip(first.input_logprobs, tr.input_ids[start:]), with_text)
            meta["input_top_logprobs"] = [] if first is None else [
                None if t is None else self._entries(t, with_text) for t in first.input_top_logprobs]
        return {"text": text, "output_ids": ids, "meta_info": meta}

    def check_accounting(self) -> None:
        self.scheduler.check_accounting()

    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def shutdown(self) -> None:
        """Stop the constraint compiler's processes (if constraints were used)."""
        self.scheduler.shutdown()
