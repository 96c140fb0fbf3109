"""Jump-forward decoding: when a constraint admits exactly one continuation, append it without
sampling it token by token.

Each backend's matcher finds its forced text (`Matcher.forced`: outlines walks
its Index, outlines_backend.ForcedWalk; llguidance and xgrammar have their own).

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

The scheduler then rolls the matcher and the request's KV back to the first token
that changed, appends the new tokens, and computes their KV in one extend step.
Whatever is appended is checked on the way: it must round-trip through the
tokenizer byte for byte and the matcher must accept the new tokens, else nothing
is jumped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

RETOKENIZE_TOKENS = 8  # output tokens re-encoded with the forced text at the boundary


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
    """Re-encodes forced text with the output before it at the token boundary."""

    def __init__(self, token_bytes: Sequence[bytes | None], eos_token_id: int,
                 encode: Callable[[str], list[int]],
                 pre_split: Callable[[str], list[int]] | None = None) -> None:
        """`token_bytes`: every id's bytes as in vocabulary.token_bytes (None where a constraint never allows it);
        `encode`: text -> token ids, no special tokens added; `pre_split`: text -> the character
        offsets where its pre-tokens start."""
        self.token_bytes = token_bytes
        self.eos_token_id = eos_token_id
        self.encode = encode
        self.pre_split = pre_split
        self._closed: dict[tuple[str, frozenset[int]], bool] = {}

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
