"""The scheduler's view of KV memory: pages, the prefix cache, and each request's row of slots."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from radixlm.runtime.cache.allocator import PageAllocator, WindowedPageAllocator
from radixlm.runtime.cache.continuations import TreeContinuations
from radixlm.runtime.cache.kv_pool import ReqToTokenTable
from radixlm.runtime.cache.kv_tier import KVTier
from radixlm.runtime.cache.radix_cache import MatchResult, NoPrefixCache, PrefixCache, RadixCache
from radixlm.runtime.scheduler.req import Req
from radixlm.runtime.utils import ragged_arange


log = logging.getLogger(__name__)

# The radix cache's keys of a LoRA adapter's requests begin at a multiple of this (past every
# token id): each adapter's namespace (`KVManager.lora_namespace`)
LORA_KEYS = 1 << 32


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


@dataclass
class StepSlots:
    """Where a step's tokens go, worked out on the host from lengths the scheduler knows, so that
    taking the slots reads nothing back from the device. Per row: `starts`; per token: its
    row in the batch, its index in the row, its position, and, for a token that opens or falls
    in a new page, that page's index among the step's new pages (-1: the row's last page has
    room) and its offset there."""

    starts: torch.Tensor  # [B]
    token_row: torch.Tensor  # [T]
    token_index: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    page_index: torch.Tensor  # [T]
    page_offset: torch.Tensor  # [T]
    num_new_pages: int

    @staticmethod
    def host_arrays(starts: np.ndarray, lens: np.ndarray, page_size: int) -> tuple[list[np.ndarray], int]:
        """The plan's fields as host arrays (to be staged with the step's other fields), and the
        number of new pages."""
        p = page_size
        ends = starts + lens
        room_end = np.minimum(-(-starts // p) * p, ends)  # the row's last page ends here (or the row does)
        room = room_end - starts
        new_pages = -(-(ends - room_end) // p)
        token_row = np.repeat(np.arange(len(lens)), lens)
        token_index = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
        past_room = token_index - room[token_row]  # >= 0: in the step's new pages
        first_page = np.cumsum(new_pages) - new_pages
        page_index = np.where(past_room >= 0, first_page[token_row] + past_room // p, -1)
        page_offset = np.where(past_room >= 0, past_room % p, 0)
        return [starts, token_row, token_index, starts[token_row] + token_index, page_index, page_offset], \
            int(new_pages.sum())


class KVManager:
    """Every page is exactly one of: free, in the prefix cache (evictable or locked),
    or owned by a request with a row. `check_accounting()` proves it.

    Sliding-window models (`table.window_table`): the sliding layers' K/V sit in a second slot
    space (allocator.WindowedPageAllocator), and a page's window page is given back once its
    tokens are out of every window still to read them (`drop_windows`), so that a long request
    holds about a window of it for those layers. A cached prefix is matched only as far as its
    last window is still bound (`_match`); prompts go into the tree once whole (`share_prefill`).
    """

    def __init__(self, num_pages: int, page_size: int, table: ReqToTokenTable, use_radix: bool,
                 device: torch.device, continuations: TreeContinuations | None = None,
                 tier: KVTier | None = None, window: int | None = None, rollback: int = 0) -> None:
        """`continuations`: the n-gram index the radix tree keeps of its tokens (speculative decoding).
        `tier`: the second tier (kv_tier.py): evicted prefixes are saved there, and admission
        reads a prompt's continuation past the tree's match back (`load_from_tier`).
        `window`: the sliding layers' (with `table.window_table`); `rollback`: the most tokens a
        running request's KV is ever cut back by (jump-forward, rejected drafts), which its window
        pages are kept for."""
        self.page_size = page_size
        self.num_pages = num_pages
        self.device = device
        self.table = table
        self.tier = tier
        self.window = window if table.window_table is not None else None
        if self.window is not None:
            assert tier is None, "a KV tier saves every layer's K/V of a page: not with window pages"
            self.allocator: PageAllocator = WindowedPageAllocator(num_pages, page_size, device)
            # positions are dropped a granule at a time: a request's drop costs one slice in 32 tokens
            self._granule = page_size * max(1, 32 // page_size)
            self._keep = self.window + rollback - 1  # the last positions dropping leaves bound
        else:
            self.allocator = PageAllocator(num_pages, page_size, device)
        self.cache: PrefixCache = (RadixCache(self.allocator, continuations, self._save_to_tier if tier else None)
                                   if use_radix else NoPrefixCache(self.allocator))
        self._offsets = torch.arange(page_size, device=device)
        self._namespaces: dict[str, int] = {}  # LoRA adapter -> where its keys begin (past every token id)
        self._admitted = [0, 0]  # tokens of the requests admitted since `take_admitted`, and the cached ones
        self._next_namespace = 0

    def lora_namespace(self, name: str) -> int:
        """The offset of an adapter's keys in the radix cache: a range of 2^32 of its own, so that a
        prefix computed under one adapter is never matched under another or the base model."""
        if name not in self._namespaces:
            self._namespaces[name] = self._next_namespace = self._next_namespace + LORA_KEYS
        return self._namespaces[name]

    def _save_to_tier(self, tokens: list[int], slots: torch.Tensor, start: int) -> None:
        """An evicted prefix to the tier, unless it was computed under an adapter: a namespace is
        this process's own numbering (the same keys may name another adapter after a restart),
        so adapters' KV stays in the pool alone."""
        if tokens[0] < LORA_KEYS:
            self.tier.save(tokens, slots, start)

    def retire_lora_namespace(self, name: str) -> None:
        """An adapter unloaded: an adapter loaded later under its name gets a namespace of its own
        (what the tree holds under the old one is never matched again, and is evicted in turn)."""
        self._namespaces.pop(name, None)

    def take_admitted(self) -> tuple[int, int]:
        """The tokens of the requests admitted since the last call, and how many of them were cached
        (the tree's match, the tier's blocks): the dashboard's hit rate over time."""
        taken, self._admitted = self._admitted, [0, 0]
        return taken[0], taken[1]

    @property
    def tier_pages(self) -> int:
        """Pages' worth of K/V the KV tier holds (0 without one)."""
        return 0 if self.tier is None else self.tier.store.num_blocks * self.tier.block_tokens // self.page_size

    # ---- capacity ----------------------------------------------------------------------------

    @property
    def available_pages(self) -> int:
        """Pages that could be handed out now, evicting unlocked cache entries if needed."""
        return self.allocator.num_free_pages + self.cache.evictable_pages

    def owned_pages(self, req: Req) -> int:
        return pages_for(req.cached_len, self.page_size) - req.prefix_len // self.page_size

    def pages_to_extend(self, req: Req, new_tokens: int) -> int:
        end = req.cached_len + new_tokens
        return pages_for(end, self.page_size) - pages_for(req.cached_len, self.page_size)

    # ---- admission and release ---------------------------------------------------------------

    def match_len(self, req: Req) -> tuple[int, object]:
        m = self._match(req)
        return len(m.slots), m.node

    def _match(self, req: Req) -> MatchResult:
        """The cached prefix a request can start from: the tree's longest match, cut back (for a
        sliding-window model) to the longest page-aligned prefix whose last window is still
        bound, which the request's first new token reads."""
        tokens = req.cache_key(0, self._match_limit(req))
        m = self.cache.match_prefix(tokens)
        if self.window is None or not len(m.slots):
            return m
        P = self.page_size
        unbound = (self.allocator.page_map[m.slots[::P] // P] < 0).to(torch.int64)
        missing = torch.cat([unbound.new_zeros(1), unbound.cumsum(0)])  # missing[k]: unbound among the first k pages
        ends = torch.arange(len(missing), device=missing.device)  # a prefix of k pages
        first = ((ends * P - self.window + 1).clamp(min=0) // P).clamp(max=ends)  # the first page its window reads
        usable = torch.nonzero(missing[ends] == missing[first]).flatten()
        length = int(usable[-1]) * P
        return m if length == len(m.slots) else self.cache.match_prefix(tokens[:length])

    def admit(self, req: Req) -> None:
        """Give a request a row, its cached prefix (locked) and its cached length."""
        assert req.row is None
        m = self._match(req)
        req.row = self.table.alloc_row()
        req.prefix_len = req.cached_len = len(m.slots)
        req.node = m.node
        req.cached_tokens += req.prefix_len
        req.window_dropped = 0
        self.cache.lock(m.node)
        self.cache.count_hit(m.node)
        self._admitted[0] += req.seq_len
        self._admitted[1] += req.prefix_len
        if req.prefix_len:
            self.table.table[req.row, : req.prefix_len] = m.slots
            if self.window is not None:
                self.table.window_table[req.row, : req.prefix_len] = self.allocator.window_slots(m.slots)

    def load_from_tier(self, req: Req) -> int:
        """After `admit`: the tier's blocks that continue the request's cached prefix, read into
        pages of its own as if it had prefilled them (admission counted those pages with its
        prompt's); the tree takes them after the step like any prefill. Returns the tokens loaded."""
        tier = self.tier
        if tier is None or req.key_offset:  # (an adapter's KV is never in the tier: `_save_to_tier`)
            return 0
        limit = self._match_limit(req)
        if limit // tier.block_tokens * tier.block_tokens <= req.cached_len:
            return 0
        started = time.perf_counter()
        try:
            blocks = tier.load(req.tokens(0, limit), req.cached_len)
        except Exception:  # noqa: BLE001 - the tier is a cache: a read that fails is a miss
            tier.store.stats.read_failures += 1
            log.exception("KV tier: reading blocks for request %s failed; it prefills them", req.rid)
            return 0
        if not blocks:
            return 0
        start, B = req.cached_len, tier.block_tokens
        end = (start // B + len(blocks)) * B
        slots = self.extend_slots(req, end - start)
        req.cached_len = end  # the pages are the request's now: a failure below hands them back
        try:
            tier.scatter(slots, blocks, start - start // B * B)
        except Exception:
            self.truncate(req, start)
            raise
        req.cached_tokens += end - start
        self._admitted[1] += end - start
        stats = tier.store.stats
        stats.hits += 1
        stats.tokens_loaded += end - start
        stats.load_seconds += time.perf_counter() - started
        return end - start

    def undo_admit(self, req: Req) -> None:
        """Back out of `admit` for a request that turned out not to fit."""
        self.cache.unlock(req.node)
        self.cache.count_hit(req.node, -1)
        self._admitted[0] -= req.seq_len
        self._admitted[1] -= req.prefix_len
        self.table.free_row(req.row)
        req.cached_tokens -= req.prefix_len
        req.row, req.node, req.prefix_len, req.cached_len = None, None, 0, 0

    def release(self, req: Req) -> None:
        """Hand a finished or retracted request's KV to the prefix cache and free its row."""
        slots = self.table.table[req.row, : req.cached_len]
        self.cache.cache_request(req.cache_key(0, req.cached_len), slots, req.prefix_len, req.node)
        self.table.free_row(req.row)
        req.row, req.node, req.prefix_len, req.cached_len = None, None, 0, 0

    def truncate(self, req: Req, length: int) -> None:
        """Drop a request's KV from position `length` on (its own pages only), e.g. when
        jump-forward re-encodes its last tokens; the pages past the new end are freed."""
        assert req.prefix_len <= length <= req.cached_len, (req, length)
        p = self.page_size
        first_free = pages_for(length, p) * p  # the page holding position length - 1 stays
        if first_free < req.cached_len:
            pages = self.table.table[req.row, first_free : req.cached_len : p] // p
            self.allocator.free(pages)
        req.cached_len = length
        if self.window is not None:  # a cut back by more than `rollback` must leave nothing to read
            assert length == req.prefix_len or req.window_dropped <= max(length - self.window + 1, 0), (req, length)
            req.window_dropped = min(req.window_dropped, first_free)

    def share_prefill(self, req: Req) -> None:
        """After a prefill step, put the request's KV so far into the prefix cache so that
        requests arriving while it decodes can share it. A sliding-window model's prompt goes in
        once whole, its pages out of the window unbound first: the tree's pages are not the
        request's to unbind later, and a prompt shared chunk by chunk would stay bound whole."""
        if self.window is not None:
            if req.cached_len < req.prompt_len:
                return
            self.drop_windows([req], np.array([req.cached_len]))
        slots = self.table.table[req.row, : req.cached_len]
        m = self.cache.cache_unfinished(req.cache_key(0, req.cached_len), slots, req.prefix_len, req.node)
        if len(m.slots) > req.prefix_len:
            self.table.table[req.row, : len(m.slots)] = m.slots
            if self.window is not None:  # the tree's copy is bound wherever the request's was
                self.table.window_table[req.row, : len(m.slots)] = self.allocator.window_slots(m.slots)
        req.prefix_len, req.node = len(m.slots), m.node

    def _match_limit(self, req: Req) -> int:
        # At least one token must be computed to produce logits; prompt logprobs need
        # the hidden state of every position from logprob_start_len - 1 on.
        limit = req.seq_len - 1
        if req.embed == "mean":  # every prompt position's hidden state: nothing from the cache
            return 0
        if req.wants_input_logprobs and not req.input_logprobs_done:
            limit = min(limit, max(req.logprob_start_len - 1, 0))
        return limit

    # ---- slots for a step --------------------------------------------------------------------

    def alloc_pages(self, n: int) -> torch.Tensor:
        short = n - self.allocator.num_free_pages
        if short > 0:
            self.cache.evict(short)
        pages = self.allocator.alloc(n)
        assert pages is not None, "caller must check available_pages first"
        return pages

    def extend_slots(self, req: Req, n: int) -> torch.Tensor:
        """Slots for positions [cached_len, cached_len + n) of a request, written into its row."""
        start, end, p = req.cached_len, req.cached_len + n, self.page_size
        owned_end = min(pages_for(start, p) * p, end)  # room left in the request's last page
        parts = []
        if owned_end > start:
            last = self.table.table[req.row, start - 1]
            parts.append(last + 1 + torch.arange(owned_end - start, device=last.device))
        if end > owned_end:
            pages = self.alloc_pages(pages_for(end - owned_end, p))
            parts.append((pages[:, None] * p + self._offsets).flatten()[: end - owned_end])
        slots = torch.cat(parts) if len(parts) > 1 else parts[0]
        self.table.table[req.row, start:end] = slots
        return slots

    def step_slots(self, rows: torch.Tensor, plan: StepSlots, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The KV slots of a whole step's tokens, written into the requests' rows: positions
        [start, start + n) of each row continue its last page, then take the step's new `pages`
        (`alloc_pages(plan.num_new_pages)`). `plan` was worked out on the host
        (`StepSlots.host_arrays`): a few batched device ops whatever the batch holds, nothing read back.
        Returns the slots and, for a sliding-window model, the same in the window space (the new
        pages' window pages; a row's last page is always bound: its window reads it)."""
        slots = self._plan_slots(self.table.table, rows, plan, pages)
        if self.window is None:
            return slots, None
        return slots, self._plan_slots(self.table.window_table, rows, plan, self.allocator.page_map[pages])

    def _plan_slots(self, table: torch.Tensor, rows: torch.Tensor, plan: StepSlots, pages: torch.Tensor) -> torch.Tensor:
        p = self.page_size
        if p == 1:  # every token starts a page
            slots = pages
        else:
            follow = table[rows, (plan.starts - 1).clamp(min=0)][plan.token_row] + 1 + plan.token_index
            if plan.num_new_pages:
                fresh = pages[plan.page_index.clamp(min=0)] * p + plan.page_offset
                slots = torch.where(plan.page_index < 0, follow, fresh)
            else:
                slots = follow
        table[rows[plan.token_row], plan.positions] = slots
        return slots

    def drop_windows(self, reqs: list[Req], ends: np.ndarray) -> None:
        """Unbind the window pages (allocator.WindowedPageAllocator) of these requests' own pages
        that no later query reads: a query at position q reads keys q - window + 1 .. q, and the
        KV may yet be cut back by `rollback` tokens, so of positions [0, ends) those below
        ends - window - rollback + 1 are done with, a granule at a time. `ends`: each one's
        cached length. The prefix pages are the tree's, kept for the requests that match them."""
        if self.window is None:
            return
        G, P = self._granule, self.page_size
        horizon = (ends - self._keep) // G * G
        floor = np.fromiter((max(r.prefix_len, r.window_dropped) for r in reqs), np.int64, len(reqs))
        (due,) = np.nonzero(horizon > floor)
        if not due.size:
            return
        pages = (horizon[due] - floor[due]) // P  # floors are page-aligned: prefixes, granules, truncations
        rows = np.fromiter((reqs[i].row for i in due), np.int64, due.size)
        dev = self.table.table.device
        counts = torch.from_numpy(pages).to(dev)
        positions = torch.repeat_interleave(torch.from_numpy(floor[due]).to(dev), counts) + ragged_arange(counts) * P
        rows_t = torch.repeat_interleave(torch.from_numpy(rows).to(dev), counts)
        self.allocator.unbind(self.table.table[rows_t, positions] // P)
        for i, h in zip(due.tolist(), horizon[due].tolist()):
            reqs[i].window_dropped = h

    # ---- the invariant -----------------------------------------------------------------------

    def check_accounting(self, reqs_with_rows: list[Req]) -> None:
        owned = sum(self.owned_pages(r) for r in reqs_with_rows)
        free, evictable, locked = self.allocator.num_free_pages, self.cache.evictable_pages, self.cache.locked_pages
        total = free + evictable + locked + owned
        assert total == self.num_pages, (
            f"KV accounting broken: free {free} + evictable {evictable} + locked {locked} + owned {owned} "
            f"= {total} != pool {self.num_pages}"
        )
        self.cache.check_invariants()
        if self.window is not None:
            self._check_windows(reqs_with_rows)
        if self.tier is not None:
            self.tier.store.check()

    def _check_windows(self, reqs: list[Req]) -> None:
        """Every page a running request's next query can read is bound, its window row says where,
        and only pages in use (the tree's, the requests') are bound."""
        P, alloc = self.page_size, self.allocator
        for r in reqs:
            start = max(r.cached_len - self.window + 1, 0)
            slots = self.table.table[r.row, start : r.cached_len]
            assert bool((alloc.page_map[slots // P] >= 0).all()), f"{r.rid}: a page its window reads is unbound"
            assert torch.equal(self.table.window_table[r.row, start : r.cached_len], alloc.window_slots(slots)), \
                f"{r.rid}: its window row points elsewhere than its pages' window pages"
        owned = [self.table.table[r.row, r.prefix_len : r.cached_len : P] // P for r in reqs]
        tree = [n.value[::P] // P for n in self.cache._nodes()] if isinstance(self.cache, RadixCache) else []
        in_use = torch.zeros(self.num_pages + 1, dtype=torch.bool, device=alloc.page_map.device)
        for pages in owned + tree:
            in_use[pages] = True
        stray = (alloc.page_map[:-1] >= 0) & ~in_use[:-1]
        assert not bool(stray.any()), f"pages bound but in use by no one: {torch.nonzero(stray).flatten()[:8].tolist()}"

    @property
    def window_bound_tokens(self) -> int | None:
        """Tokens whose sliding layers' K/V are held (None: no sliding-window pages)."""
        return None if self.window is None else self.allocator.num_bound_pages * self.page_size

    def flush(self) -> None:
        self.cache.reset()

    def shutdown(self) -> None:
        """Save what the tree holds to the tier (a restarted server finds it there) and wait for
        the writes."""
        if self.tier is not None:
            try:
                self.cache.save_all()
            except Exception:  # noqa: BLE001 - a shutdown interrupted mid-change: what was queued is kept
                log.exception("KV tier: saving the cache at shutdown failed")
            self.tier.store.close()
