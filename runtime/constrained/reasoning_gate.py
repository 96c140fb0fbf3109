"""A constraint that starts where a reasoning block ends.

A reasoning model's output begins with free thoughts and ends with the answer the constraint
(JSON schema, regex, tool calls) is about. `ReasoningGate` stands in front of the request's
`Matcher`, whichever backend made it: until the output holds the reasoning's end tokens
(`</think>`) it allows every token (EOS too: the output may end inside its reasoning), forces
nothing and rolls nothing back, so jump-forward neither puts constraint text into the reasoning
nor re-encodes across the tag. From the token that completes the end tag on, every call goes to
the wrapped matcher, which starts from its initial state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixlm.runtime.constrained.backend import Matcher
from radixlm.runtime.constrained.jump_forward import Forced

NOTHING_FORCED = Forced(b"", False)


class ReasoningGate(Matcher):
    def __init__(self, inner: Matcher, end_ids: Sequence[int]) -> None:
        assert end_ids, "a reasoning gate needs the end tag's token ids"
        self.inner = inner
        self.end_ids = tuple(end_ids)
        self.matched = 0  # how many of end_ids the output ends with, while the gate is shut
        self.since_open = 0  # tokens the inner matcher has taken (it may roll back no further)

    @property
    def open(self) -> bool:
        """Whether the reasoning has ended, so the constraint holds."""
        return self.matched == len(self.end_ids)

    @classmethod
    def fill_masks(cls, rows: Sequence[tuple[int, Matcher]], mask: Any) -> None:
        # open gates' matchers fill by their own class (in one call, as the backend likes);
        # shut gates leave their rows as they start: all ones
        by_class: dict[type, list[tuple[int, Matcher]]] = {}
        for i, gate in rows:
            if gate.open:
                by_class.setdefault(type(gate.inner), []).append((i, gate.inner))
        for inner_cls, group in by_class.items():
            inner_cls.fill_masks(group, mask)

    def fill_mask(self, row: Any) -> None:
        if self.open:
            self.inner.fill_mask(row)
        else:
            row.fill_(-1)

    def advance(self, token: int) -> None:
        if self.open:
            self.inner.advance(token)
            self.since_open += 1
        else:
            self.matched = _next_match(self.end_ids, self.matched, token)

    def accepts(self, tokens: Sequence[int]) -> bool:
        matched = self.matched
        for i, token in enumerate(tokens):
            if matched == len(self.end_ids):
                return self.inner.accepts(tokens[i:])
            matched = _next_match(self.end_ids, matched, token)
        return True

    def can_end(self) -> bool:
        return self.inner.can_end() if self.open else True

    @property
    def max_rollback(self) -> int:
        return min(self.inner.max_rollback, self.since_open) if self.open else 0

    def rollback(self, n: int) -> None:
        assert n <= self.max_rollback, f"a reasoning gate rolls back at most {self.max_rollback}, not {n}"
        if n:
            self.inner.rollback(n)
            self.since_open -= n

    def forced(self) -> Forced:
        return self.inner.forced() if self.open else NOTHING_FORCED


def _next_match(end: tuple[int, ...], matched: int, token: int) -> int:
    """How much of `end` the output ends with after `token`, given it ended with end[:matched]."""
    seq = end[:matched] + (token,)
    for n in range(min(len(seq), len(end)), 0, -1):
        if seq[-n:] == end[:n]:
            return n
    return 0
