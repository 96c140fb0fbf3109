"""Output assembly: one request's `TokenOutput`s, as they come, gathered into its result.

Shared by both front doors. `RequestOutput.add` splices in what jump-forward re-encoded (an
output's `replaced` ids are taken back before its new ones), gathers the output logprobs and
the prompt's (they come once, after the prefill), and keeps the latest counts and finish reason;
`meta` and `logprob_meta` are SGLang's meta_info, logprob entries as [logprob, id, text or None].

The text: the tokenizer process streams it from an `IncrementalDetokenizer` (with the prompt's
last ids as context); `text` here decodes the whole output at once, through the same
detokenizer, so stop strings are cut (or kept, `no_stop_trim`) by the same code. A stop_regex's
match stays in the text, as in SGLang. The two texts may differ in a leading space where the
tokenizer strips one from a text's first token (SentencePiece): each path keeps its own.
"""

from __future__ import annotations

from typing import Any

from radixlm.runtime.messages import TokenizedRequest, TokenOutput
from radixlm.runtime.tokenizer.detokenizer import IncrementalDetokenizer


class RequestOutput:
    def __init__(self, tr: TokenizedRequest, tokenizer: Any = None, text_in_logprobs: bool = False,
                 with_prompt_ids: bool = False) -> None:
        """`text_in_logprobs`: logprob entries carry their token's text (needs `tokenizer`);
        `with_prompt_ids`: meta_info carries the prompt's ids (`prompt_token_ids`)."""
        self.rid = tr.rid
        self.prompt_ids = tr.input_ids
        self.with_prompt_ids = with_prompt_ids
        self.params = tr.sampling_params
        self.return_logprob = tr.return_logprob
        self.logprob_start_len = tr.logprob_start_len
        self.tokenizer = tokenizer
        self.text_in_logprobs = text_in_logprobs and tokenizer is not None
        self.token_ids: list[int] = []  # every output id so far
        self.logprobs: list[list[Any]] = []  # [logprob, id] per output id
        self.top_logprobs: list[Any] = []
        self.input_logprobs: list[list[Any]] | None = None  # [logprob, id] per prompt position from the start
        self.input_top_logprobs: list[Any] | None = None
        self.input_ranks: list[int | None] | None = None
        self.prompt_tokens = len(tr.input_ids)
        self.cached_tokens = 0
        self.speculation = (0, 0, 0)  # (verify passes, drafts, drafts kept) so far
        self.finish_reason: dict[str, Any] | None = None
        self.embedding: list[float] | None = None  # an embedding request's, at its end

    def add(self, out: TokenOutput) -> None:
        if out.replaced:
            del self.token_ids[len(self.token_ids) - out.replaced:]
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend([lp, t] for lp, t in zip(out.output_logprobs, out.new_token_ids))
        self.top_logprobs.extend(out.output_top_logprobs)
        if out.input_logprobs is not None:
            start = max(self.logprob_start_len, 0)
            self.input_logprobs = [[lp, t] for lp, t in zip(out.input_logprobs, self.prompt_ids[start:])]
            self.input_top_logprobs = out.input_top_logprobs
            self.input_ranks = out.input_ranks
        self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
        self.speculation = (out.spec_verify_ct, out.spec_proposed_tokens, out.spec_accepted_tokens)
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
        if out.embedding is not None:
            self.embedding = out.embedding

    def meta(self, reason: dict[str, Any] | None = None, first: bool = True) -> dict[str, Any]:
        """meta_info's counts and finish reason (`reason`: instead of the scheduler's), and the
        prompt's ids when asked for (in a stream, on its `first` output only)."""
        meta = {"id": self.rid, "prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.token_ids),
                "cached_tokens": self.cached_tokens, "finish_reason": reason or self.finish_reason}
        if self.with_prompt_ids and first:
            meta["prompt_token_ids"] = list(self.prompt_ids)
        if self.embedding is not None:
            meta["embedding"] = self.embedding
        verify_ct, proposed, accepted = self.speculation
        if verify_ct:  # speculative decoding ran on it: verify passes, drafts checked, drafts kept
            meta.update(spec_verify_ct=verify_ct, spec_proposed_tokens=proposed, spec_accepted_tokens=accepted)
        return meta

    def logprob_meta(self, since: int = 0) -> dict[str, Any]:
        """meta_info's logprob lists, the output's from output token `since` on (a stream's chunk);
        none unless the request asked for them."""
        if not self.return_logprob:
            return {}
        return {
            "output_token_logprobs": self._entries(self.logprobs[since:]),
            "output_top_logprobs": [self._entries(top) for top in self.top_logprobs[since:]],
            # SGLang always has the prompt's lists: empty when none were asked for (logprob_start_len -1)
            "input_token_logprobs": self._entries(self.input_logprobs or []),
            "input_top_logprobs": [self._entries(top) for top in self.input_top_logprobs or []],
            # (ours, beside SGLang's: each prompt token's rank where it stands, for vLLM's prompt_logprobs)
            "input_token_ranks": list(self.input_ranks or []),
        }

    def _entries(self, entries: list | None) -> list | None:
        """SGLang's logprob entries: [logprob, id, text], the text None unless the request asked for it."""
        if entries is None:
            return None
        if not self.text_in_logprobs:
            return [[e[0], e[1], None] for e in entries]
        return [[e[0], e[1], self.tokenizer.decode([e[1]])] for e in entries]

    def text(self) -> str:
        """The whole output's text, cut at the first stop string ("" without a tokenizer)."""
        if self.tokenizer is None:
            return ""
        p = self.params
        detok = IncrementalDetokenizer(self.tokenizer, None, p.skip_special_tokens, p.spaces_between_special_tokens,
                                       p.stop, keep_stop=p.no_stop_trim)
        return detok.add(self.token_ids, flush=True)

    def result(self) -> dict[str, Any]:
        """The finished request in native_result's shape (the prompt's ids, when asked for, beside the output's)."""
        meta = self.meta() | self.logprob_meta()
        result = {"text": self.text(), "output_ids": list(self.token_ids), "meta_info": meta}
        if self.with_prompt_ids:
            result["prompt_token_ids"] = meta.pop("prompt_token_ids")
        return result
