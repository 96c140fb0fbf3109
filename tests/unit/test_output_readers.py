"""A streamed chat choice's content and calls are the whole choice's (issue 47: the stream kept the
whitespace around tool calls that the whole answer strips), however the text is cut into deltas."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.runtime.server.openai_protocol import ChatCompletionRequest
from radixlm.runtime.server.output_readers import ToolReader

TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


def _call(a: int) -> str:
    return f'<tool_call>\n{json.dumps({"name": "add", "arguments": {"a": a}})}\n</tool_call>'


_PIECES = st.sampled_from(["Let me check.", " ", "\n", "\n\n", "  ", "Done", "x", "<", "<tool", "{",
                           _call(1), _call(2), '{"name": "add", "arguments": {"a": 3}}'])


def _reader(parallel: bool) -> ToolReader:
    return ToolReader.of(ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL],
         "parallel_tool_calls": parallel}))


def _streamed(reader: ToolReader, text: str, cuts: list[int]) -> tuple[str | None, list[dict]]:
    stream = reader.stream()
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    deltas = [d for a, b in zip(bounds, bounds[1:]) for d in stream.feed(text[a:b])] + stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls = [c["function"] for d in deltas for c in d.get("tool_calls", [])]
    return content or None, calls


@settings(max_examples=1000)
@given(pieces=st.lists(_PIECES, max_size=8), cuts=st.lists(st.integers(0, 300), max_size=10),
       parallel=st.booleans())
def test_a_streamed_choice_is_the_whole_choice_however_it_is_cut(pieces, cuts, parallel):
    reader = _reader(parallel)
    text = "".join(pieces)
    content, calls = reader.read(text)
    assert _streamed(reader, text, cuts) == (content, [{"name": c.name, "arguments": c.arguments} for c in calls])


def test_whitespace_around_calls_is_not_content():
    reader = _reader(True)
    for text, want in [("Let me check.\n\n" + _call(1) + "\n", "Let me check."),
                       ("\n\n" + _call(1) + "\n\nDone.\n", "Done."),
                       ("Sure " + _call(1) + " and " + _call(2) + "  ", "Sure  and")]:
        assert reader.read(text)[0] == want
        assert _streamed(reader, text, list(range(len(text))))[0] == want  # (one character at a time)
