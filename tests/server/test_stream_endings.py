"""How streams end, on the app alone (a stand-in client plays the runtime): a failure after the
first event ends every streaming endpoint with its protocol's own error event, and a Responses
stream with reasoning and a forced (named) tool opens the call only once its arguments begin."""

from __future__ import annotations

import json

import orjson
import pytest
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from server.stand_in import StandInClient, app

EVENT = TypeAdapter(ResponseStreamEvent)
ADD = {"type": "function", "name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}


def events(raw: str) -> list[dict]:
    return [orjson.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


STREAMS = {
    "/generate": {"text": "hi", "stream": True},
    "/v1/completions": {"model": "smol", "prompt": "hi", "stream": True},
    "/v1/chat/completions": {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "stream": True},
}


@pytest.mark.parametrize("path", list(STREAMS))
def test_a_defect_mid_stream_ends_the_stream_with_an_error_event(path, caplog):
    """An exception that is not a refusal (a defect of ours) after the first chunk: the stream still
    ends with the error object and [DONE] (it ended silently, as if complete), and the log holds
    the traceback under the id the client is told."""
    r = app(StandInClient(["Hel", "lo"], then=TypeError("a defect"))).post(path, json=STREAMS[path])
    assert r.status_code == 200
    assert r.text.rstrip().endswith("data: [DONE]")
    *chunks, last = events(r.text)
    assert chunks, "the chunks before the failure were sent"
    assert last["error"]["code"] == 500 and "internal server error (error id " in last["error"]["message"]
    error_id = last["error"]["message"].split("error id ")[1].rstrip(")")
    assert any(error_id in rec.getMessage() and rec.exc_info for rec in caplog.records)


def test_a_defect_mid_stream_ends_a_response_stream_with_response_failed():
    body = {"model": "smol", "input": "hi", "stream": True}
    r = app(StandInClient(["Hel", "lo"], then=TypeError("a defect"))).post("/v1/responses", json=body)
    assert r.status_code == 200
    parsed = events(r.text)
    for data in parsed:
        EVENT.validate_python(data)
    assert parsed[-1]["type"] == "response.failed"
    assert "internal server error" in parsed[-1]["response"]["error"]["message"]
    assert [d["delta"] for d in parsed if d["type"] == "response.output_text.delta"] == ["Hel", "lo"]


def test_a_forced_call_opens_after_the_reasoning_when_its_arguments_begin():
    """--reasoning-parser with tool_choice naming a function, streamed: the reasoning item first and
    whole, then one function_call item holding all of the arguments (the call was opened on the
    first chunk, amid the reasoning, and the arguments then broke the stream with a TypeError)."""
    pieces = ["<think>Add", " them.", "</think>", '{"a": 1', ', "b": 2}']
    body = {"model": "smol", "input": "1+2?", "stream": True, "tools": [ADD],
            "tool_choice": {"type": "function", "name": "add"}}
    r = app(StandInClient(pieces), reasoning_parser="qwen3").post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    parsed = events(r.text)
    state = ResponseStreamState(input_tools=[ADD], text_format=None)
    for data in parsed:
        state.handle_event(EVENT.validate_python(data))
    assert parsed[-1]["type"] == "response.completed", parsed[-1]
    output = state._completed_response.output
    assert [item.type for item in output] == ["reasoning", "function_call"]
    assert output[0].content[0].text == "Add them."
    assert output[1].name == "add" and json.loads(output[1].arguments) == {"a": 1, "b": 2}
    added = [d["item"]["type"] for d in parsed if d["type"] == "response.output_item.added"]
    assert added == ["reasoning", "function_call"]


def test_a_forced_call_with_no_arguments_written_is_still_one_call():
    body = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "tools": [{"type": "function", "function": {k: v for k, v in ADD.items() if k != "type"}}],
            "tool_choice": {"type": "function", "function": {"name": "add"}}}
    r = app(StandInClient(["<think>no", " arguments", "</think>"]), reasoning_parser="qwen3").post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    chunks = events(r.text)
    calls = [c for ch in chunks for d in [ch["choices"][0]["delta"]] for c in d.get("tool_calls") or ()]
    assert [c["function"]["name"] for c in calls] == ["add"] and calls[0]["function"]["arguments"] == ""
    reasoning_at = max(i for i, ch in enumerate(chunks) if ch["choices"][0]["delta"].get("reasoning_content"))
    call_at = next(i for i, ch in enumerate(chunks) if ch["choices"][0]["delta"].get("tool_calls"))
    assert reasoning_at < call_at
