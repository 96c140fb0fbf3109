"""Tool calling through the official `openai` client, on SmolLM2 (whose template knows no tools)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from server.conftest import assert_kv_clean

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "The sum of two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]
GREEDY = {"model": "default", "temperature": 0, "max_tokens": 60}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _streamed(client, **kw):
    """(content, calls by index, finish reason) of a streamed chat, put together as a client would."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            got = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
            got["id"] = got["id"] or call.id
            got["name"] += call.function.name or ""
            got["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


def test_required_calls_match_the_tools_schemas_streamed_or_not(client, server):
    kw = dict(messages=ASK, tools=[WEATHER, ADD], tool_choice="required", **GREEDY)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls, choice.message
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    content, calls, finish = _streamed(client, **kw)
    assert (content, finish) == ("", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())
    cut = client.chat.completions.create(**{**kw, "max_tokens": 6}).choices[0]  # no room for a whole call
    assert cut.finish_reason == "length" and cut.message.tool_calls is None and cut.message.content.startswith("[")
    assert_kv_clean(server.url)


def test_a_call_forced_by_name_streams_its_arguments(client):
    kw = dict(messages=[{"role": "user", "content": "Add 20 and 22."}], tools=[WEATHER, ADD],
              tool_choice={"type": "function", "function": {"name": "add"}}, **GREEDY)
    r = client.chat.completions.create(**kw)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), ADD["function"]["parameters"])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content is None
    content, calls, finish = _streamed(client, **kw)
    assert content == "" and finish == "stop"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("add", call.function.arguments)]


def test_one_call_only_without_parallel_calls(client):
    r = client.chat.completions.create(messages=[{"role": "user", "content": "Weather in Paris, Oslo and Rome?"}],
                                       tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, **GREEDY)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_a_tool_result_goes_back_into_the_conversation(client, server):
    first = client.chat.completions.create(messages=ASK, tools=[WEATHER], tool_choice="required", **GREEDY)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    second = client.chat.completions.create(messages=history, tools=[WEATHER], **GREEDY)
    # the conversation so far is the cached prefix of the next turn's prompt
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    # the same conversation through the native API, with the tools: the same prompt
    native = httpx.post(server.url + "/generate", json={
        "messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
            history[-1]],
        "tools": [WEATHER], "sampling_params": {"max_new_tokens": 1}}, timeout=60).json()
    assert native["meta_info"]["prompt_tokens"] == second.usage.prompt_tokens
    # the model answers from the result, in words, and ends
    answer = second.choices[0]
    assert answer.finish_reason == "stop" and answer.message.tool_calls is None, answer
    assert "21" in answer.message.content and second.usage.completion_tokens < GREEDY["max_tokens"]
    assert_kv_clean(server.url)


def _assert_answered_in_words(choice, usage) -> None:
    """SmolLM2 answers ASK in words and runs out of tokens doing so: content only, cut at the limit."""
    message = choice.message
    assert message.tool_calls is None and message.content and "<tool_call>" not in message.content, message
    assert choice.finish_reason == "length" and usage.completion_tokens == GREEDY["max_tokens"]


def test_auto_and_none_answer_in_text_or_calls(client):
    none = client.chat.completions.create(messages=ASK, tools=[WEATHER], tool_choice="none", **GREEDY)
    _assert_answered_in_words(none.choices[0], none.usage)
    auto = client.chat.completions.create(messages=ASK, tools=[WEATHER], tool_choice="auto", **GREEDY)
    assert auto.choices[0] == none.choices[0]  # the model chose words, and auto passes them on as they are
    without_tools = client.chat.completions.create(messages=ASK, **GREEDY)
    assert auto.usage.prompt_tokens > without_tools.usage.prompt_tokens  # the tools are in the prompt


def test_strict_tools_under_auto_and_structural_tags_natively(client, server):
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    r = client.chat.completions.create(messages=ASK, tools=[strict, ADD], tool_choice="auto", **GREEDY)
    _assert_answered_in_words(r.choices[0], r.usage)  # the tag binds only once a <tool_call> opens
    tag = {"triggers": ["<tool_call>"], "structures": [
        {"begin": "<tool_call>\n", "schema": ADD["function"]["parameters"], "end": "\n</tool_call>"}]}
    native = httpx.post(server.url + "/generate", json={"text": "Add 2 and 3. <tool_call>\n{\"a\": 2, \"b\": 3}\n</tool_call>\n"
                                                                "Add 4 and 5.", "sampling_params": {
        "structural_tag": tag, "max_new_tokens": 24, "temperature": 0}}, timeout=120)
    assert native.status_code == 200, native.text
    # the model follows the example with a call, which the tag holds to ADD's schema
    call = re.fullmatch(r" ?<tool_call>\n(.*?)\n</tool_call>(.*)", native.json()["text"], re.S)
    assert call, native.json()["text"]
    jsonschema.validate(json.loads(call[1]), ADD["function"]["parameters"])
    assert_kv_clean(server.url)
