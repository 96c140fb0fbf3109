"""`--grammar-backend outlines`: constraints as regexes (constraint_regex.py) compiled to
outlines-core Indexes in the compiler process; a request's place is an outlines-core `Guide`.

Forced text (jump-forward) is found on the Index, one byte at a time: a byte is forced at a state
when every token the state allows begins with that byte and the text cannot end there; the state
after it is reached through that byte's single-byte token. The answer depends only on the
(index, state) pair, so each state is worked out once per grammar.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from outlines_core import Guide, Index, Vocabulary

from radixlm.runtime.constrained.backend import Builder, ConstraintKey, GrammarBackend, Matcher, check_rollback
from radixlm.runtime.constrained.constraint_regex import build_index, uses_end_mark
from radixlm.runtime.constrained.jump_forward import RETOKENIZE_TOKENS, Forced
from radixlm.runtime.constrained.vocabulary import end_token_id, vocabulary_from_bytes
from radixlm.runtime.token_mask import allow_token

MAX_FORCED_BYTES = 1024  # one jump's longest forced text (the next jump picks up where it stopped)


@dataclass
class Grammar:
    """A compiled constraint: its Index (built with the end mark, see constraint_regex.build_index),
    the end mark's token, and per state what was worked out so far: whether the text may end there,
    and the forced continuation."""

    index: Index
    end_token: int | None = None  # the end mark's token, when the Index was built with the mark
    forced: dict[int, Forced] = field(default_factory=dict)
    _ends: dict[int, bool] = field(default_factory=dict)

    def can_end(self, state: int) -> bool:
        """Whether the text so far is a whole match (so EOS is allowed): with the end mark, its
        token leads from `state` to a final state; without, `state` is final."""
        if self.end_token is None:
            return self.index.is_final_state(state)
        ends = self._ends.get(state)
        if ends is None:
            after = self.index.get_next_state(state, self.end_token)
            ends = self._ends[state] = after is not None and self.index.is_final_state(after)
        return ends

    def allows(self, state: int, token: int, eos_token_id: int) -> bool:
        """Whether `token` may come next (EOS exactly where the text may end)."""
        if token == eos_token_id:
            return self.can_end(state)
        return token != self.end_token and self.index.get_next_state(state, token) is not None


class ForcedWalk:
    """The forced continuation of an Index's state, byte by byte."""

    def __init__(self, token_bytes: Sequence[bytes | None], eos_token_id: int) -> None:
        self.eos_token_id = eos_token_id
        self._size = len(token_bytes)
        self._first_byte = np.array([b[0] if b else -1 for b in token_bytes], dtype=np.int16)
        self._byte_token = [-1] * 256  # the token that is exactly this one byte
        for token_id, raw in enumerate(token_bytes):
            if raw is not None and len(raw) == 1 and self._byte_token[raw[0]] < 0:
                self._byte_token[raw[0]] = token_id

    def forced(self, grammar: Grammar, state: int) -> Forced:
        found = grammar.forced.get(state)
        if found is None:
            found = grammar.forced[state] = self._walk(grammar, state)
        return found

    def _walk(self, grammar: Grammar, state: int) -> Forced:
        index = grammar.index
        text = bytearray()
        while len(text) < MAX_FORCED_BYTES:
            # ids past the table: the end mark's token, which an Index built without the mark still
            # allows where its regex admits a NUL byte; never sampled
            allowed = [t for t in index.get_allowed_tokens(state) or () if t < self._size and t != self.eos_token_id]
            if grammar.can_end(state):
                return Forced(bytes(text), ends=not allowed)
            if not allowed:
                break
            first = self._first_byte[allowed]
            byte = int(first[0])
            if byte < 0 or not (first == byte).all():
                return Forced(bytes(text), False, frozenset(np.unique(first[first >= 0]).tolist()))
            token = self._byte_token[byte]
            next_state = index.get_next_state(state, token) if token >= 0 else None
            if next_state is None:
                break  # only multi-byte tokens lead on from here: stop the jump before this byte
            text.append(byte)
            state = next_state
        return Forced(bytes(text), ends=False)


class OutlinesBuilder(Builder):
    def __init__(self, vocabulary: Vocabulary) -> None:
        self.vocabulary = vocabulary

    def build(self, key: ConstraintKey) -> Index:
        return build_index(key, self.vocabulary)


class OutlinesBackend(GrammarBackend):
    name = "outlines"

    def __init__(self, table: Sequence[bytes | None], eos_token_id: int) -> None:
        super().__init__(OutlinesBuilder(vocabulary_from_bytes(table, eos_token_id)))
        self.walk = ForcedWalk(table, eos_token_id)
        self.end_token = end_token_id(table)  # the end mark's token (constraint_regex.END_MARK)
        self.eos_token_id = eos_token_id

    @property
    def vocabulary(self) -> Vocabulary:
        return self.builder.vocabulary

    def load(self, key: ConstraintKey, built: Index) -> Grammar:
        return Grammar(built, self.end_token if uses_end_mark(key) else None)

    def matcher(self, grammar: Grammar) -> OutlinesMatcher:
        return OutlinesMatcher(grammar, Guide(grammar.index, max_rollback=RETOKENIZE_TOKENS), self)


class OutlinesMatcher(Matcher):
    def __init__(self, grammar: Grammar, guide: Guide, backend: OutlinesBackend) -> None:
        self.grammar = grammar
        self.guide = guide
        self._backend = backend

    def fill_mask(self, row: Any) -> None:
        self.guide.write_mask_into(row.data_ptr(), row.numel(), row.element_size())
        if self.grammar.end_token is not None and self.can_end():
            # an Index built with the end mark never allows EOS itself: see constraint_regex.END_MARK
            allow_token(row, self._backend.eos_token_id)

    def advance(self, token: int) -> None:
        self.guide.advance(token, return_tokens=False)

    def accepts(self, tokens: Sequence[int]) -> bool:
        return self.guide.accepts_tokens(list(tokens))

    def can_end(self) -> bool:
        return self.grammar.can_end(self.guide.get_state())

    @property
    def max_rollback(self) -> int:
        return self.guide.get_allowed_rollback()

    def rollback(self, n: int) -> None:
        check_rollback(n, self.guide.get_allowed_rollback())
        self.guide.rollback_state(n)

    def forced(self) -> Forced:
        return self._backend.walk.forced(self.grammar, self.guide.get_state())
