"""Reasoning models: the `<think>...</think>` block split from the answer (`--reasoning-parser`).

A reasoning model writes its thoughts in a block before the answer. Where the block may start
depends on the model's chat template:

* `qwen3`: the model opens `<think>` itself; `chat_template_kwargs={"enable_thinking": false}`
  makes the template close an empty block in the prompt instead, so the output is all answer.
* `deepseek-r1` (and `qwen3-thinking`, Qwen3's thinking-only releases): the template opens
  `<think>` in the prompt, so the output begins inside the block (R1-0528 repeats the tag: a
  leading `<think>` is dropped).

When thinking is on (`thinking`), the output begins inside the block and everything up to the
first end tag is reasoning (all of it, if the output stops before the tag). When it is off, only
an output that opens with the start tag (after whitespace) has a block. The rest is content.

`split_reasoning` splits a whole text; `ReasoningStream` splits deltas as they come, holding back
a tail that may be the start of a tag, so a tag cut across deltas never leaks into either part.
Fed any cut of a text, a stream yields what `split_reasoning` gives for the whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str
    end: str
    toggle: str | None  # the chat_template_kwargs key that turns thinking off; None: always on

    def thinking(self, chat_template_kwargs: dict[str, Any] | None) -> bool:
        """Whether the output begins inside the reasoning block."""
        return self.toggle is None or (chat_template_kwargs or {}).get(self.toggle) is not False


FORMATS = {
    "qwen3": ReasoningFormat("qwen3", "<think>", "</think>", toggle="enable_thinking"),
    "deepseek-r1": ReasoningFormat("deepseek-r1", "<think>", "</think>", toggle=None),
    # Qwen3's thinking-only releases (2507): the template opens the block, as DeepSeek-R1's does
    "qwen3-thinking": ReasoningFormat("qwen3-thinking", "<think>", "</think>", toggle=None),
}


def reasoning_format(name: str) -> ReasoningFormat:
    """The format of a `--reasoning-parser` name; ValueError names the known ones."""
    fmt = FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(FORMATS))}")
    return fmt


def end_tag_ids(parser: str | None, tokenizer: Any) -> list[int]:
    """The token ids of `parser`'s end tag in `tokenizer` ([] without either)."""
    if parser is None or tokenizer is None:
        return []
    return tokenizer.encode(reasoning_format(parser).end, add_special_tokens=False)


def gate_ids(require_reasoning: bool, end_ids: list[int], constrained: bool) -> list[int]:
    """What a request's constraint waits for (TokenizedRequest.reasoning_end_ids): the end tag when
    its output begins with reasoning, else nothing. ValueError when the server has no parser."""
    if not require_reasoning:
        return []
    if not end_ids:
        raise ValueError("require_reasoning needs a server started with --reasoning-parser (and a tokenizer)")
    return end_ids if constrained else []


class Split(NamedTuple):
    reasoning: str
    content: str


def split_reasoning(text: str, fmt: ReasoningFormat, thinking: bool) -> Split:
    """(reasoning, content) of a whole output."""
    stream = ReasoningStream(fmt, thinking)
    a, b = stream.feed(text), stream.finish()
    return Split(a.reasoning + b.reasoning, a.content + b.content)


class _Phase(Enum):
    OPENING = "opening"  # not yet known whether the output opens with the start tag
    REASONING = "reasoning"
    CONTENT = "content"


class ReasoningStream:
    """One output's deltas split into reasoning and content, in order."""

    def __init__(self, fmt: ReasoningFormat, thinking: bool) -> None:
        self.fmt = fmt
        self.thinking = thinking
        self.phase = _Phase.OPENING
        self.held = ""  # text not yet given out: a possible start of a tag

    @property
    def in_reasoning(self) -> bool:
        """Whether text that comes next would be reasoning (so far as is known)."""
        return self.phase is _Phase.REASONING or (self.phase is _Phase.OPENING and self.thinking)

    def feed(self, delta: str) -> Split:
        text, self.held = self.held + delta, ""
        reasoning = ""
        if self.phase is _Phase.OPENING:
            head = text.lstrip()
            if self.fmt.start.startswith(head) and len(head) < len(self.fmt.start):
                self.held = text  # (all whitespace, or a cut start tag)
                return Split("", "")
            if head.startswith(self.fmt.start):
                text = head[len(self.fmt.start):]
                self.phase = _Phase.REASONING
            else:
                self.phase = _Phase.REASONING if self.thinking else _Phase.CONTENT
        if self.phase is _Phase.REASONING:
            end = text.find(self.fmt.end)
            if end < 0:
                keep = _partial_tail(text, self.fmt.end)
                self.held = text[len(text) - keep:]
                return Split(text[: len(text) - keep], "")
            reasoning, text = text[:end], text[end + len(self.fmt.end):]
            self.phase = _Phase.CONTENT
        return Split(reasoning, text)

    def finish(self) -> Split:
        """The held-back tail, once the output has ended: it was no tag after all."""
        held, self.held = self.held, ""
        return Split(held, "") if self.in_reasoning else Split("", held)


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
