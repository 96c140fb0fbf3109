"""Speculative decoding: tokens proposed for free, checked in the step that produces one anyway.

At small batch a decode step is bound by reading the weights, so a running request may feed
its next token plus k proposed ones (a verify row: an extend of k+1 tokens beside the other
rows) for little more than the cost of one. Every one of the k+1 positions is sampled as if it
were the request's next step (its own constraint state, output length, seed and min-tokens
block), and the proposals are kept up to the first that differs from what was sampled there,
plus that sampled token. The output is the one decoding would give: for greedy rows token for
token; for sampled rows too, since a position's draw depends only on its logits and its noise,
so the kept tokens are draws from the model's distribution (a proposal is kept with exactly
its probability, the residual is the distribution without it: rejection sampling of a point
proposal). The KV of rejected proposals is freed at once.

Proposals cost no model: the continuation of the request's last n tokens in its own prompt and
output (`ngram`), or in everything the radix tree holds, other requests' prompts and outputs
included (`radix`); `auto` takes the longer match of the two. Or they come from a smaller model
(`draft`, worker/draft_model.py), made by the worker in the step that checks them: the scheduler
gives the row k placeholders (`DRAFT_PENDING`) and learns the tokens from the step's output.

Whether a step speculates (`auto`) is decided per step from what it would cost and gain: each
request's recent acceptance rate sets how many proposals are worth checking, and measured step
times (`StepCosts`, by tokens per step) say what the longer step costs at this batch. When the
expected tokens per second do not rise, the step runs plain, so speculation switches itself
off under load. `ngram` and `radix` speculate on every step they can.
"""

from __future__ import annotations

import math
from radixlm.runtime.args import SPECULATIVE_METHODS
from radixlm.runtime.cache.continuations import NGRAM_SIZES, NgramIndex, TreeContinuations
from radixlm.runtime.scheduler.kv_manager import KVManager
from radixlm.runtime.scheduler.req import Req
from radixlm.runtime.worker.draft_model import DRAFT_PENDING

_WORTH = 0.25  # a proposal at depth j is checked while acceptance**j is at least this
_MARGIN = 1.05  # auto speculates when it expects at least this many times the tokens per second
_PROBE_EVERY = 16  # steps between one-token probes of a request whose proposals stopped paying
_REMEASURE = 32  # auto runs one step of a size plain in this many, to keep its cost current (contexts grow)


class Acceptance:
    """A decaying estimate of the chance that a request's next proposal is kept."""

    __slots__ = ("kept", "tried")

    def __init__(self, rate: float = 0.5, weight: float = 2.0) -> None:
        self.kept, self.tried = rate * weight, weight

    @property
    def rate(self) -> float:
        return self.kept / self.tried

    def record(self, proposed: int, accepted: int, decay: float = 0.7) -> None:
        """One verify: `accepted` of `proposed` kept (the first rejection is the one failed trial)."""
        self.kept = self.kept * decay + accepted
        self.tried = self.tried * decay + accepted + (accepted < proposed)

    def depth(self, limit: int) -> int:
        """How many proposals are worth checking: while rate**j >= _WORTH, at most `limit`."""
        rate = self.rate
        if rate >= 1.0:
            return limit
        if rate <= _WORTH:
            return 0
        return min(limit, int(math.log(_WORTH) / math.log(rate)))

    def expected(self, k: int) -> float:
        """Proposals expected to be kept of k checked: rate + rate**2 + ... + rate**k."""
        r = self.rate
        return k if r >= 1.0 else r * (1 - r**k) / (1 - r)


def _bucket(tokens: int) -> int:
    """Step sizes measured together: exact up to 16 tokens, then quarter octaves."""
    if tokens <= 16:
        return tokens
    return int(round(2 ** (round(math.log2(tokens) * 4) / 4)))


class StepCosts:
    """Measured seconds per step, by kind (decode rows only, or with extend rows) and tokens: per
    size bucket the decaying means of its steps' tokens and seconds, a piecewise-linear curve."""

    def __init__(self, decay: float = 0.8) -> None:
        self.decay = decay
        self._points: dict[tuple[bool, int], tuple[float, float]] = {}  # (kind, bucket) -> (tokens, seconds)

    def observe(self, extend: bool, tokens: int, seconds: float) -> None:
        key = (extend, _bucket(tokens))
        old = self._points.get(key)
        d = self.decay
        self._points[key] = (tokens, seconds) if old is None else (old[0] * d + tokens * (1 - d),
                                                                   old[1] * d + seconds * (1 - d))

    def measured(self, extend: bool, tokens: int) -> bool:
        """Whether a step of this kind has been measured at about this size (its bucket)."""
        return (extend, _bucket(tokens)) in self._points

    def estimate(self, extend: bool, tokens: int) -> float | None:
        """Seconds for a step of `tokens`: interpolated between the measured points around it (an
        extend step costs at least a decode step of as many tokens); None when nothing is known."""
        points = sorted(p for (kind, _), p in self._points.items() if kind == extend)
        below = [p for p in points if p[0] <= tokens]
        above = [p for p in points if p[0] > tokens]
        if extend:  # a decode step of as many tokens or fewer bounds an extend step from below
            floor = [p for (kind, _), p in self._points.items() if not kind and p[0] <= tokens]
            if floor and (not below or max(floor)[0] > below[-1][0]):
                below = [max(floor)]
        if below and above:
            (n0, s0), (n1, s1) = below[-1], above[0]
            return s0 + (s1 - s0) * (tokens - n0) / (n1 - n0)
        if below:  # past the largest size measured: as if time grew with tokens (pessimistic)
            n0, s0 = below[-1]
            return s0 * tokens / n0
        if above:  # under the smallest: no more than it
            return above[0][1]
        return None


class Speculator:
    """Proposes each step's drafts (`plan`) and learns from the verifies and step times."""

    def __init__(self, method: str, max_draft: int, kv: KVManager, context_length: int,
                 eos_ids: list[int], max_batch: int = 1 << 30) -> None:
        """`max_batch`: auto speculates only while at most this many requests decode."""
        assert method in SPECULATIVE_METHODS and method != "off", method
        self.method = method
        self.max_draft = max_draft
        self.max_batch = max_batch
        self.kv = kv
        self.context_length = context_length
        self.eos_ids = set(eos_ids)
        self.tree: TreeContinuations | None = getattr(kv.cache, "continuations", None)
        self.costs = StepCosts()
        self._since_plain: dict[tuple[bool, int], int] = {}  # steps of each size since one ran plain
        self.prior = Acceptance()  # over all requests: where a new request's estimate starts
        # totals since start
        self.verify_rows = self.proposed = self.accepted = 0
        self.speculative_steps = 0
        self.faulted: list[tuple[Req, Exception]] = []  # requests `plan` raised on: the scheduler fails them

    # ---- one step ----------------------------------------------------------------------------

    def plan(self, running: list[Req], spare_pages: int, step_tokens: int, extend_step: bool) -> int:
        """Give each running request its drafts for this step (`req.draft`; empty for most) within
        `spare_pages` new KV pages; returns the proposals given. `step_tokens` and `extend_step`
        describe the step without them, for the cost comparison."""
        offers: list[tuple[float, Req, list[int]]] = []
        for req in running:
            req.draft = []
        if self.method == "auto" and len(running) > self.max_batch:
            return 0
        for req in running:
            try:
                draft = self._propose(req)
            except Exception as e:  # noqa: BLE001 - our code (or its constraint's) raised on it: it alone fails
                self.faulted.append((req, e))
                continue
            if draft:
                acc = req.spec_acceptance
                offers.append((acc.expected(len(draft)), req, draft))
        if not offers:
            return 0
        if self.method == "auto":
            offers = self._worth_it(offers, len(running), step_tokens, extend_step)
        given = 0
        for _, req, draft in offers:
            pages = self.kv.pages_to_extend(req, 1 + len(draft)) - self.kv.pages_to_extend(req, 1)
            if pages > spare_pages:
                continue
            spare_pages -= pages
            req.draft = draft
            given += len(draft)
        if given:
            self.speculative_steps += 1
        return given

    def _propose(self, req: Req) -> list[int]:
        """The request's drafts if it may speculate now: as many as its acceptance makes worth checking."""
        if req.extend_len != 1 or req.params.uses_penalties:  # penalties would need per-draft counts
            return []
        if self.method == "draft" and req.guide is not None:  # the draft model samples without masks
            return []
        room = min(req.params.max_new_tokens - len(req.output_ids), self.context_length - req.seq_len) - 1
        limit = min(self.max_draft, room)
        if req.guide is not None:
            limit = min(limit, req.guide.max_rollback)
        if limit <= 0:
            return []
        if req.spec_acceptance is None:
            req.spec_acceptance = Acceptance(self.prior.rate)
        if self.method == "draft":  # each draft costs a pass of the draft model: as deep as it pays
            k = max(1, req.spec_acceptance.depth(limit))
        else:
            k = limit if self.method != "auto" else req.spec_acceptance.depth(limit)
        if k == 0:  # not paying lately: a one-token probe now and then, to notice when it would again
            req.spec_idle += 1
            if req.spec_idle < _PROBE_EVERY:
                return []
            req.spec_idle, k = 0, 1
        draft = self._lookup(req, k)
        if draft and req.guide is not None:
            draft = self._allowed(req, draft)
        return draft

    def _lookup(self, req: Req, k: int) -> list[int]:
        if self.method == "draft":
            return [DRAFT_PENDING] * k  # the worker's draft model fills them in
        own = tree = (0, [])
        if self.method in ("ngram", "auto"):
            if req.spec_index is None:
                req.spec_index = NgramIndex()
            own = req.spec_index.propose(req.seq_len, req.tokens, k)
        if self.method in ("radix", "auto") and self.tree is not None:
            n = max(NGRAM_SIZES)
            tree = self.tree.propose(req.tokens(max(req.seq_len - n, 0), req.seq_len), k)
        return (own if own[0] >= tree[0] else tree)[1]

    def _allowed(self, req: Req, draft: list[int]) -> list[int]:
        """The longest head of `draft` the request's constraint admits (EOS ends a draft: the
        matcher never takes it)."""
        for i, t in enumerate(draft):
            if t in self.eos_ids:
                draft = draft[:i]
                break
        while draft and not req.guide.accepts(draft):
            draft = draft[:-1]
        return draft

    def _worth_it(self, offers: list[tuple[float, Req, list[int]]], batch: int, step_tokens: int,
                  extend_step: bool) -> list[tuple[float, Req, list[int]]]:
        """The drafts to check: of the best-first heads of `offers` (all, half, a quarter, ...), each
        with its drafts cut to at most 1, 2, 3, 4, 6 or all of them, the choice with the most expected
        tokens per second, if it beats a plain step by _MARGIN. (A longer step may cost more per
        token than a short one: past some rows a kernel changes, so the best depth is measured,
        not assumed.)"""
        key = (extend_step, _bucket(step_tokens))
        self._since_plain[key] = self._since_plain.get(key, 0) + 1
        if self._since_plain[key] > _REMEASURE or not self.costs.measured(extend_step, step_tokens):
            self._since_plain[key] = 0
            return []  # a plain step of this size, measured now and then: what speculation must beat
        plain = self.costs.estimate(extend_step, step_tokens)
        offers.sort(key=lambda o: -o[0] / len(o[2]))
        best, best_gain = [], _MARGIN
        longest = max(len(o[2]) for o in offers)
        for cap in sorted({c for c in (1, 2, 3, 4, 6) if c < longest} | {longest}):
            cut = [(o[1].spec_acceptance.expected(min(cap, len(o[2]))), o[1], o[2][:cap]) for o in offers]
            n = len(cut)
            while n:
                head = cut[:n]
                cost = self.costs.estimate(True, step_tokens + sum(len(o[2]) for o in head))
                if cost is None:
                    break
                gain = (batch + sum(o[0] for o in head)) / cost * plain / batch
                if gain > best_gain:
                    best, best_gain = head, gain
                n //= 2
        return best

    def observe_step(self, extend: bool, tokens: int, seconds: float) -> None:
        self.costs.observe(extend, tokens, seconds)

    def verified(self, req: Req, proposed: int, accepted: int) -> None:
        """A verify row's result: `accepted` of its `proposed` drafts were kept."""
        req.spec_acceptance.record(proposed, accepted)
        self.prior.record(proposed, accepted, decay=0.98)
        req.spec_verify_ct += 1
        req.spec_proposed += proposed
        req.spec_accepted += accepted
        self.verify_rows += 1
        self.proposed += proposed
        self.accepted += accepted

    def stats(self) -> dict:
        return {"method": self.method, "verify_rows": self.verify_rows, "proposed_tokens": self.proposed,
                "accepted_tokens": self.accepted, "speculative_steps": self.speculative_steps,
                "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0}


def kept_prefix(draft: list[int], sampled: list[int]) -> int:
    """How many drafts the verify keeps: those up to the first that differs from the token
    sampled at its position (sampled[j] is what position j's logits gave)."""
    n = 0
    while n < len(draft) and sampled[n] == draft[n]:
        n += 1
    return n
