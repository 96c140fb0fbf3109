"""Request preparation: a client's `GenerateRequest` becomes the `TokenizedRequest` the scheduler runs.

One copy, shared by both front doors (the tokenizer process, `manager.py`, and the in-process
`LocalEngine`), so that both refuse the same requests with the same messages: the prompt (text,
chat messages or token ids) is tokenized and checked (`check_fits`: the vocabulary, the context and
the KV pool's size), the sampling parameters parsed with their defaults (`max_new_tokens: None` is "as
many as fit") and checked against the vocabulary and the room the prompt leaves, the logprob
options checked against the prompt, and the request's constraint key and reasoning gate worked out
once. Refusals raise `BadRequest` (or `SamplingParamsError`), both ValueErrors whose message names
what was wrong. This is the one place a request is checked: the scheduler asserts what a prepared
request satisfies and trusts it (`Scheduler.add_request`), all but what only it knows (whether the
LoRA adapter a request names is served when the request arrives).
"""

from __future__ import annotations

from typing import Any

from radixlm.runtime.constrained.backend import constraint_key
from radixlm.runtime.messages import GenerateRequest, TokenizedRequest
from radixlm.runtime.native import BadRequest
from radixlm.runtime.reasoning import end_tag_ids, gate_ids
from radixlm.runtime.sampling_params import SamplingParams

MAX_TOP_LOGPROBS = 20


# an embedding's pooling: the last prompt token's final hidden state, or the mean of every one's
POOLINGS = ("last", "mean")

class RequestPreparer:
    """The served model's facts that requests are checked against, and `prepare`."""

    def __init__(self, tokenizer: Any, vocab_size: int, context_length: int, kv_pool_tokens: int,
                 reasoning_parser: str | None = None) -> None:
        """`tokenizer`: None without one (--skip-tokenizer-init: only input_ids are taken);
        `context_length`: the served one (the model's, capped by --context-length); `kv_pool_tokens`:
        the KV cache pool's size (the scheduler's `SchedulerLimits`)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.kv_pool_tokens = kv_pool_tokens
        self.reasoning_end_ids = end_tag_ids(reasoning_parser, tokenizer)

    def prepare(self, req: GenerateRequest) -> TokenizedRequest:
        """The request, tokenized and checked (not a `choices` request: see tokenizer/choices.py)."""
        prompt_ids = self.prompt_ids(req)
        if req.embed not in (None, *POOLINGS):
            raise BadRequest(f"pooling must be one of {', '.join(POOLINGS)}, not {req.embed!r}")
        params = self.sampling_params(req, len(prompt_ids))
        constraint = constraint_key(params)
        if constraint is not None and self.tokenizer is None:
            raise BadRequest("constrained decoding (regex, json_schema, ebnf) needs a tokenizer")
        try:
            gate = gate_ids(req.require_reasoning, self.reasoning_end_ids, constraint is not None)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        return TokenizedRequest(req.rid, prompt_ids, params, req.return_logprob, req.logprob_start_len,
                                req.top_logprobs_num, gate, constraint, req.embed, req.lora_path, req.model)

    def prompt_ids(self, req: GenerateRequest) -> list[int]:
        """The prompt's token ids (text and messages tokenized), checked."""
        given = [x is not None for x in (req.text, req.input_ids, req.messages)]
        if sum(given) != 1:
            raise BadRequest("give exactly one of text, input_ids or messages")
        if req.input_ids is not None:
            ids = req.input_ids
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise BadRequest("input_ids must be a list of integers")
        else:
            if self.tokenizer is None:
                raise BadRequest("this server has no tokenizer (--skip-tokenizer-init): send input_ids")
            ids = self.encode(req.text) if req.text is not None else self.tokenizer.encode(
                self.chat_prompt(req), add_special_tokens=False)  # (a chat template writes its own BOS)
        ids = self.truncated(list(ids), req.truncate_prompt_tokens)
        self.check_fits(ids)
        return ids

    def truncated(self, ids: list[int], keep: int | None) -> list[int]:
        """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` ids (-1: as many as leave the
        context room for one new token)."""
        if keep is None:
            return ids
        if not isinstance(keep, int) or isinstance(keep, bool) or keep == 0 or keep < -1:
            raise BadRequest(f"truncate_prompt_tokens must be -1 or a positive integer, not {keep!r}")
        return ids[-(self.context_length - 1 if keep == -1 else keep):]

    def encode(self, text: str) -> list[int]:
        """A text prompt's ids, with the special tokens its tokenizer adds by default (Llama 3's BOS
        before it, Qwen3-Embedding's <|endoftext|> after it), as HF, vLLM and SGLang encode one;
        /tokenize's `add_special_tokens` defaults to the same."""
        return self.tokenizer.encode(text)

    def check_fits(self, ids: list[int]) -> None:
        """A prompt's ids: not empty, in the vocabulary, room in the context for one new token, and
        no more than the KV pool holds."""
        if not ids:
            raise BadRequest("the prompt is empty")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise BadRequest(f"input_ids must lie in [0, {self.vocab_size})")
        if len(ids) >= self.context_length:
            raise BadRequest(f"the prompt has {len(ids)} tokens; the context length is {self.context_length} "
                             "(prompt plus at least one new token must fit)")
        if len(ids) > self.kv_pool_tokens:
            raise BadRequest(f"the prompt has {len(ids)} tokens; the KV cache pool holds {self.kv_pool_tokens} "
                             "(raise --max-total-tokens)")

    def chat_prompt(self, req: GenerateRequest, add_generation_prompt: bool = True) -> str:
        from radixlm.runtime.tokenizer.loader import chat_prompt

        try:
            return chat_prompt(self.tokenizer, req.messages, req.tools, req.chat_template_kwargs, add_generation_prompt)
        except ValueError as e:
            raise BadRequest(str(e)) from None

    def sampling_params(self, req: GenerateRequest, prompt_len: int) -> SamplingParams:
        """The request's sampling parameters with their defaults, and its logprob options, checked."""
        raw = dict(req.sampling_params or {})
        if raw.get("max_new_tokens", 0) is None:  # "as many as fit"
            raw["max_new_tokens"] = self.context_length - prompt_len
        params = SamplingParams.from_dict(raw)
        # as in SGLang, stop token ids past the vocabulary are accepted: they can never be sampled
        params.stop_token_ids = [t for t in params.stop_token_ids if t < self.vocab_size]
        params.validate(self.vocab_size)
        room = self.context_length - prompt_len
        if params.max_new_tokens > room:
            raise BadRequest(f"max_new_tokens={params.max_new_tokens} does not fit: the prompt has {prompt_len} "
                             f"tokens and the context length is {self.context_length}, so at most {room}")
        if req.logprob_start_len >= prompt_len:
            raise BadRequest(f"logprob_start_len {req.logprob_start_len} must be below the prompt length {prompt_len}")
        if req.top_logprobs_num < 0 or req.top_logprobs_num > MAX_TOP_LOGPROBS:
            raise BadRequest(f"top_logprobs_num must lie in [0, {MAX_TOP_LOGPROBS}]")
        return params
