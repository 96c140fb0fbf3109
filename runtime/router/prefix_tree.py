"""An approximate picture of one replica's prefix cache: a radix tree over the request texts sent to
it, trimmed least-recently-used first once it holds more than `max_chars` characters.

The router cannot see a replica's real cache (token pages, evicted on the replica's own terms), so
it remembers what it sent there; a long match means the replica most likely still holds that
prefix.
"""

from __future__ import annotations

import heapq
import itertools
import os

_clock = itertools.count()


class _Node:
    __slots__ = ("key", "children", "parent", "last_access")

    def __init__(self, key: str, parent: _Node | None) -> None:
        self.key = key
        self.children: dict[str, _Node] = {}
        self.parent = parent
        self.last_access = next(_clock)


class PrefixTree:
    def __init__(self, max_chars: int = 1 << 21) -> None:
        self.root = _Node("", None)
        self.max_chars = max_chars
        self.chars = 0

    def match(self, text: str) -> int:
        """Length of the longest prefix of `text` in the tree (marks the path as used)."""
        node, pos = self.root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                break
            common = len(os.path.commonprefix([child.key, text[pos : pos + len(child.key)]]))
            child.last_access = next(_clock)
            pos += common
            if common < len(child.key):
                break
            node = child
        return pos

    def insert(self, text: str) -> None:
        node, pos = self.root, 0
        while pos < len(text):
            node.last_access = next(_clock)
            child = node.children.get(text[pos])
            if child is None:
                leaf = _Node(text[pos:], node)
                node.children[text[pos]] = leaf
                self.chars += len(leaf.key)
                break
            common = len(os.path.commonprefix([child.key, text[pos : pos + len(child.key)]]))
            if common < len(child.key):  # split: `upper` takes the shared part
                upper = _Node(child.key[:common], node)
                node.children[text[pos]] = upper
                child.key, child.parent = child.key[common:], upper
                upper.children[child.key[0]] = child
                child = upper
            pos += common
            node = child
        node.last_access = next(_clock)
        if self.chars > self.max_chars:
            self._trim(self.max_chars * 3 // 4)

    def _trim(self, target: int) -> None:
        """Drop least recently used leaves until at most `target` characters remain."""
        leaves, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.children:
                leaves.append((node.last_access, id(node), node))
        heapq.heapify(leaves)
        while self.chars > target and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            self.chars -= len(leaf.key)
            if parent is not self.root and not parent.children:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
