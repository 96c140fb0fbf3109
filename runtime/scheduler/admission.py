"""Admission: which prefill rows join a step, and how many tokens each brings.

A step has a token budget (`--chunked-prefill-size`). The running requests' tokens go in
first, one each (more after a jump-forward); what is left goes to prefill: the request being
chunked, then waiting requests in policy order, each admitted only when its whole remaining
prompt and the decode room reserved for it fit in the pages no one else has claimed. The last
one admitted may get only a chunk of its prompt; it continues in the next steps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from radixlm.runtime.args import ServerArgs
from radixlm.runtime.scheduler.kv_manager import KVManager, pages_for
from radixlm.runtime.scheduler.policy import order_waiting, reserved_decode_tokens
from radixlm.runtime.scheduler.req import Req

log = logging.getLogger(__name__)

# A waiting request that shares this many uncached tokens with one admitted in the same
# step waits a step instead, so that it reuses that request's prefill.
IN_BATCH_SHARE_MIN = 32


@dataclass
class Budget:
    """What one step's prefill may still take."""

    tokens: int  # prefill tokens left this step
    chunk: int | None  # the most any one prompt may bring (None: no chunking, whole prompts)
    pages: int  # free + evictable pages minus what running requests have reserved
    decode_pages: int = 0  # new pages the running requests take this step

    def take(self, tokens: int, pages: int) -> None:
        self.tokens -= tokens
        if self.chunk is not None:
            self.chunk -= tokens
        self.pages -= pages


@dataclass
class Admitted:
    """The prefill rows of one step."""

    reqs: list[Req] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)
    chunked: Req | None = None  # the row that brought only part of its prompt
    oversized: list[Req] = field(default_factory=list)  # could never fit, even alone: they end here
    faulted: list[tuple[Req, Exception]] = field(default_factory=list)  # our code raised on them: they alone fail


def step_budget(args: ServerArgs, kv: KVManager, running: list[Req], chunked: Req | None, ratio: float) -> Budget:
    """The prefill share of a step: the token budget (on the pool's device) less the running
    requests' tokens, and the pages no one has claimed (`reserved_pages`)."""
    decode_pages = step_pages(kv, running)
    pages = kv.available_pages - reserved_pages(kv, running, chunked, ratio) - decode_pages
    chunk = args.chunk_size(kv.device.type)
    if chunk is None:  # chunking off: whole prompts, up to max_prefill_tokens beside the decodes
        return Budget(tokens=args.max_prefill_tokens, chunk=None, pages=pages, decode_pages=decode_pages)
    left = max(min(chunk, args.max_prefill_tokens) - sum(r.extend_len for r in running), 0)
    return Budget(tokens=left, chunk=left, pages=pages, decode_pages=decode_pages)


def reserved_pages(kv: KVManager, running: list[Req], chunked: Req | None, ratio: float) -> int:
    """Pages claimed by requests already in, past this step's: their decode growth (scaled by
    `ratio`) and the chunked prompt's rest."""
    reqs = running + ([chunked] if chunked else [])
    tokens = sum(reserved_decode_tokens(r, ratio) for r in reqs)
    if chunked is not None:
        tokens += chunked.extend_len
    page_slack = len(reqs) if kv.page_size > 1 else 0  # each may need a page of its own this step
    return pages_for(tokens, kv.page_size) + page_slack


def step_pages(kv: KVManager, running: list[Req]) -> int:
    """New pages the running requests need for this step's tokens."""
    return sum(kv.pages_to_extend(r, r.extend_len) for r in running)


def admit(args: ServerArgs, kv: KVManager, waiting: list[Req], running: list[Req], chunked: Req | None,
          ratio: float, budget: Budget) -> Admitted:
    """The prefill rows that fit in `budget`, first the chunked request's next chunk. Admitted
    requests are taken out of `waiting`, and so are the oversized ones."""
    out = Admitted()
    if chunked is not None:
        n = _chunk_len(chunked, budget, first=True)
        # its pages were reserved when it was admitted, but running requests may have outgrown
        # their reservations since: then it waits (retraction steps it back if they keep growing)
        if n == 0 or kv.pages_to_extend(chunked, n) > kv.available_pages - budget.decode_pages:
            out.chunked = chunked  # no room this step: it waits, its pages held
            return out
        budget.take(n, 0)
        if n < chunked.extend_len:
            out.chunked = chunked
        out.reqs.append(chunked)
        out.lens.append(n)
    if out.chunked is not None or budget.tokens <= 0:
        return out
    share_in_batch = args.schedule_policy in ("lpm", "dfs-weight") and not args.disable_radix_cache
    matches: dict[int, tuple[int, object]] = {}  # one prefix match per request per step

    def match(req: Req) -> tuple[int, object]:
        if id(req) not in matches:
            try:
                matches[id(req)] = kv.match_len(req)
            except Exception as e:  # noqa: BLE001 - this request's fault: it alone fails
                out.faulted.append((req, e))
                matches[id(req)] = (0, None)
        return matches[id(req)]

    def faulted(req: Req) -> bool:
        return any(r is req for r, _ in out.faulted)

    room = args.max_running_requests - len(running) - len(out.reqs)
    # LoRA adapters in the step: at most --max-loras-per-batch distinct ones
    adapters = {r.lora for r in [*running, *out.reqs] if r.lora is not None}
    for req in order_waiting(args.schedule_policy, waiting, match) if room > 0 else []:
        if len(running) + len(out.reqs) >= args.max_running_requests or out.chunked is not None:
            break
        if share_in_batch and out.reqs and _shares_uncached_prefix(req, match(req)[0], out.reqs):
            continue  # next step its prefix will be cached by the request it shares with
        if faulted(req):
            waiting.remove(req)
            continue
        if req.lora is not None and req.lora not in adapters and len(adapters) >= args.max_loras_per_batch:
            continue  # its adapter would be one too many in this step
        first = not out.reqs
        alone = first and not running  # nothing to wait for: admit if the prompt itself fits
        try:
            n, fits = _try_admit(kv, req, budget, first, alone, ratio)
        except Exception as e:  # noqa: BLE001 - our code raised admitting this request: it alone fails
            _back_out(kv, req)
            waiting.remove(req)
            out.faulted.append((req, e))
            continue
        if n == 0:
            if alone and not fits:
                waiting.remove(req)
                out.oversized.append(req)
            break
        waiting.remove(req)
        out.reqs.append(req)
        out.lens.append(n)
        if req.lora is not None:
            adapters.add(req.lora)
        if n < req.extend_len:
            out.chunked = req
    return out


def _try_admit(kv: KVManager, req: Req, budget: Budget, first: bool, alone: bool, ratio: float) -> tuple[int, bool]:
    """Admit `req` if its whole remaining prefill and reserved decode fit; returns its extend
    length now (0: not admitted) and whether its pages would fit at all."""
    evictable_before = kv.cache.evictable_pages
    kv.admit(req)
    page = kv.page_size
    need = pages_for(req.seq_len, page) - req.prefix_len // page
    if not alone:
        need += pages_for(reserved_decode_tokens(req, ratio), page)
    # locking the matched prefix took its pages out of the evictable ones the budget counted
    need += evictable_before - kv.cache.evictable_pages
    n = _chunk_len(req, budget, first)
    if need > budget.pages or n == 0:
        kv.undo_admit(req)
        return 0, need <= budget.pages
    if kv.load_from_tier(req):  # read back in pages `need` counted: less to prefill
        n = _chunk_len(req, budget, first)
    budget.take(n, need)
    return n, True


def _back_out(kv: KVManager, req: Req) -> None:
    """Undo whatever admitting `req` did before it raised: pages read in past its prefix, its row."""
    if req.row is None:
        return
    if req.cached_len > req.prefix_len:
        kv.truncate(req, req.prefix_len)
    kv.undo_admit(req)


def _chunk_len(req: Req, budget: Budget, first: bool) -> int:
    n = req.extend_len
    if budget.chunk is not None:
        n = min(n, budget.chunk)
    if n > budget.tokens and not first:
        return 0  # whole prompts only, unless it is the first of the batch
    return max(n, 0)


def _shares_uncached_prefix(req: Req, cached: int, batch: list[Req]) -> bool:
    """Whether `req` shares at least IN_BATCH_SHARE_MIN tokens past its `cached` prefix with
    a request already in this batch: prefilled together, neither would reuse the other."""
    end = cached + IN_BATCH_SHARE_MIN
    if end > req.seq_len - 1:
        return False
    head = req.tokens(0, end)
    return any(other.seq_len >= end and other.tokens(0, end) == head for other in batch)
