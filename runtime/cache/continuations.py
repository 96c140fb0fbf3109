"""What followed a few tokens elsewhere: n-gram lookup over one sequence, and over the radix tree.

Speculative decoding proposes the tokens that followed the latest earlier occurrence of a
request's last n tokens. `NgramIndex` looks in the request's own prompt and output (prompt
lookup). `TreeContinuations` looks in every sequence the prefix cache holds (other requests'
prompts and finished outputs, the request's own prompt): the radix tree already stores those
tokens once, so the index keeps only, per n-gram, a weak reference to the tree node where its
latest occurrence ends and that end's depth. Nothing is copied and an evicted node's entries
die with it.

Depths stay right through splits: a split leaves the tail in the original node object, on the
same path from the root, so an entry's (node, depth) still names the same tokens; when the depth
now falls above the node, the continuation is read from the ancestor that holds it.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from radixlm.runtime.cache.radix_cache import TreeNode

NGRAM_SIZES = (4, 3, 2)  # longest first: the longest match wins


class NgramIndex:
    """Where each n-gram of one growing sequence last ended (for n in `sizes`), updated by the
    tokens added since the last lookup: a step's cost does not grow with the sequence."""

    __slots__ = ("sizes", "last_end", "indexed")

    def __init__(self, sizes: Sequence[int] = NGRAM_SIZES) -> None:
        self.sizes = tuple(sizes)
        self.last_end: dict[tuple[int, ...], int] = {}  # gram -> end (exclusive) of its latest occurrence
        self.indexed = 0  # grams ending at positions <= indexed are in last_end

    def propose(self, length: int, tokens: Callable[[int, int], list[int]], k: int) -> tuple[int, list[int]]:
        """(n, up to k tokens) that followed the latest earlier occurrence of the last n of the
        sequence's `length` tokens, the longest such n; (0, []) when none occurred before.
        `tokens(start, end)` reads the sequence; it must only have grown since the last call."""
        first = max(self.indexed + 1, min(self.sizes))  # grams ending at first .. length - 1 are new
        if first < length:
            lo = max(first - max(self.sizes), 0)
            _index_grams(self.last_end, tokens(lo, length), first - lo, self.sizes,
                         lambda ends: range(ends.start + lo, ends.stop + lo))
            self.indexed = length - 1
        for n in self.sizes:
            if n > length:
                continue
            end = self.last_end.get(tuple(tokens(length - n, length)))
            if end is not None:
                return n, tokens(end, min(end + k, length))
        return 0, []


class TreeContinuations:
    """n-grams of the sequences in a radix tree -> (node, depth) where their latest occurrence ends.

    The tree calls `add` for every node it creates; lookups skip (and drop) entries whose node
    was evicted. At most `capacity` grams are kept, the oldest forgotten first."""

    def __init__(self, sizes: Sequence[int] = NGRAM_SIZES, capacity: int = 1 << 20) -> None:
        self.sizes = tuple(sizes)
        self.capacity = capacity
        self._ends: dict[tuple[int, ...], tuple[weakref.ref, int]] = {}

    def __len__(self) -> int:
        return len(self._ends)

    def add(self, node: TreeNode, start: int) -> None:
        """Index the grams followed by a token of `node`'s key (which begins at depth `start`), the
        ones that begin above it included (a gram ending at its end waits for a child)."""
        above = _tokens_above(node, max(self.sizes) - 1)
        ref, shift = weakref.ref(node), start - len(above)  # tokens[i] lies at depth i + shift
        _index_grams(self._ends, above + node.key, len(above), self.sizes,
                     lambda ends: zip(itertools.repeat(ref), (i + shift for i in ends)))
        ends = self._ends
        if len(ends) > self.capacity:  # the first indexed go first
            for gram in list(itertools.islice(ends, len(ends) - self.capacity * 7 // 8)):
                del ends[gram]

    def propose(self, tail: Sequence[int], k: int) -> tuple[int, list[int]]:
        """(n, up to k tokens) that followed the latest cached occurrence of the last n of `tail`,
        the longest such n; (0, []) when none is cached."""
        for n in self.sizes:
            if n > len(tail):
                continue
            gram = tuple(tail[len(tail) - n :])
            entry = self._ends.get(gram)
            if entry is None:
                continue
            found = _read_on(entry[0](), entry[1], k)
            if found is None:
                del self._ends[gram]  # its node was evicted
                continue
            if found:
                return n, found
        return 0, []

    def clear(self) -> None:
        self._ends.clear()


def _index_grams(index: dict, tokens: list[int], first: int, sizes: Sequence[int], value: Callable) -> None:
    """For each n in `sizes`, index[gram] = value for the n-gram ending before each tokens[i],
    i in [first, len(tokens)) (the later the occurrence, the later it is written: the latest
    wins); `value` maps the range of those i to the values. Tuples and updates run in C."""
    size = len(tokens)
    for n in sizes:
        lo = max(first, n)
        if lo >= size:
            continue
        grams = zip(*(tokens[lo - n + j : size - n + j] for j in range(n)))
        index.update(zip(grams, value(range(lo, size))))


def _tokens_above(node: TreeNode, n: int) -> list[int]:
    """The last `n` tokens of the path from the root to `node`'s parent (fewer near the root)."""
    out: list[int] = []
    up = node.parent
    while up is not None and len(out) < n:
        out = up.key[-(n - len(out)):] + out
        up = up.parent
    return out


def _read_on(node: TreeNode | None, depth: int, k: int) -> list[int] | None:
    """Up to k tokens of the tree from `depth` on, along the path through `node`, continuing into
    the most recently used child; None when `node` is gone (evicted, or collected)."""
    if node is None or node.parent is None:  # collected, or evicted (only the root has no parent
        return None                           # and nothing ends in the root: its key is empty)
    start, up = 0, node.parent  # the depth where node's key begins: its ancestors' tokens
    while up is not None:
        start += len(up.key)
        up = up.parent
    while depth < start:  # split since: the tokens now lie in an ancestor
        node = node.parent
        start -= len(node.key)
    out = node.key[depth - start : depth - start + k]
    while len(out) < k and node.children:
        node = max(node.children.values(), key=_last_access)
        out += node.key[: k - len(out)]
    return out


def _last_access(node: TreeNode) -> int:
    return node.last_access
