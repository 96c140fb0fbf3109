"""Reasoning models: the `<think>...</think>` block split from the answer, or gpt-oss's harmony
channels read apart (`--reasoning-parser`).

A reasoning model writes its thoughts in a block before the answer. Where the block may start
depends on the model's chat template:

* `qwen3`: the model opens `<think>` itself; `chat_template_kwargs={"enable_thinking": false}`
  makes the template close an empty block in the prompt instead, so the output is all answer.
* `deepseek-r1` (and `qwen3-thinking`, Qwen3's thinking-only releases): the template opens
  `<think>` in the prompt, so the output begins inside the block (R1-0528 repeats the tag: a
  leading `<think>` is dropped).
* `gpt-oss`: no block but messages on channels (harmony, at the end of this file), read by their
  own stream; a constraint waits for the final channel's message to open.

When thinking is on (`thinking`), the output begins inside the block and everything up to the
first end tag is reasoning (all of it, if the output stops before the tag). When it is off, only
an output that opens with the start tag (after whitespace) has a block. The rest is content.

`split_reasoning` splits a whole text; `ReasoningStream` splits deltas as they come, holding back
a tail that may be the start of a tag, so a tag cut across deltas never leaks into either part.
Fed any cut of a text, a stream yields what `split_reasoning` gives for the whole.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str
    end: str
    toggle: str | None  # the chat_template_kwargs key that turns thinking off; None: always on
    # the markers are special tokens (gpt-oss's): the output is detokenized with them kept
    special_tokens: bool = False

    def thinking(self, chat_template_kwargs: dict[str, Any] | None) -> bool:
        """Whether the output begins inside the reasoning block."""
        return self.toggle is None or (chat_template_kwargs or {}).get(self.toggle) is not False


FORMATS = {
    "qwen3": ReasoningFormat("qwen3", "<think>", "</think>", toggle="enable_thinking"),
    "deepseek-r1": ReasoningFormat("deepseek-r1", "<think>", "</think>", toggle=None),
    # Qwen3's thinking-only releases (2507): the template opens the block, as DeepSeek-R1's does
    "qwen3-thinking": ReasoningFormat("qwen3-thinking", "<think>", "</think>", toggle=None),
    # harmony: its "end" is where the answer's message opens (what a constraint waits for)
    "gpt-oss": ReasoningFormat("gpt-oss", "<|channel|>analysis<|message|>", "<|channel|>final<|message|>",
                               toggle=None, special_tokens=True),
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
    stream = reasoning_stream(fmt, thinking)
    a, b = stream.feed(text), stream.finish()
    return Split(a.reasoning + b.reasoning, a.content + b.content)


def reasoning_stream(fmt: ReasoningFormat, thinking: bool) -> ReasoningStream:
    """The stream that reads `fmt`'s outputs (gpt-oss's: harmony.HarmonyStream, the same interface)."""
    if fmt.name == "gpt-oss":
        return HarmonyStream()  # type: ignore[return-value]
    return ReasoningStream(fmt, thinking)


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


# ---- gpt-oss's harmony messages --------------------------------------------------------------
# gpt-oss's output format ("harmony", `--reasoning-parser gpt-oss`): an answer written as messages,
# each a header naming its channel (and, for a tool call, its recipient) and a body.
#
#     <|channel|>analysis<|message|>Let me look that up.<|end|>
#     <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
#
# The chat template ends the prompt with `<|start|>assistant`, so the output opens with the first
# message's header. A message ends at `<|end|>`, or at `<|call|>` / `<|return|>` (the model's stop
# tokens: a tool call, the final answer), or where the output stops. Channels:
#
# * `analysis`: the reasoning (`reasoning_content`);
# * `final`, and `commentary` addressed to no one (a preamble to the user): the content;
# * any message addressed `to=functions.NAME`: a call of NAME, its body the arguments. It reaches
#   the content as a `<tool_call>` block (runtime/tool_calls.py's own form), so the request's
#   tool_choice reads it there as any model's call, streamed or not.
#
# The markers are special tokens, so a request read this way is detokenized with them kept
# (`skip_special_tokens` false unless it says otherwise). `HarmonyStream` reads deltas as they
# come, holding back a tail that may begin a marker; fed any cut of a text it gives what it gives
# for the whole (tests/unit/test_reasoning.py).
MESSAGE = "<|message|>"
# what ends a message: <|end|>, the stop tokens <|call|> and <|return|>, or a new message's start
ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
FUNCTIONS = "functions."


class _State(Enum):
    HEADER = "header"  # reading a message's header, up to <|message|>
    BODY = "body"


class HarmonyStream:
    """One output's deltas, as reasoning and content (tool calls written into the content as
    `<tool_call>` blocks), in order."""

    def __init__(self) -> None:
        self.state = _State.HEADER
        self.text = ""  # not yet read: a header so far, or a body's tail that may begin a marker
        self.channel = ""
        self.recipient: str | None = None
        self.arguments = ""  # a call's body, given out whole when the call ends
        self.messages = 0  # headers read

    @property
    def in_reasoning(self) -> bool:
        """Whether text that comes next would be reasoning (so far as is known)."""
        return self.state is _State.BODY and self.channel == "analysis" and self.recipient is None

    def feed(self, delta: str) -> Split:
        self.text += delta
        reasoning, content = [], []
        while True:
            if self.state is _State.HEADER:
                at = self.text.find(MESSAGE)
                if at < 0:
                    break
                self._header(self.text[:at])
                self.text = self.text[at + len(MESSAGE):]
                self.state = _State.BODY
                continue
            end, marker = _first_end(self.text)
            body = self.text if end < 0 else self.text[:end]
            if end < 0:  # hold back what may begin a marker
                keep = _partial_marker(body)
                body, self.text = body[: len(body) - keep], body[len(body) - keep:]
            else:
                self.text = self.text[end + len(marker):]
            self._body(body, reasoning, content)
            if end < 0:
                break
            self._close(content)
            self.state = _State.HEADER
        return Split("".join(reasoning), "".join(content))

    def finish(self) -> Split:
        """What is left once the output has ended: an open message's last text (and its call)."""
        reasoning, content = [], []
        if self.state is _State.BODY:
            self._body(self.text, reasoning, content)
            self._close(content)
        elif self.messages == 0:  # no header at all: not harmony; the text is the answer
            content.append(self.text)
        self.text = ""
        self.state = _State.HEADER
        return Split("".join(reasoning), "".join(content))

    def _header(self, header: str) -> None:
        channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
        self.channel = channel.group(1) if channel else ""
        self.recipient = recipient.group(1) if recipient else None
        self.arguments = ""
        self.messages += 1

    def _body(self, text: str, reasoning: list[str], content: list[str]) -> None:
        if self.recipient is not None:
            self.arguments += text
        elif self.channel == "analysis":
            reasoning.append(text)
        else:  # final, and commentary to the user
            content.append(text)

    def _close(self, content: list[str]) -> None:
        """A message ended: a call's block joins the content."""
        if self.recipient is not None and self.recipient.startswith(FUNCTIONS):
            content.append(_call_block(self.recipient[len(FUNCTIONS):], self.arguments))
        self.recipient, self.channel, self.arguments = None, "", ""


def _call_block(name: str, arguments: str) -> str:
    """A call as runtime/tool_calls.py reads one: its arguments as an object where they parse."""
    try:
        args: object = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        args = arguments  # (a string: the call stays text, as any unreadable call does)
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def _first_end(text: str) -> tuple[int, str]:
    """Where the first marker that ends a message begins in `text`, and which (-1 if none)."""
    found = [(text.find(m), m) for m in ENDS if m in text]
    return min(found) if found else (-1, "")


def _partial_marker(text: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of a marker."""
    for n in range(min(len(text), max(map(len, ENDS)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in ENDS):
            return n
    return 0


def split_harmony(text: str) -> Split:
    """(reasoning, content) of a whole output."""
    stream = HarmonyStream()
    a, b = stream.feed(text), stream.finish()
    return Split(a.reasoning + b.reasoning, a.content + b.content)
