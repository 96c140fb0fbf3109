"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the official
`anthropic` client.

Shapes are checked against the SDK's own pydantic models (validated, not just constructed, as the
client does: every streamed event too); contents against the chat endpoint, which the same
conversation greedy must match, and against the schemas that forced calls are held to.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from anthropic.types import ErrorResponse, Message, MessageTokensCount

from helpers import anthropic_event as event
from server.conftest import assert_kv_clean

ADD = {"name": "add", "description": "The sum of two integers",
       "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                        "required": ["a", "b"], "additionalProperties": False}}
WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                            "required": ["city"]}}
SYSTEM = "You are a terse assistant."
# (this SDK's create() no longer takes sampling fields; the API still does, as extra body)
GREEDY = {"temperature": 0}
ASK = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def chat(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _create(client, **kw) -> Message:
    """The SDK's parsed message, its raw JSON validated by the SDK's model first."""
    raw = client.messages.with_raw_response.create(model="default", extra_body=GREEDY, **kw)
    Message.model_validate(raw.http_response.json())
    return raw.parse()


def _chat(chat, messages, **kw):
    return chat.chat.completions.create(model="default", messages=messages, temperature=0, **kw)


def test_a_message_is_chat_greedy_and_counts_the_cache(client, chat, server):
    want = _chat(chat, [{"role": "system", "content": SYSTEM}, *ASK], max_tokens=24)
    m = _create(client, system=SYSTEM, messages=ASK, max_tokens=24)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want.choices[0].message.content
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.stop_reason == ("max_tokens" if want.choices[0].finish_reason == "length" else "end_turn")
    assert m.stop_sequence is None and m.usage.output_tokens == want.usage.completion_tokens
    # Anthropic counts the tokens read from the cache apart: the chat request above ran the same prompt
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == want.usage.prompt_tokens
    assert m.usage.cache_read_input_tokens > 0 and m.usage.cache_creation_input_tokens == 0
    count = client.messages.count_tokens(model="default", system=SYSTEM, messages=ASK)
    MessageTokensCount.model_validate(count.model_dump())
    assert count.input_tokens == want.usage.prompt_tokens
    cut = _create(client, system=SYSTEM, messages=ASK, max_tokens=1)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 1
    # a stop sequence taken from the greedy text itself: the answer ends just before it
    text = m.content[0].text
    word = text.split()[1]
    stopped = _create(client, system=SYSTEM, messages=ASK, max_tokens=24, stop_sequences=["zzz", word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == text[: text.index(word)]
    assert_kv_clean(server.url)


def test_a_streamed_message_is_every_event_in_order(client, server):
    whole = _create(client, system=SYSTEM, messages=ASK, max_tokens=20)
    with httpx.stream("POST", server.url + "/v1/messages", timeout=120, json={
            "model": "default", "system": SYSTEM, "messages": ASK, "max_tokens": 20, "temperature": 0,
            "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    events = [event(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert [e["type"] if isinstance(e, dict) else e.type for e in events] == names  # each event's name is its type
    events = [e for e in events if not isinstance(e, dict)]  # (the ping)
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == whole.content[0].text
    assert events[-2].delta.stop_reason == whole.stop_reason and events[-2].usage.output_tokens == \
        whole.usage.output_tokens
    # the SDK's own stream reader puts the same message together
    with client.messages.stream(model="default", system=SYSTEM, messages=ASK, max_tokens=20,
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert_kv_clean(server.url)


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_use_then_its_result(client, chat, server, stream):
    """tool_choice "tool" forces a call of that tool, held to its schema; the result goes back as a
    tool_result block, and the next turn is the same conversation as chat's with a tool turn."""
    ask = [{"role": "user", "content": "Add 20 and 22."}]
    kw = dict(messages=ask, tools=[WEATHER, ADD], tool_choice={"type": "tool", "name": "add"}, max_tokens=60)
    if stream:
        with client.messages.stream(model="default", extra_body=GREEDY, **kw) as s:
            m = s.get_final_message()
    else:
        m = _create(client, **kw)
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use.name == "add" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, ADD["input_schema"])
    turns = [*ask, {"role": "assistant", "content": m.content},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "42"}]}]
    after = _create(client, messages=turns, tools=[WEATHER, ADD], tool_choice={"type": "none"}, max_tokens=16)
    want = _chat(chat, [*ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": "add", "arguments": json.dumps(use.input)}}]}, {"role": "tool", "tool_call_id": use.id, "content": "42"}],
        tools=[{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                 "parameters": t["input_schema"]}} for t in (WEATHER, ADD)],
        tool_choice="none", max_tokens=16)
    assert after.content[0].text == want.choices[0].message.content
    assert after.usage.input_tokens + after.usage.cache_read_input_tokens == want.usage.prompt_tokens
    assert_kv_clean(server.url)


def _message(client, stream: bool, **kw) -> Message:
    if not stream:
        return _create(client, **kw)
    with client.messages.stream(model="default", extra_body=GREEDY, **kw) as s:
        return s.get_final_message()


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_short_ends_with_max_tokens_or_the_stop_sequence(client, server, stream):
    """Seen live: max_tokens 3 on a forced tool was a 500 (json.loads of the arguments it cut). As
    Anthropic's API answers: the tool_use cut short (its input {} whole; the client's stream reader
    parses what it was sent) and why it stopped."""
    ask = dict(messages=[{"role": "user", "content": "Add 20 and 22."}], tools=[ADD],
               tool_choice={"type": "tool", "name": "add"})
    cuts = ((dict(max_tokens=3), "max_tokens"), (dict(max_tokens=60, stop_sequences=[":"]), "stop_sequence"))
    for cut, reason in cuts:
        m = _message(client, stream, **ask, **cut)  # (the arguments' first key ends at its ":")
        (use,) = [b for b in m.content if b.type == "tool_use"]
        assert (m.stop_reason, use.name) == (reason, "add"), m
        assert m.stop_sequence == cut.get("stop_sequences", [None])[0]
        if not stream:
            assert use.input == {}
    assert_kv_clean(server.url)


def test_a_trailing_assistant_message_is_continued(client, chat, server):
    """A prefill, as the Messages API documents it: the reply continues the assistant's text in its
    open turn (a new turn was opened after it): chat's continue_final_message, token for token."""
    prefilled = [*ASK, {"role": "assistant", "content": "The three colors are"}]
    m = _create(client, messages=prefilled, max_tokens=6)
    want = _chat(chat, prefilled, max_tokens=6, extra_body={"continue_final_message": True})
    assert m.content[0].text == want.choices[0].message.content
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == want.usage.prompt_tokens
    closed = _chat(chat, prefilled, max_tokens=1)  # the same turns with the assistant's closed
    assert closed.usage.prompt_tokens > want.usage.prompt_tokens
    assert client.messages.count_tokens(model="default", messages=prefilled).input_tokens == want.usage.prompt_tokens
    assert_kv_clean(server.url)


def test_text_documents_and_search_results_are_read_as_their_text(client, chat, server):
    """In a user turn and in a tool's result, as the Messages API documents them: a text document
    (title, context, text; or its content blocks) and a search result (title, source, text) are the
    same prompt as chat given that text, token for token."""
    doc = {"type": "document", "title": "Colors", "context": "A note", "source": {
        "type": "text", "media_type": "text/plain", "data": "Red is warm. Blue is cool."}}
    found = {"type": "search_result", "source": "https://example.com/green", "title": "Green",
             "content": [{"type": "text", "text": "Green is the color of grass."}]}
    parts = {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "Yellow."}]}}
    turns = [{"role": "user", "content": [doc, found, parts, {"type": "text", "text": "Which is warm?"}]}]
    m = _create(client, messages=turns, max_tokens=8)
    text = ("Colors\nA note\nRed is warm. Blue is cool.\nGreen (https://example.com/green)\n"
            "Green is the color of grass.\nYellow.\nWhich is warm?")
    want = _chat(chat, [{"role": "user", "content": text}], max_tokens=8)
    assert m.content[0].text == want.choices[0].message.content
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == want.usage.prompt_tokens
    use = {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1, "b": 2}}
    turns = [*ASK, {"role": "assistant", "content": [use]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [found, doc]}]}]
    m = _create(client, messages=turns, tools=[ADD], max_tokens=8)
    want = _chat(chat, [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "toolu_1", "type": "function", "function": {"name": "add", "arguments": json.dumps(use["input"])}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Green (https://example.com/green)\nGreen is the color "
         "of grass.\nColors\nA note\nRed is warm. Blue is cool."}],
        tools=[{"type": "function", "function": {"name": "add", "description": ADD["description"],
                                                 "parameters": ADD["input_schema"]}}], max_tokens=8)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == want.usage.prompt_tokens
    assert_kv_clean(server.url)


def test_a_system_turn_among_the_messages_stays_where_it_stands(client, chat, server):
    """Claude Code sends one (it was a 400); SmolLM2's template takes it in place."""
    turns = [*ASK, {"role": "assistant", "content": "Red, green, blue."},
             {"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Again."}]
    m = _create(client, system=SYSTEM, messages=turns, max_tokens=6)
    want = _chat(chat, [{"role": "system", "content": SYSTEM}, *turns], max_tokens=6)
    assert m.content[0].text == want.choices[0].message.content
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == want.usage.prompt_tokens
    assert_kv_clean(server.url)


def test_tool_choice_any_calls_one_of_the_tools(client):
    m = _create(client, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                tools=[WEATHER, ADD], tool_choice={"type": "any", "disable_parallel_tool_use": True}, max_tokens=60)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name in ("get_weather", "add")
    jsonschema.validate(uses[0].input, {"get_weather": WEATHER, "add": ADD}[uses[0].name]["input_schema"])


@pytest.mark.parametrize("body,status,says", [
    ({"messages": ASK}, 400, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, 400, "image"),
    ({"max_tokens": 5, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "server tools"),
    ({"max_tokens": 5, "messages": ASK, "tool_choice": {"type": "any"}}, 400, "needs tools"),
    ({"max_tokens": 5, "messages": ASK, "temperature": 1.5}, 400, "temperature"),
    ({"max_tokens": 5, "messages": ASK, "frequency": 1}, 400, "frequency"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                                  "content": [{"type": "image", "source": {}}]}]}]},
     400, "a tool_result's content has blocks of type image, which are not supported: the served model reads text"),
    ({"max_tokens": 5, "messages": ASK, "tools": [{"name": "t" * 65, "input_schema": {"type": "object"}}]}, 400,
     f"the tool name '{'t' * 65}' (65 characters) is not allowed"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document", "source": {
        "type": "base64", "media_type": "application/pdf", "data": "AA=="}}]}]}, 400,
     "a document's source of type 'base64' is not supported: the served model reads text only"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                                  "content": [{"type": "document", "source": {
                                                                      "type": "url", "url": "https://x.org/a.pdf"}}]}]}]},
     400, "a document's source of type 'url' is not supported"),
    ({"max_tokens": 5, "messages": [*ASK, {"role": "assistant", "content": "The three colors are "}]}, 400,
     "final assistant content cannot end with trailing whitespace"),  # (Anthropic's own words)
    ({"max_tokens": 5, "messages": [*ASK, {"role": "assistant", "content": [{"type": "text", "text": "Red\n"}]}]}, 400,
     "final assistant content cannot end with trailing whitespace"),
])
def test_bad_requests_get_anthropics_error_shape(server, body, status, says):
    r = httpx.post(server.url + "/v1/messages", json={"model": "default", **body}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()
    ErrorResponse.model_validate(err)
    assert err["error"]["type"] == "invalid_request_error" and says in err["error"]["message"]


def test_the_sdk_raises_its_own_errors(client, server):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="default", max_tokens=20000, messages=ASK)  # (past SmolLM2's 8k context)
    assert e.value.body["error"]["type"] == "invalid_request_error" and "does not fit" in e.value.body["error"]["message"]
    r = httpx.post(server.url + "/v1/messages/batches", json={}, timeout=30)
    assert r.status_code == 404 and ErrorResponse.model_validate(r.json()).error.type == "not_found_error"
