"""The OpenAI Responses API (/v1/responses, stateless) through the official `openai` client.

Shapes are checked against the SDK's own pydantic models (validated, not just constructed, as the
client does); contents against the chat endpoint, which the same prompt greedy must match, and
against the JSON schemas the output is held to.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import orjson
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from radixlm.runtime.server import responses_protocol as rp
from server.conftest import assert_kv_clean

ADD = {"type": "function", "name": "add", "description": "The sum of two integers",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "required": ["a", "b"], "additionalProperties": False}}
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"]}}
GREEDY = {"model": "default", "temperature": 0}
EVENT = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _create(client, **kw) -> tuple[Response, dict]:
    """The SDK's parsed response, and the raw JSON validated by its model (the client itself only
    constructs it, unchecked)."""
    raw = client.responses.with_raw_response.create(**kw)
    body = raw.http_response.json()
    Response.model_validate(body)
    return raw.parse(), body


def _chat_text(client, messages, **kw) -> tuple[str, object]:
    r = client.chat.completions.create(messages=messages, **GREEDY, **kw)
    return r.choices[0].message.content, r.usage


def test_text_input_with_instructions_is_chat_greedy(client, server):
    kw = dict(instructions="You are a terse assistant.", max_output_tokens=24, metadata={"run": "t1"}, store=True)
    r, body = _create(client, input="Name three colors.", **GREEDY, **kw)
    text, usage = _chat_text(client, [{"role": "system", "content": "You are a terse assistant."},
                                      {"role": "user", "content": "Name three colors."}], max_tokens=24)
    assert r.output_text == text and text
    assert r.id.startswith("resp_") and r.object == "response" and r.model.endswith(".gguf")
    assert r.status == "completed" and r.incomplete_details is None and r.error is None
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.id.startswith("msg_") and [c.type for c in item.content] == ["output_text"]
    assert r.usage.input_tokens == usage.prompt_tokens and r.usage.output_tokens == usage.completion_tokens
    assert r.usage.total_tokens == usage.total_tokens
    assert r.metadata == {"run": "t1"} and r.instructions == "You are a terse assistant."
    assert r.max_output_tokens == 24 and r.temperature == 0 and r.text.format.type == "text"
    assert r.tool_choice == "auto" and r.tools == [] and r.parallel_tool_calls is True
    assert body["store"] is False  # stateless: accepted, and nothing was stored
    # the same prompt again: all of it but the last token comes from the prefix cache
    page = httpx.get(server.url + "/get_server_info", timeout=30).json()["page_size"]
    again, _ = _create(client, input="Name three colors.", **GREEDY, **{**kw, "max_output_tokens": 1})
    assert again.usage.input_tokens_details.cached_tokens == (r.usage.input_tokens - 1) // page * page


def test_items_input_is_the_same_conversation_as_chat(client):
    items = [
        {"role": "developer", "content": "Answer in one short sentence."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi! I am Ada."},
                                                        {"type": "input_text", "text": "Remember my name."}]},
        {"type": "message", "role": "assistant", "id": "msg_earlier", "status": "completed",
         "content": [{"type": "output_text", "text": "Nice to meet you, Ada.", "annotations": []}]},
        {"role": "user", "content": "What is my name?"},
        {"type": "reasoning", "id": "rs_x", "summary": []},  # an earlier turn's reasoning: dropped
    ]
    r, _ = _create(client, input=items, max_output_tokens=20, **GREEDY)
    text, usage = _chat_text(client, [
        {"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": "Hi! I am Ada.\nRemember my name."},
        {"role": "assistant", "content": "Nice to meet you, Ada."},
        {"role": "user", "content": "What is my name?"}], max_tokens=20)
    assert r.output_text == text and r.usage.input_tokens == usage.prompt_tokens


def test_a_forced_call_then_its_output_in_a_second_turn(client, server):
    ask = [{"role": "user", "content": "Add 20 and 22."}]
    r, _ = _create(client, input=ask, tools=[WEATHER, ADD], tool_choice={"type": "function", "name": "add"},
                   max_output_tokens=40, **GREEDY)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "add" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), ADD["parameters"])
    assert r.tool_choice.name == "add" and [t.name for t in r.tools] == ["get_weather", "add"]
    assert all(t.strict for t in r.tools)  # the Responses API's default
    # a stateless tool loop: the call goes back with its output, and the model answers from it
    second = ask + [call.model_dump(exclude_none=True),
                    {"type": "function_call_output", "call_id": call.call_id, "output": "42"}]
    again, _ = _create(client, input=second, tools=[WEATHER, ADD], tool_choice="none", max_output_tokens=20, **GREEDY)
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in (WEATHER, ADD)]
    text, _ = _chat_text(client, ask + [
        {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function",
                                              "function": {"name": "add", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "42"}], tools=chat_tools, tool_choice="none",
        max_tokens=20)
    assert again.output_text == text and text
    assert again.output[0].type == "message"
    assert_kv_clean(server.url)


def test_required_calls_match_their_schemas(client):
    r, _ = _create(client, input="What is the weather like in Paris?", tools=[WEATHER, ADD], tool_choice="required",
                   max_output_tokens=60, **GREEDY)
    assert r.output and all(item.type == "function_call" for item in r.output)
    schemas = {t["name"]: t["parameters"] for t in (WEATHER, ADD)}
    for item in r.output:
        jsonschema.validate(json.loads(item.arguments), schemas[item.name])


def test_json_schema_format(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
    r, _ = _create(client, input="Invent a person.", text={"format": fmt}, max_output_tokens=60, **GREEDY)
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema" and r.text.format.name == "person" and r.text.format.schema_ == schema
    obj, _ = _create(client, input="Reply with a JSON object with keys city and country for Paris.",
                     text={"format": {"type": "json_object"}}, max_output_tokens=120, **GREEDY)
    assert obj.status == "completed" and isinstance(json.loads(obj.output_text), dict)


def test_max_output_tokens_leaves_it_incomplete(client):
    r, _ = _create(client, input="Write a long story about a dragon.", max_output_tokens=3, **GREEDY)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[-1].status == "incomplete" and r.output_text


def _raw_events(server, body: dict) -> list[dict]:
    """The SSE events of a streamed request, each validated by the SDK's event models; the
    `event:` line must name the data's type."""
    events = []
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = orjson.loads(line[len("data: "):])
                assert data["type"] == name
                EVENT.validate_python(data)
                events.append(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_stream_text_events_in_order(client, server):
    body = {"input": "Count from one to five.", "max_output_tokens": 60, **GREEDY}
    whole, _ = _create(client, **body)
    events = _raw_events(server, body)
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 1 and kinds == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == events[-4]["text"] == whole.output_text
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == text and final.usage.output_tokens == whole.usage.output_tokens
    assert final.id == events[0]["response"]["id"] and events[0]["response"]["status"] == "in_progress"
    # the SDK's stream helper puts it together the same way
    with client.responses.stream(**body) as stream:
        got = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        assert got == text == stream.get_final_response().output_text


def test_stream_incomplete_ends_with_response_incomplete(server):
    events = _raw_events(server, {"input": "Write a long story.", "max_output_tokens": 2, **GREEDY})
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2]["item"]["status"] == "incomplete"


@pytest.mark.parametrize("choice", [{"type": "function", "name": "add"}, "required"])
def test_stream_tool_calls(client, server, choice):
    body = {"input": "Add 20 and 22.", "tools": [WEATHER, ADD], "tool_choice": choice, "max_output_tokens": 60,
            **GREEDY}
    whole, _ = _create(client, **body)
    events = _raw_events(server, body)
    kinds = [e["type"] for e in events]
    assert "response.output_text.delta" not in kinds and kinds[-1] == "response.completed"
    calls = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in whole.output]
    for call in calls:
        deltas = "".join(e["delta"] for e in events
                         if e["type"] == "response.function_call_arguments.delta" and e["item_id"] == call["id"])
        (done,) = [e for e in events
                   if e["type"] == "response.function_call_arguments.done" and e["item_id"] == call["id"]]
        assert deltas == done["arguments"] == call["arguments"]
    with client.responses.stream(**body) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert [(c.name, c.arguments) for c in final.output] == [(c.name, c.arguments) for c in whole.output]


def test_a_stream_the_client_drops_is_aborted(server):
    body = {"model": "default", "input": "Write a very long story about the sea.", "stream": True,
            "max_output_tokens": 2000, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=120) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n > 12:
                break
    assert_kv_clean(server.url, wait=30)


BAD = [
    ({"previous_response_id": "resp_1"}, "stateless"),
    ({"conversation": "conv_1"}, "stateless"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "stateless"),
    ({"colour": "blue"}, "colour"),
    ({"max_output_token": 5}, "max_output_token"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input_image"),
    ({"input": [{"type": "function_call_output", "output": "1"}]}, "call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "add", "arguments": "{oops"}]}, "JSON object"),
    ({"input": []}, "input"),
    ({"tools": [{"type": "web_search"}]}, "only function tools"),
    ({"tools": [{"type": "function", "name": "f g"}]}, "tool name 'f g'"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "name": "sub"}}, "not among the tools"),
    ({"tools": [ADD], "tool_choice": {"type": "allowed_tools", "tools": []}}, "allowed_tools"),
    ({"tools": [ADD], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "schema"),
    ({"text": {"verbosity": "high"}}, "verbosity"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"truncation": "auto"}, "truncation"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"max_output_tokens": 10**9}, "does not fit"),
]


@pytest.mark.parametrize("body,fragment", BAD, ids=[f"bad-{i}" for i in range(len(BAD))])
def test_bad_input_is_a_400_that_names_it(server, body, fragment):
    r = httpx.post(server.url + "/v1/responses", json={"model": "default", "input": "hi", **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error", r.text


def test_refusals_through_the_client(client, server):
    with pytest.raises(openai.BadRequestError, match="stateless"):
        client.responses.create(model="default", input="hi", previous_response_id="resp_123")
    # one model is served: as in SGLang, any name means it
    assert client.responses.create(model="gpt-9", input="hi", max_output_tokens=1).model != "gpt-9"
    with pytest.raises(openai.NotFoundError, match="stateless"):
        client.responses.retrieve("resp_123")
    with pytest.raises(openai.BadRequestError, match="stateless"):  # refused before any event is sent
        client.responses.create(model="default", input="hi", stream=True, previous_response_id="resp_123")
    assert_kv_clean(server.url)


# ------------------------------------------------- the event stream alone (no server)


def test_event_stream_of_reasoning_text_and_calls_is_what_the_sdk_accumulates():
    """Reasoning, then text, then two calls, as chat deltas: every event validates, the items open and
    close in order, and the SDK's own stream state puts the final response together from them."""
    from openai.lib.streaming.responses._responses import ResponseStreamState

    req = rp.ResponsesRequest.model_validate({"model": "m", "input": "hi", "tools": [ADD]})
    shell = rp.response_shell(req, "m")
    events = rp.EventStream(shell)
    calls = [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, '}},
             {"index": 1, "id": "call_b", "type": "function",
              "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}]
    raw = events.start() + events.feed([{"reasoning_content": "Think"}, {"reasoning_content": "ing."},
                                        {"content": "Sure"}, {"content": "."}, {"tool_calls": [calls[0]]},
                                        {"tool_calls": [{"index": 0, "function": {"arguments": '"b": 2}'}}]},
                                        {"tool_calls": [calls[1]]}])
    usage = {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14,
             "prompt_tokens_details": {"cached_tokens": 0}}
    raw += events.finish("stop", rp.usage(usage))
    parsed = [orjson.loads(block.split(b"\ndata: ", 1)[1]) for block in raw.strip().split(b"\n\n")]
    state = ResponseStreamState(input_tools=[ADD], text_format=openai.omit)
    for data in parsed:
        state.handle_event(EVENT.validate_python(data))
    final = state._completed_response
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call", "function_call"]
    assert final.output[0].content[0].text == "Thinking." and final.output_text == "Sure."
    assert [(c.call_id, json.loads(c.arguments)) for c in final.output[2:]] == [
        ("call_a", {"a": 1, "b": 2}), ("call_b", {"a": 3, "b": 4})]
    assert [d["sequence_number"] for d in parsed] == list(range(len(parsed)))
    added = [d["output_index"] for d in parsed if d["type"] == "response.output_item.added"]
    done = [d["output_index"] for d in parsed if d["type"] == "response.output_item.done"]
    assert added == done == [0, 1, 2, 3]
    assert [d["type"] for d in parsed if "reasoning" in d["type"]] == [
        "response.reasoning_text.delta", "response.reasoning_text.delta", "response.reasoning_text.done"]


def test_reasoning_becomes_a_reasoning_item_whole_or_streamed():
    """Under --reasoning-parser the chat machinery splits the reasoning off (runtime/reasoning.py);
    here it comes out as a reasoning item before the message, the same whole or streamed, however
    the text is cut."""
    from radixlm.runtime.reasoning import reasoning_format
    from radixlm.runtime.server.openai_builders import aggregate_usage, chat_response
    from radixlm.runtime.server.output_readers import ChoiceStream, ReasoningReader

    req = rp.ResponsesRequest.model_validate({"model": "m", "input": "hi"})
    chat = rp.to_chat(req)
    reader = ReasoningReader.of(chat, "qwen3")
    text = "<think>Two and two.</think>It is four."
    meta = {"finish_reason": {"type": "stop"}, "prompt_tokens": 3, "completion_tokens": 9, "cached_tokens": 0}
    whole = chat_response([{"text": text, "meta_info": meta}], "m", "", False, 0, lambda _: "", None, reader)
    items = rp.output_items(whole["choices"][0]["message"], whole["choices"][0]["finish_reason"])
    assert [i["type"] for i in items] == ["reasoning", "message"]
    assert items[0]["content"][0]["text"] == "Two and two." and items[1]["content"][0]["text"] == "It is four."
    assert reasoning_format("qwen3").thinking(chat.chat_template_kwargs)
    off = rp.to_chat(rp.ResponsesRequest.model_validate({"model": "m", "input": "hi", "reasoning": {"effort": "none"}}))
    assert not reasoning_format("qwen3").thinking(off.chat_template_kwargs)

    shell = rp.response_shell(req, "m")
    events, choice = rp.EventStream(shell), ChoiceStream(None, reader)
    cuts = [text[:5], text[5:18], text[18:25], text[25:]]  # the end tag cut across two pieces
    raw = events.start() + b"".join(events.feed(choice.feed(c, i == len(cuts) - 1)) for i, c in enumerate(cuts))
    raw += events.finish("stop", rp.usage(aggregate_usage([{"meta_info": meta}], 1)))
    parsed = [orjson.loads(block.split(b"\ndata: ", 1)[1]) for block in raw.strip().split(b"\n\n")]
    for data in parsed:
        EVENT.validate_python(data)
    final = Response.model_validate(parsed[-1]["response"])
    assert [(i.type, i.content[0].text) for i in final.output] == [
        (i["type"], i["content"][0]["text"]) for i in items]
    assert "".join(d["delta"] for d in parsed if d["type"] == "response.reasoning_text.delta") == "Two and two."
