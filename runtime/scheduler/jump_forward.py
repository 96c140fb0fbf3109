"""Jump-forward: text a request's constraint forces is appended at once, not decoded token by token.

After a request's sampled token, the constraint may allow only one continuation (a JSON key, a
closing bracket). That text is re-encoded together with the last output tokens, as the
tokenizer would have split it, and replaces them; the KV of the tokens that changed is dropped
(`KVManager.truncate`), so the next step computes the new tokens in one extend row. When
nothing else may follow, EOS is appended and the request ends without another step.
"""

from __future__ import annotations

import logging

from radixlm.runtime.constrained.jump_forward import RETOKENIZE_TOKENS, Forced, JumpForward
from radixlm.runtime.scheduler.kv_manager import KVManager, pages_for
from radixlm.runtime.scheduler.req import Req

log = logging.getLogger(__name__)


class JumpForwarder:
    def __init__(self, jf: JumpForward, kv: KVManager, eos_ids: list[int], context_length: int) -> None:
        self.jf = jf
        self.kv = kv
        self.eos_ids = eos_ids
        self.context_length = context_length
        self.jumped_tokens = 0  # tokens appended without being decoded

    def may_jump(self, req: Req) -> bool:
        # NOTE: forced tokens are not sampled, so they would have no logprobs: such requests decode them
        return req.guide is not None and not req.return_logprob and req.output_ids[-1] not in self.eos_ids

    def apply(self, req: Req, spare_pages: int) -> int | None:
        """Append the text the constraint forces next (within `spare_pages` new pages); end with
        EOS when nothing else may follow. Returns the index of the first output token that
        changed, or None when none did."""
        jf = self.jf
        forced = req.guide.forced()
        changed = self._jump(req, forced, spare_pages) if forced.text else None
        if changed is not None:
            forced = req.guide.forced()
        p = req.params
        if (forced.ends and not forced.text and not p.ignore_eos and len(req.output_ids) < p.max_new_tokens
                and len(req.output_ids) + 1 >= p.min_new_tokens):
            req.output_ids.append(jf.eos_token_id)  # finishes the request: it needs no KV
            return len(req.output_ids) - 1 if changed is None else changed
        return changed

    def _jump(self, req: Req, forced: Forced, spare_pages: int) -> int | None:
        """Re-encode the last output tokens with the forced text; returns the first changed index."""
        jf, out = self.jf, req.output_ids
        # tokens in the shared prefix cache cannot be re-encoded; the matcher rolls back at most
        # RETOKENIZE_TOKENS, and never over an EOS (sampled under ignore_eos: the matcher never takes it)
        movable = len(out) - max(req.prefix_len - req.prompt_len, 0)
        window = min(RETOKENIZE_TOKENS, movable, req.guide.max_rollback, self._since_eos(out))
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
        page = self.kv.page_size
        need = pages_for(req.prompt_len + start + len(tokens), page) - pages_for(keep_kv, page)
        if need > spare_pages:
            return None  # leave the pages to decoding
        req.guide.rollback(len(out) - start)
        if not req.guide.accepts(tokens):  # cannot happen for a tokenization of allowed text
            for t in out[start:]:
                req.guide.advance(t)
            log.warning("jump-forward: the matcher refused the re-encoded text of %s; decoding it instead", req.rid)
            return None
        for t in tokens:
            req.guide.advance(t)
        if keep_kv < req.cached_len:
            self.kv.truncate(req, keep_kv)
        self.jumped_tokens += len(tokens) - (len(out) - start)
        if req.sent_len > start:
            req.replaced += req.sent_len - start
            req.sent_len = start
        out[start:] = tokens
        req.outputs_rewritten()
        return start

    def _since_eos(self, out: list[int]) -> int:
        """How many of the last RETOKENIZE_TOKENS outputs follow the last EOS among them."""
        tail = out[-RETOKENIZE_TOKENS:]
        for back, token in enumerate(reversed(tail)):
            if token in self.eos_ids:
                return back
        return len(tail)
