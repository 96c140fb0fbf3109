"""Incremental detokenization: output token ids in, safe-to-emit text deltas out.

Per step we decode only a small window of ids (the prefix offset / read offset
technique): ``ids[prefix:read]`` was decoded last step and gives the context
that fixes leading spaces; ``ids[prefix:]`` adds the new tokens, and the text
past the context is the delta. The window then slides forward, so a step costs
the same at token 10 as at token 10,000.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"  # what decode yields for the bytes of a character that has not completed yet
PROMPT_CONTEXT = 5  # trailing prompt ids decoded as context so the first output token gets its leading space right


class IncrementalDetokenizer:
    """Turns a request's output token ids, arriving a few at a time, into text deltas.

    Contract: the deltas of all ``add`` calls, the last with ``flush=True``,
    join to ``tokenizer.decode(output_ids, skip_special_tokens=...)``, cut
    right before the first stop string if one matched (right after it with ``keep_stop``). In particular:

    - a multi-byte character split across tokens is held back until its last
      byte arrives (a delta never carries half a character);
    - a tail that could be the start of a stop string is held back until it is
      resolved, so no part of a stop string is ever emitted;
    - once a stop string matches, ``stopped_on`` names it and later ids are ignored;
    - ``flush=True`` releases whatever is held (except after a stop).
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, stop: Sequence[str] = (), replaceable: int = 0,
                 keep_stop: bool = False) -> None:
        """`replaceable`: how many of the latest ids `replace` may take back (kept past the window);
        `keep_stop` (SGLang's `no_stop_trim`): the text ends with the matched stop string instead of before it."""
        assert all(stop), "stop strings must be non-empty (SamplingParams rejects empty ones)"
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop = tuple(stop)
        self.keep_stop = keep_stop
        self.text = ""  # everything emitted so far: the concatenation of the deltas
        self.stopped_on: str | None = None
        context = self._prompt_context(prompt_ids or ())
        # Only the decode window (and `replaceable` ids before it) is kept: older ids are dropped as it slides.
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._replaceable = replaceable
        self._held = ""  # decoded text withheld because it may begin a stop string
        self._skip = 0  # characters of replaced ids already taken, to drop from their replacement's text

    def add(self, new_ids: Sequence[int], flush: bool = False) -> str:
        """Take the next output ids; return the text that is now safe to emit (may be empty)."""
        if self.stopped_on is not None:
            return ""
        self._ids.extend(new_ids)
        self._held += self._decode_new(flush)
        delta = self._release(flush)
        self.text += delta
        return delta

    def replace(self, count: int, new_ids: Sequence[int], flush: bool = False) -> str:
        """Like `add`, after taking back the last `count` ids: jump-forward re-encoded them
        together with forced text, so `new_ids` decode to their text and then more. Text already
        emitted stays; the delta is what follows it."""
        if self.stopped_on is not None:
            return ""
        first = len(self._ids) - count
        assert first >= 0, "cannot take back more ids than the detokenizer keeps"
        if first < self._read_offset:
            taken = self._decode(self._ids[:self._read_offset])
            self._skip += len(taken) - len(self._decode(self._ids[:first]))
            self._prefix_offset, self._read_offset = 0, first
        del self._ids[first:]
        return self.add(new_ids, flush)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens,
                                     spaces_between_special_tokens=self.spaces_between_special_tokens)

    def _prompt_context(self, prompt_ids: Sequence[int]) -> list[int]:
        tail = list(prompt_ids[-PROMPT_CONTEXT:])
        # NOTE: a prompt ending mid-character would let the first output bytes complete a prompt
        # character; dropping the context keeps the output's own text, as decode(output_ids) does.
        return [] if self._decode(tail).endswith(REPLACEMENT) else tail

    def _decode_new(self, flush: bool) -> str:
        """Text of the ids past the read offset; empty while they do not yet decode to whole characters."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        # No new characters (an incomplete one, or a skipped special token): keep the window
        # as it is so the next ids are decoded with the same context.
        if not flush and (len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT)):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        drop = max(self._prefix_offset - self._replaceable, 0)
        del self._ids[:drop]
        self._prefix_offset -= drop
        self._read_offset -= drop
        text = new_text[len(prefix_text):]
        skip, self._skip = min(self._skip, len(text)), max(self._skip - len(text), 0)
        return text[skip:]

    def _release(self, flush: bool) -> str:
        """Cut the held text at a stop string, or hand out all of it but a possible stop-string start."""
        match = self._find_stop()
        if match is not None:
            cut, self.stopped_on = match
            if self.keep_stop:
                cut += len(self.stopped_on)
            delta, self._held = self._held[:cut], ""
            return delta
        keep = 0 if flush else self._stop_prefix_len()
        delta = self._held[:len(self._held) - keep]
        self._held = self._held[len(delta):]
        return delta

    def _find_stop(self) -> tuple[int, str] | None:
        # Emitted text never ends in a stop-string start, so any match begins inside the held text.
        hits = [(at, s) for s in self.stop if (at := self._held.find(s)) >= 0]
        return min(hits, key=lambda hit: hit[0]) if hits else None

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the held text that some stop string begins with."""
        longest = min(len(self._held), max((len(s) for s in self.stop), default=1) - 1)
        for n in range(longest, 0, -1):
            tail = self._held[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
