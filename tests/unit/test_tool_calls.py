"""Tool calling: prompts with tools, forced-call schemas, and reading calls out of text, whole or streamed."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.runtime import tool_calls
from radixlm.runtime.constrained.constraint_regex import to_regex
from radixlm.runtime.tool_calls import AutoStream, for_template, parse_auto

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
NAMES = {"get_weather", "add"}


def block(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def summary(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


# ------------------------------------------------------------ reading calls


def test_tagged_calls_are_read_and_the_text_around_them_is_the_content():
    text = "Let me check.\n" + block("get_weather", {"city": "Paris", "unit": "c"}) + "\n" + block("add", {"a": 1, "b": 2})
    content, calls = parse_auto(text, NAMES)
    assert content == "Let me check."
    assert summary(calls) == [("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 1, "b": 2})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


def test_only_the_first_call_counts_without_parallel_calls():
    text = block("add", {"a": 1, "b": 2}) + block("add", {"a": 3, "b": 4})
    content, calls = parse_auto(text, NAMES, parallel=False)
    assert content is None and summary(calls) == [("add", {"a": 1, "b": 2})]


@pytest.mark.parametrize("text", [
    "The weather is fine.",
    "<tool_call>not json</tool_call>",
    block("delete_everything", {}),  # not one of the tools
    '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',  # arguments not an object
    '{"name": "nope", "arguments": {}}',
    "{ an answer that opens with a brace",
])
def test_text_that_is_no_call_of_a_known_tool_stays_content(text):
    assert parse_auto(text, NAMES) == (text, [])


@pytest.mark.parametrize("text,parallel,expected", [
    ('[{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]', True,
     [("add", {"a": 1}), ("get_weather", {"city": "Oslo"})]),  # the shape `required` forces
    ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": {"a": 2}}]', False,
     [("add", {"a": 1})]),  # Mistral's
    ('<|python_tag|>{"name": "add", "parameters": {"a": 1}}', True, [("add", {"a": 1})]),  # Llama 3.1's
    ('<|tool_call|>[{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": {"a": 2}}]', True,
     [("add", {"a": 1}), ("add", {"a": 2})]),  # Granite 3's
    ('functools[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', True,
     [("get_weather", {"city": "Oslo"})]),  # Phi-4-mini's
])
def test_bare_json_calls_are_read(text, parallel, expected):
    content, calls = parse_auto(text, NAMES, parallel)
    assert content is None and summary(calls) == expected


@pytest.mark.parametrize("text", ['[1, 2, 3]', '[{"name": "add", "arguments": {}}, {"name": "rm", "arguments": {}}]', "[]"])
def test_json_that_is_not_all_calls_is_content(text):
    assert parse_auto(text, NAMES) == (text, [])


def test_other_call_styles_are_read():
    # Llama 3's bare JSON with "parameters"; arguments given as a JSON string; the closing tag cut by EOS
    assert summary(parse_auto(' {"name": "add", "parameters": {"a": 1, "b": 2}}', NAMES)[1]) == [("add", {"a": 1, "b": 2})]
    assert summary(parse_auto('<tool_call>{"name": "add", "arguments": "{\\"a\\": 5}"}</tool_call>', NAMES)[1]) == [
        ("add", {"a": 5})]
    content, calls = parse_auto('Sure. <tool_call>{"name": "add", "arguments": {"a": 7}}', NAMES)
    assert content == "Sure." and summary(calls) == [("add", {"a": 7})]


@pytest.mark.parametrize("text", [
    '{"name": {"first": "Ada"}, "born": 1815}',  # a JSON answer that has a "name" (once a 500: unhashable)
    '<tool_call>{"name": ["add"], "arguments": {"a": 1}}</tool_call>',
    '[{"name": "add", "arguments": {}}, {"name": {"add": 1}, "arguments": {}}]',
    '<tool_call>{"name": "add", "arguments": {"a": NaN}}</tool_call>',  # no JSON answer carries NaN
    '{"name": "add", "arguments": {"a": Infinity}}',
    '<tool_call>{"name": "add", "arguments": {"a": "\\ud800"}}</tool_call>',  # a lone surrogate: no UTF-8
    '<tool_call>{"name": "add", "arguments": "{\\"a\\": -Infinity}"}</tool_call>',
    "[" * 100_000 + "]" * 100_000,  # deeper than the parser's recursion limit
])
def test_json_that_names_no_tool_or_no_json_answer_can_carry_is_content(text):
    assert parse_auto(text, NAMES) == (text, [])
    stream = AutoStream(NAMES, True)
    sent = stream.feed(text)
    assert (sent + stream.finish()[0], stream.finish()[1]) == (text, [])


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)


@settings(max_examples=500)
@given(name=st.sampled_from(sorted(NAMES)) | _JSON, args=st.sampled_from([{"a": 1}, {}]) | _JSON,
       key=st.sampled_from(["arguments", "parameters"]), as_string=st.booleans(),
       form=st.sampled_from(["tagged", "bare", "array", "marker"]))
def test_any_json_name_and_arguments_read_as_a_call_or_as_content(name, args, key, as_string, form):
    """Whatever JSON a model puts under "name" and "arguments", the text is a call exactly when the
    name is one of the tools (a string) and the arguments an object (or a JSON text of one), else
    it is content; nothing raises, whole or streamed."""
    obj = json.dumps({"name": name, key: json.dumps(args) if as_string else args})
    text = {"tagged": f"Here. <tool_call>{obj}</tool_call>", "bare": obj, "array": f"[{obj}]",
            "marker": f"<|python_tag|>{obj}"}[form]
    content, calls = parse_auto(text, NAMES)
    if isinstance(name, str) and name in NAMES and isinstance(args, dict):
        assert summary(calls) == [(name, args)] and content == ("Here." if form == "tagged" else None)
    else:
        assert (content, calls) == (text, [])
    stream = AutoStream(NAMES, True)
    sent = stream.feed(text[:7]) + stream.feed(text[7:])
    rest, streamed = stream.finish()
    assert summary(streamed) == summary(calls) and (sent + rest).strip() == (content or "").strip()


_PIECES = st.sampled_from([
    "Hello", " world", "\n", " ", "<", "<tool", "{", "}", "a < b", '"x"',
    block("add", {"a": 1, "b": 2}), block("get_weather", {"city": "Oslo", "unit": "f"}),
    "<tool_call>oops</tool_call>", "<tool_call>", '{"name": "add", "arguments": {"a": 3}}',
    "[TOOL_CALLS]", "<|python_tag|>", "[1, 2]", '[{"name": "add", "arguments": {"a": 1}}]',
    "<|tool_call|>", "functools", "<|tool", "funct",
])


@settings(max_examples=2000)
@given(pieces=st.lists(_PIECES, max_size=8), cuts=st.lists(st.integers(0, 400), max_size=12),
       parallel=st.booleans())
def test_a_stream_sends_what_the_whole_text_holds_however_it_is_cut(pieces, cuts, parallel):
    text = "".join(pieces)
    stream = AutoStream(NAMES, parallel)
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    sent = "".join(stream.feed(text[a:b]) for a, b in zip(bounds, bounds[1:]))
    rest, calls = stream.finish()
    content, expected = parse_auto(text, NAMES, parallel)
    assert summary(calls) == summary(expected)
    assert tool_calls.OPEN not in sent  # what may be a call is never sent as content
    if expected:
        assert (sent + rest).strip() == (content or "")
    else:
        assert sent + rest == text


def test_a_stream_holds_back_only_what_may_open_a_call():
    stream = AutoStream(NAMES, True)
    assert [stream.feed(c) for c in ["The", " answer <", "tool", " is", " 4"]] == ["The", " answer ", "", "<tool is", " 4"]
    assert stream.finish() == ("", [])


# ---------------------------------------------------------------- prompts


def test_a_template_without_tools_gets_them_as_text_and_calls_round_trip():
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    out, tools = for_template(messages, [WEATHER, ADD], "{{ messages }}")
    assert tools is None
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\n# Tools")
    for tool in (WEATHER, ADD):
        assert json.dumps(tool["function"]) in out[0]["content"]
    assert out[1] == messages[1]
    content, calls = parse_auto(out[2]["content"], NAMES)  # the model sees its past call in the form it is asked for
    assert content is None and summary(calls) == [("add", {"a": 1, "b": 2})]
    assert out[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}
    # no system message: one is added
    out, _ = for_template(messages[1:2], [ADD], "{{ messages }}")
    assert [m["role"] for m in out] == ["system", "user"] and "# Tools" in out[0]["content"]


def test_a_template_that_knows_tools_gets_them_as_they_are():
    call = {"id": "c7", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    messages = [{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c7", "content": "3"}]
    out, tools = for_template(messages, [ADD], "{% for t in tools %}{{ t }}{% endfor %}")
    assert tools == [ADD] and out[:2] == messages[:2]
    assert out[2] == {**messages[2], "name": "add"}  # templates that label results by function get its name


def test_conversations_without_tools_are_untouched():
    messages = [{"role": "user", "content": "hi"}]
    assert for_template(messages, None, "{{ messages }}") == (messages, None)


def test_rendering_with_smollm2s_template(smol_tokenizer):
    from radixlm.runtime.tokenizer.loader import chat_prompt

    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": '{"temp": -3}'}]
    text = chat_prompt(smol_tokenizer, messages, [WEATHER])
    assert text.index("<tools>") < text.index("Weather in Oslo?") < text.index('"city": "Oslo"') < text.index('{"temp": -3}')
    assert text.endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="with a role"):
        chat_prompt(smol_tokenizer, [{"content": "x"}])


# --------------------------------------------------------- forcing a call


def _matches(schema: str, value) -> bool:
    return re.fullmatch(to_regex(("json_schema", schema)), json.dumps(value)) is not None


def test_the_required_schema_admits_calls_of_the_tools_only():
    schema = tool_calls.required_schema([WEATHER, ADD], parallel=True)
    one = {"name": "add", "arguments": {"a": 1, "b": 2}}
    assert _matches(schema, [one]) and _matches(schema, [one, {"name": "get_weather", "arguments": {"city": "X", "unit": "f"}}])
    assert not _matches(schema, [])
    assert not _matches(schema, [{"name": "sub", "arguments": {"a": 1, "b": 2}}])
    assert not _matches(schema, [{"name": "get_weather", "arguments": {"city": "X", "unit": "kelvin"}}])
    assert not _matches(schema, [{"name": "add", "arguments": {"a": 1}}])
    single = tool_calls.required_schema([ADD], parallel=False)
    assert _matches(single, [one]) and not _matches(single, [one, one])
    content, calls = parse_auto(json.dumps([one, one]), NAMES)  # what `required` writes reads as bare calls
    assert content is None and summary(calls) == [("add", {"a": 1, "b": 2})] * 2
    assert parse_auto('[{"name": "add", "argu', NAMES) == ('[{"name": "add", "argu', [])  # cut by the length limit


def test_the_named_schema_is_the_functions_arguments():
    schema = tool_calls.named_schema(ADD)
    assert _matches(schema, {"a": 1, "b": 2}) and not _matches(schema, {"a": "1", "b": 2})
    no_params = {"type": "function", "function": {"name": "ping"}}
    assert _matches(tool_calls.named_schema(no_params), {})
