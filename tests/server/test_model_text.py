"""What the chat, Responses and Messages APIs make of a model's text, on the app alone (a stand-in
client plays the model: server/stand_in.py), read back by the `openai` and `anthropic` clients:
JSON that names no tool is content, however it names one; a forced call cut short by the token
limit or a stop sequence ends the answer as each API says; a forced call whose arguments never
began (the budget spent in the reasoning) is no call in the Responses and Messages APIs."""

from __future__ import annotations

import anthropic
import openai
import pytest

from server.stand_in import StandInClient, app

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
ASK = [{"role": "user", "content": "Add 1 and 2."}]
APIS = ["chat", "responses", "messages"]


def clients(pieces: list[str], finish: dict | None = None, **server_args) -> tuple[openai.OpenAI, anthropic.Anthropic]:
    http = app(StandInClient(pieces, finish), **server_args)
    return (openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0),
            anthropic.Anthropic(base_url="http://testserver", api_key="unused", http_client=http, max_retries=0))


def answer(api: str, stream: bool, pieces: list[str], finish: dict | None = None, forced: bool = False,
           stop: list[str] | None = None, **server_args) -> tuple[str, list[tuple[str, object]], str, str]:
    """(content, calls as (name, arguments), how it ended, reasoning) of one answer, whole or
    streamed, as the API's client reads it; a Messages call's arguments are its parsed input."""
    oa, an = clients(pieces, finish, **server_args)
    if api == "chat":
        return _chat(oa, stream, forced, stop)
    if api == "responses":
        return _responses(oa, stream, forced, stop)
    return _messages(an, stream, forced, stop)


def _chat(oa: openai.OpenAI, stream: bool, forced: bool, stop: list[str] | None):
    kw = dict(model="smol", messages=ASK, tools=[{"type": "function", "function": {"name": "add", "parameters": SCHEMA}}],
              stop=stop, tool_choice={"type": "function", "function": {"name": "add"}} if forced else "auto")
    if not stream:
        choice = oa.chat.completions.create(**kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        return (choice.message.content or "", calls, choice.finish_reason,
                getattr(choice.message, "reasoning_content", None) or "")
    content, reasoning, calls, end = "", "", {}, None
    for chunk in oa.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or ():
            name, args = calls.get(call.index, ("", ""))
            calls[call.index] = (name + (call.function.name or ""), args + (call.function.arguments or ""))
        end = chunk.choices[0].finish_reason or end
    return content, [calls[i] for i in sorted(calls)], end, reasoning


def _responses(oa: openai.OpenAI, stream: bool, forced: bool, stop: list[str] | None):
    kw = dict(model="smol", input=ASK, tools=[{"type": "function", "name": "add", "parameters": SCHEMA, "strict": False}],
              tool_choice={"type": "function", "name": "add"} if forced else "auto", extra_body={"stop": stop})
    if stream:  # (the client's stream helper reads no response.incomplete: its last event has the response)
        *_, last = oa.responses.create(stream=True, **kw)
        assert last.type in ("response.completed", "response.incomplete"), last
        r = last.response
    else:
        r = oa.responses.create(**kw)
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    calls = [(i.name, i.arguments) for i in r.output if i.type == "function_call"]
    reasoning = "".join(c.text for i in r.output if i.type == "reasoning" for c in i.content or ())
    return r.output_text, calls, r.status, reasoning


def _messages(an: anthropic.Anthropic, stream: bool, forced: bool, stop: list[str] | None):
    kw = dict(model="smol", max_tokens=50, messages=ASK, tools=[{"name": "add", "input_schema": SCHEMA}],
              tool_choice={"type": "tool", "name": "add"} if forced else {"type": "auto"},
              thinking={"type": "enabled", "budget_tokens": 1024}, stop_sequences=stop or anthropic.NOT_GIVEN)
    if stream:
        with an.messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        m = an.messages.create(**kw)
    text = "".join(b.text for b in m.content if b.type == "text")
    reasoning = "".join(b.thinking for b in m.content if b.type == "thinking")
    end = m.stop_reason if m.stop_sequence is None else f"{m.stop_reason}:{m.stop_sequence}"
    return text, [(b.name, b.input) for b in m.content if b.type == "tool_use"], end, reasoning


# ------------------------------------------------------------ text that names no tool


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("pieces", [
    ['{"name": {"first": "Ada"}', ', "born": 1815}'],  # an answer in JSON that has a "name" (seen live: a 500)
    ["Sure. <tool_call>", '{"name": ["add"], "arguments": {"a": 1, "b": 2}}', "</tool_call>"],
    ['[{"name": "add", "arguments": {"a": 1, "b": 2}}, ', '{"name": 7, "arguments": {}}]'],
], ids=["object-name", "list-name-tagged", "number-name-array"])
def test_json_that_names_no_tool_is_content(api, stream, pieces):
    content, calls, end, _ = answer(api, stream, pieces)
    assert (content, calls) == ("".join(pieces), [])
    assert end == {"chat": "stop", "responses": "completed", "messages": "end_turn"}[api]


# ------------------------------------------------------------ forced calls cut short

CUT = ['{"a": 1', ', "b']  # the arguments as far as they got


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("cut", ["max_tokens", "stop_sequence"])
def test_a_forced_call_cut_short_ends_the_answer_as_each_api_says(api, stream, cut):
    """The Messages API answers max_tokens (or stop_sequence) with the tool_use cut short, its input
    {} whole (as Anthropic's API does) and what there was streamed (a 500 whole: json.loads of the
    cut arguments); chat and the Responses API keep the cut arguments as text."""
    finish = {"type": "length"} if cut == "max_tokens" else {"type": "stop", "matched": '"'}
    _, calls, end, _ = answer(api, stream, CUT, finish, forced=True, stop=['"'] if cut == "stop_sequence" else None)
    ends = {"chat": ("length", "stop"), "responses": ("incomplete", "completed"),
            "messages": ("max_tokens", 'stop_sequence:"')}[api]
    assert end == ends[cut == "stop_sequence"]
    assert [name for name, _ in calls] == ["add"]
    if api == "messages":  # the client's stream reader reads the partial JSON it was sent
        assert calls[0][1] == ({"a": 1} if stream else {})
    else:
        assert calls[0][1] == "".join(CUT)


# ---------------------------------------------- a forced call whose arguments never began


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("pieces,finish", [
    (["<think>Add", " them"], {"type": "length"}),  # the budget spent in the reasoning
    (["<think>Add", " them</think>", "\n "], {"type": "length"}),  # spent before the arguments began
    (["<think>Add", " them"], {"type": "stop", "matched": 2}),  # the model ended inside its reasoning
], ids=["in-reasoning", "blank-arguments", "eos-in-reasoning"])
def test_a_forced_call_whose_arguments_never_began_is_no_call(api, stream, pieces, finish):
    """--reasoning-parser with a named tool: the Responses and Messages APIs emit no call with empty
    arguments (they did, and the Responses API said completed): the response is incomplete
    (max_output_tokens), the message ends with max_tokens. Chat's shape keeps its forced call."""
    content, calls, end, reasoning = answer(api, stream, pieces, finish, forced=True, reasoning_parser="qwen3")
    assert reasoning == "Add them" and content == ""
    length = finish["type"] == "length"
    if api == "chat":
        assert [name for name, _ in calls] == ["add"] and calls[0][1].strip() == ""
        assert end == ("length" if length else "stop")
        return
    assert calls == []
    assert end == {"responses": ("completed", "incomplete"), "messages": ("end_turn", "max_tokens")}[api][length]
