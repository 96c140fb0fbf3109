from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixlm.runtime.cache.allocator import PageAllocator
from radixlm.runtime.cache.radix_cache import NoPrefixCache, PrefixCache, RadixCache, TreeNode


def pages_to_slots(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)


@dataclass(eq=False)  # identity: live.remove must not compare tensors
class Req:
    tokens: list[int]
    slots: torch.Tensor
    prefix_len: int
    node: TreeNode
    owned_pages: int


class Sim:
    """Drives a cache the way the scheduler does and records what every slot holds.

    kv[slot] is the token prefix whose last token's KV the slot holds, so a match
    that hands out a wrong or reused slot is caught.
    """

    def __init__(self, cache: PrefixCache) -> None:
        self.cache, self.alloc, self.P = cache, cache.allocator, cache.page_size
        self.live: list[Req] = []
        self.kv: dict[int, tuple[int, ...]] = {}

    def start(self, tokens: list[int]) -> Req | None:
        """Admit a request: match, lock, allocate (evicting if short) and 'compute' its KV."""
        match = self.cache.match_prefix(tokens)
        prefix = len(match.slots)
        assert prefix % self.P == 0 and prefix <= len(tokens)
        for i, slot in enumerate(match.slots.tolist()):
            assert self.kv[slot] == tuple(tokens[: i + 1]), "matched slot holds another prefix's KV"
        self.cache.lock(match.node)
        need = -(-(len(tokens) - prefix) // self.P)
        if self.alloc.num_free_pages < need:
            self.cache.evict(need - self.alloc.num_free_pages)
        pages = self.alloc.alloc(need)
        if pages is None:
            self.cache.unlock(match.node)
            return None
        own = pages_to_slots(pages, self.P)[: len(tokens) - prefix]
        for i, slot in enumerate(own.tolist()):
            self.kv[slot] = tuple(tokens[: prefix + i + 1])
        req = Req(tokens, torch.cat([match.slots, own]), prefix, match.node, need)
        self.live.append(req)
        return req

    def finish(self, req: Req) -> None:
        self.live.remove(req)
        self.cache.cache_request(req.tokens, req.slots, req.prefix_len, req.node)

    def share(self, req: Req) -> None:
        """The request keeps running but shares its KV so far (cache_unfinished)."""
        match = self.cache.cache_unfinished(req.tokens, req.slots, req.prefix_len, req.node)
        n = len(match.slots)
        assert n == len(req.tokens) // self.P * self.P and n >= req.prefix_len
        for i, slot in enumerate(match.slots.tolist()):
            assert self.kv[slot] == tuple(req.tokens[: i + 1]), "shared head points at another prefix's KV"
        req.slots = torch.cat([match.slots, req.slots[n:]])
        req.prefix_len, req.node = n, match.node
        req.owned_pages = -(-len(req.tokens) // self.P) - n // self.P

    def check(self) -> None:
        self.cache.check_invariants()
        owned = sum(r.owned_pages for r in self.live)
        total = self.alloc.num_free_pages + self.cache.evictable_pages + self.cache.locked_pages + owned
        assert total == self.alloc.num_pages, "pages leaked or double-counted"

    def random_op(self, rng: random.Random, history: list[list[int]]) -> None:
        op = rng.random()
        if op < 0.5 or not self.live:
            base = rng.choice(history) if history and rng.random() < 0.8 else []
            tokens = base[: rng.randint(0, len(base))] + [rng.randint(0, 2) for _ in range(rng.randint(0, 3 * self.P))]
            if self.start(tokens):
                history.append(tokens)
        elif op < 0.65:
            self.share(rng.choice(self.live))
        elif op < 0.85:
            self.finish(rng.choice(self.live))
        else:
            want, before = rng.randint(0, 4), self.cache.evictable_pages
            freed = self.cache.evict(want)
            assert freed == before - self.cache.evictable_pages
            assert freed >= min(want, before), "evictable pages left behind"
        self.check()


def make(page_size: int, num_pages: int = 64) -> tuple[PageAllocator, RadixCache]:
    alloc = PageAllocator(num_pages, page_size)
    return alloc, RadixCache(alloc)


def cache_tokens(sim: Sim, tokens: list[int]) -> None:
    """Run one request through start and finish."""
    req = sim.start(tokens)
    assert req is not None
    sim.finish(req)


def test_match_on_empty_tree() -> None:
    _, cache = make(4)
    m = cache.match_prefix(list(range(10)))
    assert m.slots.numel() == 0 and m.slots.dtype == torch.int64
    assert m.node is cache.root
    cache.check_invariants()


def test_full_and_partial_match_split_at_page_boundary() -> None:
    _, cache = make(4)
    sim = Sim(cache)
    tokens = list(range(12))
    req = sim.start(tokens)
    slots = req.slots.clone()
    sim.finish(req)

    full = cache.match_prefix(tokens)
    assert torch.equal(full.slots, slots)

    part = cache.match_prefix(tokens[:9] + [99, 98, 97])  # diverges inside the node's third page
    assert torch.equal(part.slots, slots[:8])
    assert part.node.key == tokens[:8] and part.node.parent is cache.root  # split so the node is exactly the match
    assert [c.key for c in part.node.children.values()] == [tokens[8:]]
    assert cache.evictable_pages == 3
    cache.check_invariants()


def test_match_does_not_grow_the_tree() -> None:
    _, cache = make(4)
    sim = Sim(cache)
    cache_tokens(sim, [1, 2, 3, 4, 5, 6, 7, 8])
    m = cache.match_prefix([9, 9, 9, 9, 9])
    assert m.node is cache.root and m.slots.numel() == 0
    assert len(cache.root.children) == 1 and cache.evictable_pages == 2
    cache.check_invariants()


def test_unaligned_key_stores_whole_pages_and_frees_the_tail() -> None:
    alloc, cache = make(4, num_pages=8)
    sim = Sim(cache)
    cache_tokens(sim, list(range(10)))  # 3 pages used, 2 cached
    assert cache.evictable_pages == 2 and alloc.num_free_pages == 6
    assert len(cache.match_prefix(list(range(10))).slots) == 8
    sim.check()


def test_lock_moves_pages_and_locked_nodes_survive_eviction() -> None:
    alloc, cache = make(4, num_pages=8)
    sim = Sim(cache)
    tokens = list(range(12))
    cache_tokens(sim, tokens)
    m = cache.match_prefix(tokens[:8])
    cache.lock(m.node)
    assert (cache.evictable_pages, cache.locked_pages) == (1, 2)
    assert cache.evict(10) == 1  # only the unlocked tail below the locked node
    assert (cache.evictable_pages, cache.locked_pages) == (0, 2)
    assert torch.equal(cache.match_prefix(tokens).slots, m.slots)
    cache.unlock(m.node)
    assert (cache.evictable_pages, cache.locked_pages) == (2, 0)
    cache.check_invariants()
    assert cache.evict(10) == 2 and alloc.num_free_pages == 8


@pytest.mark.parametrize("page_size", [1, 4])
def test_evict_is_lru_and_frees_parents_that_become_leaves(page_size: int) -> None:
    _, cache = make(page_size)
    sim = Sim(cache)
    P = page_size
    stem, a, b = [1] * P, [1] * P + [2] * P, [1] * P + [3] * P
    cache_tokens(sim, a)
    cache_tokens(sim, b)  # b is newer ...
    cache.match_prefix(a)  # ... until a is touched
    assert cache.evict(1) == 1
    assert len(cache.match_prefix(b).slots) == P and len(cache.match_prefix(a).slots) == 2 * P
    cache.check_invariants()
    assert cache.evict(1) == 1  # a's leaf, not the stem that still has a child then
    assert len(cache.match_prefix(a).slots) == P
    assert cache.evict(1) == 1  # the stem became a leaf and is evictable now
    assert len(cache.match_prefix(stem).slots) == 0 and cache.evictable_pages == 0
    cache.check_invariants()


def test_duplicates_and_tail_page_are_freed() -> None:
    alloc, cache = make(4, num_pages=16)
    sim = Sim(cache)
    tokens = list(range(10))
    r1, r2 = sim.start(tokens), sim.start(tokens)  # both miss: each owns 3 pages
    assert alloc.num_free_pages == 10
    sim.finish(r1)  # caches 2 pages, frees its tail page
    assert alloc.num_free_pages == 11
    sim.finish(r2)  # all 3 of its pages are duplicates or tail
    assert alloc.num_free_pages == 14 and cache.evictable_pages == 2
    sim.check()

    longer = tokens[:8] + [50, 51, 52, 53, 60, 61, 62, 63]
    r3 = sim.start(longer)  # holds the 8-token prefix locked, owns 2 pages
    assert r3.prefix_len == 8 and alloc.num_free_pages == 12
    cache_tokens(sim, longer[:12])  # another request caches one page of r3's continuation
    assert alloc.num_free_pages == 11 and (cache.evictable_pages, cache.locked_pages) == (1, 2)
    sim.finish(r3)  # frees its duplicate page (never its prefix), caches the last one
    assert alloc.num_free_pages == 12 and (cache.evictable_pages, cache.locked_pages) == (4, 0)
    sim.check()


def test_cache_unfinished_shares_and_dedups_while_running() -> None:
    alloc, cache = make(4, num_pages=16)
    sim = Sim(cache)
    tokens = list(range(10))
    r1, r2 = sim.start(tokens), sim.start(tokens)  # both miss: 3 pages each
    sim.share(r1)  # r1's first 2 pages go into the tree, locked by r1; its tail page stays its own
    assert (cache.locked_pages, r1.owned_pages, alloc.num_free_pages) == (2, 1, 10)
    assert cache.match_prefix(tokens).slots.tolist() == r1.slots[:8].tolist()
    sim.share(r2)  # r2's copies of those 2 pages are duplicates: freed; r2 now reads r1's
    assert alloc.num_free_pages == 12 and r2.slots[:8].tolist() == r1.slots[:8].tolist()
    sim.check()
    sim.finish(r1)
    assert cache.locked_pages == 2  # r2 still holds the shared head
    sim.finish(r2)
    assert (cache.locked_pages, cache.evictable_pages, alloc.num_free_pages) == (0, 2, 14)
    sim.check()


def test_cached_slots_survive_reuse_of_the_callers_table() -> None:
    _, cache = make(2)
    table = torch.arange(4, dtype=torch.int64).repeat(2, 1)  # like a req_to_token row, reused later
    root = cache.match_prefix([7, 8, 9, 10]).node
    cache.lock(root)
    cache.cache_request([7, 8, 9, 10], table[0], 0, root)
    table[0] = -1
    assert cache.match_prefix([7, 8, 9, 10]).slots.tolist() == [0, 1, 2, 3]


def test_reset_returns_every_page() -> None:
    alloc, cache = make(2, num_pages=16)
    sim = Sim(cache)
    for tokens in ([1, 2, 3, 4, 5], [1, 2, 7, 7], [9, 9, 9]):
        cache_tokens(sim, tokens)
    cache.reset()
    assert alloc.num_free_pages == 16 and cache.evictable_pages == 0
    assert cache.match_prefix([1, 2, 3, 4]).slots.numel() == 0
    cache.check_invariants()


def test_no_prefix_cache_frees_everything() -> None:
    alloc = PageAllocator(8, 4)
    cache = NoPrefixCache(alloc)
    sim = Sim(cache)
    r1 = sim.start(list(range(10)))
    r2 = sim.start(list(range(10)))
    assert r1.prefix_len == 0 and r2.prefix_len == 0 and alloc.num_free_pages == 2
    sim.finish(r1)
    sim.finish(r2)
    assert alloc.num_free_pages == 8
    assert cache.match_prefix(list(range(10))).slots.numel() == 0
    assert (cache.evict(4), cache.evictable_pages, cache.locked_pages) == (0, 0, 0)
    sim.check()


def test_check_invariants_catches_counter_drift() -> None:
    _, cache = make(1)
    cache_tokens(Sim(cache), [1, 2, 3])
    cache._evictable += 1
    with pytest.raises(AssertionError, match="recount"):
        cache.check_invariants()


def drive(page_size: int, num_pages: int, seed: int, steps: int) -> Sim:
    rng, history = random.Random(seed), []
    sim = Sim(make(page_size, num_pages)[1])
    for _ in range(steps):
        sim.random_op(rng, history)
    for req in list(sim.live):
        sim.finish(req)
        sim.check()
    assert sim.cache.locked_pages == 0
    return sim


@pytest.mark.parametrize("page_size", [1, 2, 4, 16])
@pytest.mark.parametrize(("seed", "num_pages"), [(0, 24), (1, 24), (2, 96), (3, 96)])
def test_random_ops_keep_invariants_and_accounting(page_size: int, seed: int, num_pages: int) -> None:
    sim = drive(page_size, num_pages, seed, steps=300)
    sim.cache.evict(10**9)
    assert sim.alloc.num_free_pages == num_pages  # everything comes back once nothing is locked


def test_heap_stays_bounded_under_repeated_touches() -> None:
    _, cache = make(2)
    sim = Sim(cache)
    cache_tokens(sim, [1, 2, 3, 4])
    cache_tokens(sim, [1, 2, 5, 6])
    for i in range(500):
        cache.match_prefix([1, 2, 3, 4] if i % 2 else [1, 2, 5, 6])
        cache.check_invariants()
    assert len(cache._heap) < 100  # stale entries get dropped, not hoarded
    assert cache.evict(1) == 1  # the last loop touch was [1, 2, 3, 4], so [5, 6] goes
    assert len(cache.match_prefix([1, 2, 3, 4]).slots) == 4 and len(cache.match_prefix([1, 2, 5, 6]).slots) == 2


class RadixMachine(RuleBasedStateMachine):
    """Random insert / match / lock / unlock / share / evict / reset sequences; after every step the
    tree's invariants and the page accounting hold, and every matched slot holds its prefix's KV."""

    @initialize(page_size=st.sampled_from([1, 2, 4]), num_pages=st.integers(1, 24))
    def setup(self, page_size: int, num_pages: int) -> None:
        self.sim = Sim(make(page_size, num_pages)[1])
        self.seen: list[list[int]] = []

    @rule(data=st.data())
    def start(self, data) -> None:  # match, lock, allocate (evicting when short)
        base = data.draw(st.sampled_from(self.seen)) if self.seen and data.draw(st.booleans()) else []
        head = base[: data.draw(st.integers(0, len(base)))]
        tokens = head + data.draw(st.lists(st.integers(0, 2), max_size=3 * self.sim.P))
        if self.sim.start(tokens) is not None:
            self.seen.append(tokens)

    @precondition(lambda self: self.sim.live)
    @rule(i=st.integers(0, 15))
    def finish(self, i: int) -> None:  # cache_request + unlock
        self.sim.finish(self.sim.live[i % len(self.sim.live)])

    @precondition(lambda self: self.sim.live)
    @rule(i=st.integers(0, 15))
    def share(self, i: int) -> None:  # cache_unfinished: lock the new path, unlock the old
        self.sim.share(self.sim.live[i % len(self.sim.live)])

    @precondition(lambda self: self.seen)
    @rule(i=st.integers(0, 15))
    def match(self, i: int) -> None:  # a match without admission only touches the path
        tokens = self.seen[i % len(self.seen)]
        for slot_i, slot in enumerate(self.sim.cache.match_prefix(tokens).slots.tolist()):
            assert self.sim.kv[slot] == tuple(tokens[: slot_i + 1])

    @rule(want=st.integers(0, 6))
    def evict(self, want: int) -> None:
        before = self.sim.cache.evictable_pages
        freed = self.sim.cache.evict(want)
        assert freed == before - self.sim.cache.evictable_pages and freed >= min(want, before)

    @precondition(lambda self: not self.sim.live)
    @rule()
    def reset(self) -> None:
        self.sim.cache.reset()
        assert self.sim.alloc.num_free_pages == self.sim.alloc.num_pages

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "sim"):
            self.sim.check()

    def teardown(self) -> None:
        if hasattr(self, "sim"):
            for req in list(self.sim.live):
                self.sim.finish(req)
            self.sim.cache.evict(10**9)
            assert self.sim.alloc.num_free_pages == self.sim.alloc.num_pages, "pages lost"


TestRadixMachine = RadixMachine.TestCase
# 1,200 runs of 12 steps: the CI profile's 10,000 took 3.3 minutes on an AVX2-only CPU for no new
# failure, 2,000 took 24 s, for none either
TestRadixMachine.settings = settings(stateful_step_count=12, deadline=None, max_examples=1200)


# ---- the dashboard's snapshot ---------------------------------------------------------------

SYSTEM = list(range(1, 21))  # 20 tokens two requests share


def _shared_prefix_cache() -> tuple[RadixCache, Sim]:
    """root -> SYSTEM (20) -> [100, 101, 102] (3) and [200] * 5 (5); root -> [900] * 3 (3)."""
    _, cache = make(1)
    sim = Sim(cache)
    for tokens in (SYSTEM + [100, 101, 102], SYSTEM + [200] * 5, [900] * 3):
        cache_tokens(sim, tokens)
    return cache, sim


def _shape(view: dict) -> tuple:
    return (view["tokens"], view["depth"], view["subtree_tokens"], [_shape(c) for c in view["children"]])


def test_snapshot_draws_the_tree_largest_first() -> None:
    cache, _ = _shared_prefix_cache()
    tree = cache.snapshot()
    assert _shape(tree) == (0, 0, 31, [(20, 20, 28, [(5, 25, 5, []), (3, 23, 3, [])]), (3, 3, 3, [])])
    system = tree["children"][0]
    assert system["head"] == SYSTEM[:16] and cache.snapshot(head_tokens=4)["children"][0]["head"] == [1, 2, 3, 4]
    assert system["hidden"] == 0 and system["hidden_tokens"] == 0 and system["locks"] == 0
    # the latest use ([900] * 3, cached last) is 0 uses ago; the others were used before it
    assert tree["children"][1]["uses_ago"] == 0 and system["uses_ago"] > 0
    cache.check_invariants()


def test_snapshot_is_bounded_and_counts_what_it_leaves_out() -> None:
    cache, _ = _shared_prefix_cache()
    tree = cache.snapshot(max_nodes=2)
    # best first by tokens below: SYSTEM (28), then its [200] * 5 child (5) before [900] * 3 (3)
    assert _shape(tree) == (0, 0, 31, [(20, 20, 28, [(5, 25, 5, [])])])
    assert (tree["hidden"], tree["hidden_tokens"]) == (1, 3)
    system = tree["children"][0]
    assert (system["hidden"], system["hidden_tokens"]) == (1, 3)
    assert cache.snapshot(max_nodes=0)["children"] == []


def test_snapshot_shows_locks_and_changes_nothing() -> None:
    cache, sim = _shared_prefix_cache()
    req = sim.start(SYSTEM + [300, 301])  # a running request holds the shared prefix
    before = (cache.evictable_pages, cache.locked_pages, cache.allocator.num_free_pages)
    system = cache.snapshot()["children"][0]
    assert system["locks"] == 1 and system["tokens"] == 20
    assert (cache.evictable_pages, cache.locked_pages, cache.allocator.num_free_pages) == before
    sim.finish(req)
    assert cache.snapshot()["children"][0]["locks"] == 0
    cache.check_invariants()


def test_snapshot_counts_the_hits_on_each_node() -> None:
    cache, sim = _shared_prefix_cache()
    for tail in ([300], [100, 101, 102, 103]):  # both start from SYSTEM; the second from SYSTEM + [100..102]
        req = sim.start(SYSTEM + tail)
        cache.count_hit(req.node)
        sim.finish(req)
    system = cache.snapshot()["children"][0]
    hits = {tuple(c["head"]): c["hits"] for c in system["children"]}
    assert system["hits"] == 2 and hits[(100, 101, 102)] == 1 and hits[(200,) * 5] == 0
    cache.count_hit(cache.match_prefix(SYSTEM[:8]).node)  # a split keeps the counts of both halves
    top = cache.snapshot()["children"][0]
    assert (top["tokens"], top["hits"], top["children"][0]["hits"]) == (8, 3, 2)
    cache.check_invariants()


def test_snapshot_of_no_prefix_cache_is_empty() -> None:
    cache = NoPrefixCache(PageAllocator(8, 4))
    tree = cache.snapshot()
    assert tree["children"] == [] and tree["subtree_tokens"] == 0 and tree["hidden"] == 0
