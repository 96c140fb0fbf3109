"""Which waiting requests go first, and how much decode room each is reserved."""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

from radixlm.runtime.scheduler.req import Req

# Ordering by prefix match costs a tree walk per waiting request; past this many
# waiting requests the policies fall back to arrival order so a step stays cheap.
MATCH_ORDER_LIMIT = 128


def order_waiting(policy: str, waiting: list[Req], match: Callable[[Req], tuple[int, object]]) -> list[Req]:
    """Waiting requests in the order the policy admits them.

    `match(req)` returns (matched prefix length, deepest matched tree node).
    """
    if policy == "fcfs" or (policy in ("lpm", "dfs-weight") and len(waiting) > MATCH_ORDER_LIMIT):
        return list(waiting)
    if policy == "lof":
        return sorted(waiting, key=lambda r: -r.params.max_new_tokens)
    matches = {id(r): match(r) for r in waiting}
    if policy == "lpm":
        return sorted(waiting, key=lambda r: -matches[id(r)][0])
    return _dfs_weight(waiting, {key: node for key, (_, node) in matches.items()})


def _dfs_weight(waiting: list[Req], node_of: dict[int, object]) -> list[Req]:
    """Visit the radix tree depth-first, heavier subtrees (more waiting requests) first,
    emitting the requests whose match ends at each node: requests that share a prefix
    run back to back while it is cached."""
    at_node: dict[int, list[Req]] = defaultdict(list)
    weight: dict[int, int] = defaultdict(int)
    root = None
    for r in waiting:
        node = node_of[id(r)]
        at_node[id(node)].append(r)
        while node is not None:
            weight[id(node)] += 1
            root, node = node, node.parent
    order: list[Req] = []
    stack = [root] if root is not None else []
    while stack:
        node = stack.pop()
        order.extend(at_node.get(id(node), ()))
        kids = [c for c in node.children.values() if weight.get(id(c))]
        stack.extend(sorted(kids, key=lambda c: weight[id(c)]))  # heaviest popped first
    return order


def reserved_decode_tokens(req: Req, ratio: float) -> int:
    """Output tokens to keep room for: the request's remaining budget scaled by the
    current new_token_ratio (most requests stop well before max_new_tokens)."""
    left = max(req.params.max_new_tokens - len(req.output_ids), 0)
    return int(left * ratio)
