"""Prefix cache: a page-aware radix tree from token ids to the KV slots that hold them.

Every key length in the tree is a multiple of the page size P, and a page's slots
are contiguous (slots[i*P:(i+1)*P] == page*P + arange(P)), so a node's pages are
value[::P] // P and the tree frees and counts whole pages only.
"""
from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from operator import attrgetter
from typing import Any, Callable, NamedTuple, Sequence

import torch

from radixlm.runtime.cache.allocator import PageAllocator
from radixlm.runtime.cache.continuations import TreeContinuations

_BELOW = attrgetter("below")


class TreeNode:
    """One edge of the tree: `key` tokens whose KV lives in `value` slots (same length)."""

    __slots__ = ("key", "value", "parent", "children", "lock_ref", "last_access", "below", "hits", "__weakref__")

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None,
                 lock_ref: int = 0, last_access: int = 0) -> None:
        self.key = key
        self.value = value
        self.parent = parent  # None for the root and for evicted nodes
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.lock_ref = lock_ref
        self.last_access = last_access
        self.below = len(key)  # tokens in this node and every node under it (the snapshot's order)
        self.hits = 0  # requests admitted with a cached prefix through this node (the dashboard's)


class MatchResult(NamedTuple):
    slots: torch.Tensor  # KV slots of the longest cached prefix (page-aligned length), int64
    node: TreeNode  # deepest node of the match (the root when nothing matched): the node to lock


class PrefixCache(ABC):
    """What the scheduler sees of the prefix cache.

    Contract: a prefix returned by `match_prefix` stays valid (its slots are neither
    evicted nor reused) only while the request holds `lock(result.node)`; the request
    hands its KV back with `cache_request`, which also drops that lock. Pages are
    either free (in the allocator), owned by a live request, evictable (tree,
    unlocked) or locked (tree, lock_ref > 0): those four always add up to the pool.
    """

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size

    def _free_slots(self, slots: torch.Tensor) -> None:
        """Free the pages holding `slots`, which must start at a page boundary."""
        self.allocator.free(slots[:: self.page_size] // self.page_size)

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """Longest cached page-aligned prefix of `token_ids` and the node to lock for it."""

    @abstractmethod
    def lock(self, node: TreeNode) -> None:
        """Pin `node` and its ancestors: their pages move from evictable to locked."""

    @abstractmethod
    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock(node)`."""

    def count_hit(self, node: TreeNode, n: int = 1) -> None:
        """A request starts from the prefix ending at `node`: one more hit on its path (`n` = -1:
        an admission backed out)."""
        while node is not self.root:
            node.hits += n
            node = node.parent

    @abstractmethod
    def cache_request(self, token_ids: Sequence[int], slots: torch.Tensor, prefix_len: int,
                      node: TreeNode) -> None:
        """Take over a finished (or retracted) request's KV.

        token_ids[i]'s KV lives in slots[i] (equal lengths, any length). The first
        `prefix_len` tokens (page-aligned) are the prefix the request got from
        `match_prefix` and holds locked at `node`; the other pages are the request's.
        Caches the page-aligned head, frees the request's pages that duplicate what
        another request cached meanwhile plus the partial tail page, then unlocks
        `node`. Afterwards the request owns nothing.
        """

    @abstractmethod
    def cache_unfinished(self, token_ids: Sequence[int], slots: torch.Tensor, prefix_len: int,
                         node: TreeNode) -> MatchResult:
        """Share a running request's KV so far (after a prefill or a prefill chunk).

        Same inputs as `cache_request`, but the request keeps going: the page-aligned
        head is cached, duplicate pages are freed, and the request's lock moves from
        `node` to the node of the whole head. Returns that head's slots (the tree's,
        which the request must now use in place of its own) and node; the partial
        tail page stays the request's.
        """

    @abstractmethod
    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages if possible, least recently used first; return pages freed."""

    @property
    @abstractmethod
    def evictable_pages(self) -> int: ...

    @property
    @abstractmethod
    def locked_pages(self) -> int: ...

    @abstractmethod
    def reset(self) -> None:
        """Drop everything, pages back to the allocator. Only valid when nothing is locked."""

    def snapshot(self, max_nodes: int = 64, head_tokens: int = 16) -> dict[str, Any]:
        """The cached prefixes as a tree of at most `max_nodes` nodes, the ones holding the most
        tokens below them first: a view for people (the dashboard), made on request and never per
        step. Its work is bounded by the nodes shown and their children, not the tree: the tokens
        below each node are kept as the tree changes. A node: `tokens` (its own), `depth` (the
        prefix's tokens up to its end), `subtree_tokens`, `locks` (running requests holding it),
        `uses_ago` (tree uses since its last: 0 is the latest), `hits` (requests admitted with a
        prefix through it), `head` (its first `head_tokens` ids), `children`, and `hidden` /
        `hidden_tokens` for the children left out."""
        root, latest = self.root, self._latest_use()
        out = {"tokens": 0, "depth": 0, "subtree_tokens": root.below, "locks": 0, "uses_ago": 0, "hits": 0,
               "head": [], "children": [], "hidden": len(root.children), "hidden_tokens": root.below}
        seq = itertools.count()
        # only a node's `left` largest children can still be shown: the rest are never pushed
        frontier = [(-c.below, next(seq), c, out) for c in heapq.nlargest(max_nodes, root.children.values(), key=_BELOW)]
        heapq.heapify(frontier)
        for left in range(max_nodes - 1, -1, -1):
            if not frontier:
                break
            _, _, node, parent = heapq.heappop(frontier)
            view = {"tokens": len(node.key), "depth": parent["depth"] + len(node.key), "subtree_tokens": node.below,
                    "locks": node.lock_ref, "uses_ago": latest - node.last_access, "hits": node.hits,
                    "head": node.key[:head_tokens],
                    "children": [], "hidden": len(node.children), "hidden_tokens": node.below - len(node.key)}
            parent["children"].append(view)
            parent["hidden"] -= 1
            parent["hidden_tokens"] -= node.below
            for c in heapq.nlargest(left, node.children.values(), key=_BELOW):
                heapq.heappush(frontier, (-c.below, next(seq), c, view))
        return out

    def _latest_use(self) -> int:
        return 0

    @abstractmethod
    def check_invariants(self) -> None:
        """Walk the whole structure (debug/tests); raise AssertionError on inconsistency."""


class RadixCache(PrefixCache):
    """Radix tree with LRU eviction of unlocked leaves.

    Eviction uses a min-heap of (last_access, seq, node) with lazy invalidation: an
    entry is pushed whenever a node may have become an evictable leaf or its time
    changed, and entries that no longer describe an evictable leaf at that time are
    skipped on pop. The heap is rebuilt when stale entries outnumber the nodes.
    """

    def __init__(self, allocator: PageAllocator, continuations: TreeContinuations | None = None,
                 on_evict: Callable[[list[int], torch.Tensor, int], None] | None = None) -> None:
        """`continuations`: an n-gram index of the cached tokens, kept as nodes are made
        (speculative decoding's tree proposer). `on_evict(tokens, slots, start)`: called before
        a leaf's pages are freed, with its whole path's tokens and slots and where the leaf's own
        begin (the KV tier saves them)."""
        super().__init__(allocator)
        self.continuations = continuations
        self.on_evict = on_evict
        self._clock = itertools.count(1)  # logical time: ties and wall-clock jitter can't reorder LRU
        self._seq = itertools.count()  # heap tie-breaker so TreeNodes are never compared
        self._clear()

    def reset(self) -> None:
        assert self._locked == 0, "reset while prefixes are locked"
        values = [node.value for node in self._nodes()]
        if values:
            self._free_slots(torch.cat(values))  # every value is whole pages
        self._clear()
        if self.continuations is not None:
            self.continuations.clear()

    def _clear(self) -> None:
        self.root = TreeNode([], torch.empty(0, dtype=torch.int64, device=self.allocator.device), None)
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._num_nodes = 0  # excluding the root
        self._now = 0  # the clock's latest reading (the snapshot's `uses_ago`)
        self._evictable = 0
        self._locked = 0

    @property
    def evictable_pages(self) -> int:
        return self._evictable

    @property
    def locked_pages(self) -> int:
        return self._locked

    # ---- lookup and insert -------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """Longest cached page-aligned prefix of `token_ids`; refreshes its LRU time.

        NOTE: the only structural change is a split: when the match ends inside a
        node (at a page boundary) that node is cut there, so the returned node covers
        exactly the matched prefix. Cached slots and page accounting are unchanged.
        """
        key = list(token_ids[: len(token_ids) // self.page_size * self.page_size])
        node, _ = self._walk(key)
        self._touch(node)
        return MatchResult(self._path_slots(node), node)

    def _path_slots(self, node: TreeNode) -> torch.Tensor:
        """The slots from the root to the end of `node`."""
        values = []
        while node is not self.root:
            values.append(node.value)
            node = node.parent
        return torch.cat(values[::-1]) if values else self.root.value

    def _walk(self, key: list[int]) -> tuple[TreeNode, int]:
        """Follow `key` (page-aligned) down the tree, splitting where it ends mid-node."""
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(self._page_key(key, pos))
            if child is None:
                break
            n = self._common_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            node, pos = child, pos + n
        return node, pos

    def _insert(self, key: list[int], slots: torch.Tensor, prefix_len: int) -> int:
        """Cache `key` (page-aligned) with `slots`; return how many leading tokens were present.
        Of those, the pages past `prefix_len` (the caller's own, duplicating the tree's) are freed."""
        assert len(key) % self.page_size == 0 and len(key) == len(slots), (len(key), len(slots))
        node, pos = self._walk(key)
        # The locked prefix is in the tree, so it is always found again.
        assert pos >= prefix_len, (pos, prefix_len)
        if pos > prefix_len:  # NOTE: slots[:prefix_len] are the tree's own pages: never free those
            P = self.page_size
            kept = self._path_slots(node)[prefix_len:pos:P] // P
            self.allocator.free_duplicates(kept, slots[prefix_len:pos:P] // P)
        if pos < len(key):
            # NOTE: clone, since callers may pass a view of a per-request table that gets reused.
            leaf = TreeNode(key[pos:], slots[pos:].clone(), node)
            node.children[self._page_key(leaf.key, 0)] = leaf
            self._num_nodes += 1
            self._add_below(node, len(leaf.key))
            self._evictable += self._pages(leaf)
            if self.continuations is not None:
                self.continuations.add(leaf, pos)
            node = leaf
        self._touch(node)
        return pos

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after n tokens; the new upper node is returned, `child` keeps the tail."""
        upper = TreeNode(child.key[:n], child.value[:n], child.parent, child.lock_ref, child.last_access)
        upper.below = child.below  # the same tokens hang under the cut
        upper.hits = child.hits
        child.below -= n
        upper.children[self._page_key(child.key, n)] = child
        child.parent.children[self._page_key(child.key, 0)] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        self._num_nodes += 1
        return upper

    def cache_request(self, token_ids: Sequence[int], slots: torch.Tensor, prefix_len: int,
                      node: TreeNode) -> None:
        P = self.page_size
        assert len(token_ids) == len(slots) and prefix_len % P == 0, (len(token_ids), len(slots), prefix_len)
        aligned = len(token_ids) // P * P
        self._insert(list(token_ids[:aligned]), slots[:aligned], prefix_len)
        self._free_slots(slots[aligned:])
        self.unlock(node)

    def cache_unfinished(self, token_ids: Sequence[int], slots: torch.Tensor, prefix_len: int,
                         node: TreeNode) -> MatchResult:
        P = self.page_size
        assert len(token_ids) == len(slots) and prefix_len % P == 0, (len(token_ids), len(slots), prefix_len)
        aligned = len(token_ids) // P * P
        head = list(token_ids[:aligned])
        self._insert(head, slots[:aligned], prefix_len)
        match = self.match_prefix(head)
        assert len(match.slots) == aligned, (len(match.slots), aligned)
        self.lock(match.node)  # lock the new path before unlocking the old one, which it contains
        self.unlock(node)
        return match

    # ---- locking and LRU ---------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.parent is not None, "locking an evicted node"
            if node.lock_ref == 0:
                self._evictable -= self._pages(node)
                self._locked += self._pages(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        deepest = node
        while node is not self.root:
            assert node.lock_ref > 0, "unlock without lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += self._pages(node)
                self._locked -= self._pages(node)
            node = node.parent
        self._push_if_evictable(deepest)  # only the deepest node of a path can be a leaf

    def _touch(self, node: TreeNode) -> None:
        """Stamp `node` and its ancestors as used now."""
        now = self._now = next(self._clock)
        deepest = node
        while node is not self.root:
            node.last_access = now
            node = node.parent
        self._push_if_evictable(deepest)

    def evict(self, num_pages: int) -> int:
        freed = 0
        while freed < num_pages and self._heap:
            stamp, _, leaf = heapq.heappop(self._heap)
            if stamp == leaf.last_access and self._is_evictable_leaf(leaf):
                freed += self._remove_leaf(leaf)
        return freed

    def _remove_leaf(self, leaf: TreeNode) -> int:
        parent, pages = leaf.parent, self._pages(leaf)
        if self.on_evict is not None:
            self.on_evict(*self.path(leaf))
        self._free_slots(leaf.value)
        del parent.children[self._page_key(leaf.key, 0)]
        leaf.parent = None  # marks it evicted: stale heap entries and locks see it
        self._add_below(parent, -len(leaf.key))
        self._num_nodes -= 1
        self._evictable -= pages
        self._push_if_evictable(parent)
        return pages

    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        # parent is None for the root and for evicted nodes
        return node.parent is not None and not node.children and node.lock_ref == 0

    def _push_if_evictable(self, node: TreeNode) -> None:
        if not self._is_evictable_leaf(node):
            return
        heapq.heappush(self._heap, (node.last_access, next(self._seq), node))
        if len(self._heap) > 2 * self._num_nodes + 64:
            self._rebuild_heap()  # amortized O(1): needs as many pushes as nodes since the last one

    def _rebuild_heap(self) -> None:
        self._heap = [(n.last_access, next(self._seq), n) for n in self._nodes() if self._is_evictable_leaf(n)]
        heapq.heapify(self._heap)

    # ---- helpers and checks ------------------------------------------------

    def path(self, node: TreeNode) -> tuple[list[int], torch.Tensor, int]:
        """The tokens and slots from the root to the end of `node`, and where `node`'s own begin."""
        keys, values = [], []
        walker = node
        while walker is not self.root:
            keys.append(walker.key)
            values.append(walker.value)
            walker = walker.parent
        tokens = [t for key in reversed(keys) for t in key]
        return tokens, torch.cat(values[::-1]), len(tokens) - len(node.key)

    def save_all(self) -> None:
        """Hand every cached node to `on_evict` without evicting it (a shutdown's last save)."""
        # NOTE: every node, not only leaves: a node's blocks are those that end inside it
        if self.on_evict is not None:
            for node in self._nodes():
                self.on_evict(*self.path(node))

    def _page_key(self, key: list[int], pos: int) -> int | tuple[int, ...]:
        return key[pos] if self.page_size == 1 else tuple(key[pos : pos + self.page_size])

    def _common_len(self, node_key: list[int], key: list[int], pos: int) -> int:
        """Page-aligned length of the common prefix; the first page is known to match."""
        if key[pos : pos + len(node_key)] == node_key:
            return len(node_key)  # fast path: a whole-node match is one C-level list compare
        P, limit = self.page_size, min(len(node_key), len(key) - pos)
        n = P
        while n < limit and node_key[n : n + P] == key[pos + n : pos + n + P]:
            n += P
        return n

    def _pages(self, node: TreeNode) -> int:
        return len(node.key) // self.page_size

    def _add_below(self, node: TreeNode | None, n: int) -> None:
        """`n` tokens more (or fewer) under `node` and each of its ancestors."""
        while node is not None:
            node.below += n
            node = node.parent

    def _latest_use(self) -> int:
        return self._now

    def _nodes(self) -> list[TreeNode]:
        """All nodes but the root, parents before children."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def check_invariants(self) -> None:
        P, nodes = self.page_size, self._nodes()
        evictable = locked = 0
        assert self.root.lock_ref == 0 and not self.root.key, "root must stay empty and unlocked"
        for node in nodes:
            assert node.parent is not None and node.parent.children.get(self._page_key(node.key, 0)) is node, \
                f"node {node.key[:P]} is not filed under its first page"
            assert node.key and len(node.key) % P == 0, f"key length {len(node.key)} not a positive multiple of {P}"
            assert len(node.value) == len(node.key), f"value length {len(node.value)} != key length {len(node.key)}"
            assert node.value.dtype == torch.int64, node.value.dtype
            pages = node.value.view(-1, P)
            assert bool((pages == pages[:, :1] + torch.arange(P, device=pages.device)).all()) \
                and bool((pages[:, 0] % P == 0).all()), "a page's slots are not contiguous and aligned"
            assert node.lock_ref >= 0, f"negative lock_ref {node.lock_ref}"
            if node.parent is not self.root:
                assert node.parent.lock_ref >= node.lock_ref, "child locked more than its parent"
                assert node.parent.last_access >= node.last_access, "parent older than its child"
            if node.lock_ref:
                locked += self._pages(node)
            else:
                evictable += self._pages(node)
        assert (evictable, locked) == (self._evictable, self._locked), \
            f"counters (evictable, locked)={(self._evictable, self._locked)} but recount gives {(evictable, locked)}"
        assert self._num_nodes == len(nodes), f"node count {self._num_nodes} != {len(nodes)}"
        for node in [self.root, *nodes]:
            assert node.below == len(node.key) + sum(c.below for c in node.children.values()), \
                f"tokens below {node.key[:P]}: kept {node.below}, counted otherwise"
        in_heap = {id(n) for t, _, n in self._heap if t == n.last_access}
        lost = [n.key[:P] for n in nodes if self._is_evictable_leaf(n) and id(n) not in in_heap]
        assert not lost, f"evictable leaves missing from the heap: {lost[:4]}"
        used = torch.cat([n.value[::P] // P for n in nodes]) if nodes else None
        if used is not None:
            assert used.numel() == used.unique().numel(), "a page is cached twice"
        self.allocator.check_invariants(used)


class NoPrefixCache(PrefixCache):
    """--disable-radix-cache: nothing is ever shared; finished requests free all their pages."""

    def __init__(self, allocator: PageAllocator) -> None:
        super().__init__(allocator)
        self.root = TreeNode([], torch.empty(0, dtype=torch.int64, device=allocator.device), None)

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        return MatchResult(self.root.value, self.root)

    def lock(self, node: TreeNode) -> None:
        pass

    def unlock(self, node: TreeNode) -> None:
        pass

    def cache_request(self, token_ids: Sequence[int], slots: torch.Tensor, prefix_len: int,
                      node: TreeNode) -> None:
        assert len(token_ids) == len(slots) and prefix_len % self.page_size == 0
        self._free_slots(slots[prefix_len:])

    def cache_unfinished(self, token_ids: Sequence[int], slots: torch.Tensor, prefix_len: int,
                         node: TreeNode) -> MatchResult:
        return MatchResult(self.root.value, self.root)  # nothing is shared: the request keeps its pages

    def evict(self, num_pages: int) -> int:
        return 0

    @property
    def evictable_pages(self) -> int:
        return 0

    @property
    def locked_pages(self) -> int:
        return 0

    def reset(self) -> None:
        pass

    def check_invariants(self) -> None:
        assert not self.root.children and self.root.lock_ref == 0, "NoPrefixCache must stay empty"
