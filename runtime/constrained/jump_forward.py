"""Jump-forward decoding: when a constraint admits exactly one continuation, append it without
sampling it token by token.

Forced text is found on the outlines-core Index, one byte at a time: a byte is
forced at a state when every token the state allows begins with that byte and
the text cannot end there; the state after it is reached through that byte's
single-byte token. The answer depends only on the (index, state) pair, so each
state is worked out once per grammar.

The forced bytes are not tokenized on their own, at either end. BPE merges
only within a pre-token (the tokenizer's first split: words, punctuation runs,
spaces), so the pre-token holding the boundary between sampled and forced text
is re-encoded whole: ``{`` sampled and ``"name"`` forced become ``{"``,
``name``. The last pre-token of the forced text is left out, to be sampled,
when it may merge with what comes next (``"`` then ``:`` is one token, ``":``):
forcing it alone would show the model a tokenization it never saw in training.
It is kept when no byte the constraint allows next would join it (``["`` before
a letter), and so is text that ends the constraint. Without a pre-tokenizer the
last re-encoded token is left out.

The scheduler then rolls the guide and the request's KV back to the first token
that changed, appends the new tokens, and computes their KV in one extend step.
Whatever is appended is checked on the way: it must round-trip through the
tokenizer byte for byte and the guide must accept the new tokens, else nothing
is jumped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from outlines_core import Index

MAX_FORCED_BYTES = 1024  # one jump's longest forced text (the next jump picks up where it stopped)
RETOKENIZE_TOKENS = 8  # output tokens re-encoded with the forced text at the boundary


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


@dataclass(frozen=True)
class Forced:
    text: bytes  # the only bytes that can follow (may be empty)
    ends: bool  # after `text` the only allowed token is EOS
    next_bytes: frozenset[int] = frozenset()  # the bytes that may follow `text`


@dataclass(frozen=True)
class Jump:
    keep: int  # how many of the re-encoded tail tokens stay as they are
    tokens: list[int]  # what replaces the rest of the tail: its remaining bytes plus forced ones


class JumpForward:
    """Finds forced continuations of a Grammar and re-encodes them at the token boundary."""

    def __init__(self, token_bytes: Sequence[bytes | None], eos_token_id: int,
                 encode: Callable[[str], list[int]],
                 pre_split: Callable[[str], list[int]] | None = None) -> None:
        """`token_bytes`: every id's bytes as in build_vocabulary (None where a guide never allows it);
        `encode`: text -> token ids, no special tokens added; `pre_split`: text -> the character
        offsets where its pre-tokens start."""
        self.token_bytes = token_bytes
        self.eos_token_id = eos_token_id
        self.encode = encode
        self.pre_split = pre_split
        self._closed: dict[tuple[str, frozenset[int]], bool] = {}
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

    def retokenize(self, tail: Sequence[int], forced: bytes, final: bool = False,
                   next_bytes: frozenset[int] = frozenset()) -> Jump | None:
        """Re-encode the end of the output `tail` with `forced` after it (`final`: nothing but EOS
        may follow it; else one of `next_bytes`, when known), or None when that adds no text or
        does not round-trip."""
        start = 0
        while start < len(tail) and _continues_character(self.token_bytes[tail[start]]):
            start += 1  # begin on a character boundary, so the tail's text decodes on its own
        ends = [0]  # byte offsets where tail tokens end, from tail[start]
        for t in tail[start:]:
            ends.append(ends[-1] + len(self.token_bytes[t] or b""))
        old = ends[-1]
        data = _whole_characters(b"".join(self.token_bytes[t] or b"" for t in tail[start:]) + forced)
        if data is None or len(data) <= old:
            return None
        whole = len(data) == old + len(forced)
        text = data.decode()
        begin, end = 0, len(data)
        if self.pre_split is not None:
            starts = self.pre_split(text)
            cuts = [len(text[:c].encode()) for c in starts]
            begin = max([c for c in cuts if c <= old and c in ends], default=0)
            if not (whole and (final or self._closes(text[max(starts, default=0):], next_bytes))):
                end = max(cuts, default=0)
        keep = ends.index(begin)
        new = self.encode(data[begin:end].decode())
        if b"".join(self.token_bytes[t] or b"\0" for t in new) != data[begin:end]:
            return None  # e.g. a tokenizer that adds a leading space, or text read as a special token
        if self.pre_split is None and not (final and whole):
            new = new[:-1]
        if sum(len(self.token_bytes[t]) for t in new) <= old - begin:
            return None  # the forced text lies within the last pre-token: let the model write it
        same = 0
        for a, b in zip(tail[start + keep:], new):
            if a != b:
                break
            same += 1
        return Jump(start + keep + same, new[same:])


    def _closes(self, piece: str, next_bytes: frozenset[int]) -> bool:
        """Whether the pre-token `piece` stays whole whatever allowed byte comes next."""
        if not next_bytes or max(next_bytes) >= 0x80 or len(next_bytes) > 32:
            return False  # unknown, a character we cannot write from one byte, or too many to try
        key = (piece, next_bytes)
        closed = self._closed.get(key)
        if closed is None:
            if len(self._closed) > 65536:
                self._closed.clear()
            closed = self._closed[key] = all(len(piece) in self.pre_split(piece + chr(b)) for b in next_bytes)
        return closed


def _continues_character(raw: bytes | None) -> bool:
    return bool(raw) and 0x80 <= raw[0] < 0xC0


def _whole_characters(data: bytes) -> bytes | None:
    """`data` cut after its last complete UTF-8 character; None if it is not UTF-8 at all."""
    try:
        data.decode()
        return data
    except UnicodeDecodeError as e:
        if e.reason != "unexpected end of data":
            return None
        return data[: e.start]
