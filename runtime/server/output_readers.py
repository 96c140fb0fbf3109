"""Readers of a chat choice's generated text, as the request asks: its tool calls (``ToolReader``,
by ``tool_choice``; ``ToolStream`` for a streamed choice), its reasoning apart from its content
(``ReasoningReader``; ``ReasoningDeltas`` streamed), and ``ChoiceStream``, a streamed choice's
deltas: ``reasoning_content`` first, then the content that tool calls are read from. Shared by
the chat completions and Responses endpoints; free of I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from radixlm.runtime import tool_calls
from radixlm.runtime.reasoning import ReasoningFormat, Split, reasoning_format, reasoning_stream, split_reasoning
from radixlm.runtime.server.openai_protocol import ChatCompletionRequest


# ---------------------------------------------------------------- tool calls


@dataclass
class ToolReader:
    """Reads a chat choice's tool calls, by the request's ``tool_choice`` (see runtime/tool_calls.py)."""

    mode: Literal["auto", "required", "named"]
    names: set[str]
    parallel: bool
    function: str | None = None  # the named one
    # Whether a forced (named) call whose arguments never began (the output ended in the reasoning,
    # or before anything but whitespace) is still answered: chat's shape has a named tool_choice's
    # call in every answer; the Responses and Messages APIs leave it out and say why the output
    # ended (incomplete, max_tokens) instead.
    unbegun_call: bool = True

    @classmethod
    def of(cls, req: ChatCompletionRequest, unbegun_call: bool = True) -> ToolReader | None:
        mode = req.tool_mode
        if mode == "none":
            return None
        named = req.tool_choice.function.name if mode == "named" else None
        return cls(mode, {t.function.name for t in req.tools or ()}, req.parallel_tool_calls, named, unbegun_call)

    def read(self, text: str) -> tuple[str | None, list[tool_calls.ToolCall]]:
        """(content, calls) of a whole choice. The content never begins with whitespace, nor ends
        with it beside calls: a stream sends the same (`ToolStream`), though it cannot know, as
        text comes, whether a call will follow."""
        if self.mode == "named":  # the text is the arguments (cut short if the length limit struck)
            return None, [tool_calls.ToolCall(self.function, text)] if text.strip() or self.unbegun_call else []
        # a `required` output is a JSON array of calls, which auto's reading takes as bare calls
        # (cut short by the length limit, it stays content)
        content, calls = tool_calls.parse_auto(text, self.names, self.parallel)
        return (content or "").lstrip() or None, calls

    def finish_reason(self, finish: str) -> str:
        """OpenAI says "tool_calls" when the model chose to call, and "stop" when the call was forced by name."""
        return "tool_calls" if finish == "stop" and self.mode != "named" else finish

    def stream(self) -> ToolStream:
        return ToolStream(self)


class ToolStream:
    """One streamed choice's deltas: content as it can be sent, calls as OpenAI streams them."""

    def __init__(self, reader: ToolReader) -> None:
        self.reader = reader
        # auto and required (bare JSON calls, held to the end)
        self.auto = tool_calls.AutoStream(reader.names, reader.parallel) if reader.mode != "named" else None
        self.named_call: tool_calls.ToolCall | None = None
        self.held = ""  # a forced call's arguments, held back while they are whitespace only
        self.called = False
        self.spaces = ""  # whitespace at the end of the content so far: sent once text follows it
        self.begun = False  # whether any content went out (whitespace before it never does)

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.auto is not None:
            return self._content(self.auto.feed(text))
        if self.named_call is None:  # the first piece of the arguments opens the call, named
            self.held += text
            if not self.held.strip():  # nothing of them yet (the reasoning may still be streaming)
                return []
            return self._open_named(self.held)
        return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]

    def _open_named(self, arguments: str) -> list[dict[str, Any]]:
        self.named_call = tool_calls.ToolCall(self.reader.function, arguments)
        self.called = True
        return [{"tool_calls": [self.named_call.openai(0)]}]

    def _content(self, text: str) -> list[dict[str, Any]]:
        """What of the content can go out: as `ToolReader.read` trims a whole one, its leading
        whitespace never, and whitespace at its end only once text follows (a call may)."""
        text = self.spaces + text if self.begun else text.lstrip()
        body = text.rstrip()
        self.spaces = text[len(body):]
        self.begun = self.begun or bool(body)
        return [{"content": body}] if body else []

    def finish(self) -> list[dict[str, Any]]:
        if self.auto is None:  # a forced call whose arguments never began: answered if the reader says so
            return self._open_named(self.held) if self.named_call is None and self.reader.unbegun_call else []
        content, calls = self.auto.finish()
        deltas = self._content(content)
        if calls:
            self.called = True
            deltas.append({"tool_calls": [c.openai(i) for i, c in enumerate(calls)]})
        elif self.spaces:  # no call came: the content's last whitespace is its own
            deltas.append({"content": self.spaces})
        return deltas


# ---------------------------------------------------------------- reasoning


@dataclass
class ReasoningReader:
    """Splits a chat choice's reasoning from its content (runtime/reasoning.py), as the request asks."""

    fmt: ReasoningFormat
    thinking: bool  # the output begins inside the reasoning block
    whole: bool = False  # stream the reasoning in one delta, once it has ended

    @classmethod
    def of(cls, req: ChatCompletionRequest, parser: str | None) -> ReasoningReader | None:
        if parser is None or not req.separate_reasoning:
            return None
        fmt = reasoning_format(parser)
        return cls(fmt, fmt.thinking(req.chat_template_kwargs), whole=not req.stream_reasoning)

    def split(self, text: str) -> Split:
        return split_reasoning(text, self.fmt, self.thinking)

    def stream(self) -> ReasoningDeltas:
        return ReasoningDeltas(self)


class ReasoningDeltas:
    """One streamed choice's text split into reasoning and content deltas."""

    def __init__(self, reader: ReasoningReader) -> None:
        self.stream = reasoning_stream(reader.fmt, reader.thinking)
        self.whole = reader.whole
        self.thought = ""  # reasoning held back until it ends (``whole``)

    def feed(self, text: str, finished: bool) -> Split:
        part = self.stream.feed(text)
        if finished:
            rest = self.stream.finish()
            part = Split(part.reasoning + rest.reasoning, part.content + rest.content)
        if not self.whole:
            return part
        self.thought += part.reasoning
        if self.stream.in_reasoning and not finished:
            return Split("", part.content)
        thought, self.thought = self.thought, ""
        return Split(thought, part.content)


class ChoiceStream:
    """One streamed chat choice's deltas: ``reasoning_content`` first (with ``reasoning``), then the
    content, read for tool calls (with ``tools``)."""

    def __init__(self, tools: ToolReader | None, reasoning: ReasoningReader | None) -> None:
        self.tools = tools.stream() if tools is not None else None
        self.reasoning = reasoning.stream() if reasoning is not None else None

    @property
    def called(self) -> bool:
        """Whether the model chose to call a tool (so far)."""
        return self.tools is not None and self.tools.called

    def feed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        deltas = []
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text, finished)
            if thought:
                deltas.append({"reasoning_content": thought})
        if self.tools is None:
            if text or not deltas:
                deltas.append({"content": text})
        else:
            deltas += self.tools.feed(text) + (self.tools.finish() if finished else [])
        return deltas
