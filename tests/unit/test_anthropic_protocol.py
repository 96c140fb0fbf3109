"""The Messages API's mapping onto chat and back (runtime/server/anthropic_protocol.py), checked
against the `anthropic` SDK's own models; the live endpoint is tests/server/test_anthropic_api.py."""

from __future__ import annotations

import json

import pytest
from anthropic.types import Message

from helpers import anthropic_event as event
from radixlm.runtime.server import anthropic_protocol as ap
USAGE = {"prompt_tokens": 30, "completion_tokens": 7, "total_tokens": 37, "prompt_tokens_details": {"cached_tokens": 16}}


def _req(**kw) -> ap.MessagesRequest:
    return ap.MessagesRequest.model_validate({"model": "m", "max_tokens": 50, **kw})


def test_a_conversation_becomes_chats_messages():
    req = _req(system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}], messages=[
        {"role": "user", "content": "Add 1 and 2, then tell me."},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Use the tool.", "signature": "s"},
                                          {"type": "text", "text": "Adding."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1, "b": 2}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "3"},
                                     {"type": "text", "text": "And?"}]}],
        tools=[{"name": "add", "input_schema": {"type": "object"}}], tool_choice={"type": "any"},
        stop_sequences=["\n\n"], thinking={"type": "disabled"})
    chat = ap.to_chat(req)
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[0].content == "Be brief.\nBe kind."
    assistant = chat.messages[2]
    assert assistant.content == "Adding." and assistant.reasoning_content == "Use the tool."
    assert json.loads(assistant.tool_calls[0].function.arguments) == {"a": 1, "b": 2}
    assert chat.messages[3].tool_call_id == "toolu_1" and chat.messages[3].content == "3"
    assert chat.tool_choice == "required" and chat.stop == ["\n\n"] and chat.max_completion_tokens == 50
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    named = ap.to_chat(_req(messages=[{"role": "user", "content": "hi"}], tools=[{"name": "add", "input_schema": {}}],
                            tool_choice={"type": "tool", "name": "add", "disable_parallel_tool_use": True}))
    assert named.tool_choice.function.name == "add" and named.parallel_tool_calls is False
    with pytest.raises(ValueError, match="needs tools"):
        ap.to_chat(_req(messages=[{"role": "user", "content": "hi"}], tool_choice={"type": "any"}))


def test_the_answer_is_a_message_of_the_sdk():
    chat = {"choices": [{"finish_reason": "stop", "matched_stop": None, "message": {
        "role": "assistant", "reasoning_content": "Think.", "content": "Here.",
        "tool_calls": [{"id": "call_1", "function": {"name": "add", "arguments": '{"a": 1}'}}]}}], "usage": USAGE}
    m = ap.whole_message(_req(messages=[{"role": "user", "content": "hi"}]), "model", chat)
    Message.model_validate(m)
    assert [b["type"] for b in m["content"]] == ["thinking", "text", "tool_use"]
    assert m["stop_reason"] == "tool_use" and m["content"][2]["input"] == {"a": 1}
    assert m["usage"] == {"input_tokens": 14, "output_tokens": 7, "cache_creation_input_tokens": 0,
                          "cache_read_input_tokens": 16}
    assert ap.stop_reason("stop", "\n\n", ["\n\n"], False) == ("stop_sequence", "\n\n")
    assert ap.stop_reason("stop", 2, ["\n\n"], False) == ("end_turn", None)  # EOS
    assert ap.stop_reason("length", None, None, True) == ("max_tokens", None)


def test_the_event_stream_opens_one_block_at_a_time():
    events = ap.EventStream(_req(messages=[{"role": "user", "content": "hi"}]), "model")
    raw = events.start(30, 16) + events.feed([{"reasoning_content": "Th"}, {"reasoning_content": "ink."},
                                              {"content": "Here"}]) + events.feed([
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "add", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}]) + events.finish("stop", None, USAGE, True)
    lines = [line for line in raw.decode().split("\n") if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    parsed = [event(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert [e["type"] if isinstance(e, dict) else e.type for e in parsed] == names
    parsed = [e for e in parsed if not isinstance(e, dict)]
    assert names == ["message_start", "ping",
                     "content_block_start", "content_block_delta", "content_block_delta", "content_block_delta",
                     "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    starts = [e for e in parsed if e.type == "content_block_start"]
    assert [(e.index, e.content_block.type) for e in starts] == [(0, "thinking"), (1, "text"), (2, "tool_use")]
    assert "".join(e.delta.partial_json for e in parsed if e.type == "content_block_delta"
                   and e.delta.type == "input_json_delta") == '{"a": 1}'
    assert parsed[0].message.usage.cache_read_input_tokens == 16 and parsed[-2].delta.stop_reason == "tool_use"
    failed = event(events.fail("boom", 500).decode().split("data: ")[1].strip())
    assert failed.type == "error" and failed.error.type == "api_error" and failed.error.message == "boom"


def _turns(*messages) -> list[dict]:
    return [m.model_dump(include={"role", "content"}) for m in ap.to_chat(_req(messages=list(messages))).messages]


HI = {"role": "user", "content": "hi"}


def test_thinking_is_off_unless_asked_for():
    """Anthropic's default is no thinking: Qwen3's template is told so unless thinking is enabled
    (or adaptive); it was on unless disabled."""
    off = {"enable_thinking": False}
    assert ap.to_chat(_req(messages=[HI])).chat_template_kwargs == off
    assert ap.to_chat(_req(messages=[HI], thinking={"type": "disabled"})).chat_template_kwargs == off
    for on in ({"type": "enabled", "budget_tokens": 2048}, {"type": "adaptive"}):
        assert ap.to_chat(_req(messages=[HI], thinking=on)).chat_template_kwargs is None


def test_a_trailing_assistant_message_is_continued():
    """A prefill: the reply continues the assistant's text (it opened a new turn after it)."""
    chat = ap.to_chat(_req(messages=[HI, {"role": "assistant", "content": [{"type": "text", "text": "The answer is"}]}]))
    assert chat.continue_final_message and chat.messages[-1].content == "The answer is"
    assert chat.chat_template_kwargs == {"enable_thinking": False}  # what follows is the text's, not reasoning
    assert not ap.to_chat(_req(messages=[HI])).continue_final_message
    # an assistant turn with no text asks for the reply as if it were absent
    assert _turns(HI, {"role": "assistant", "content": ""}) == [HI]
    with pytest.raises(ValueError, match="thinking enabled"):
        ap.to_chat(_req(messages=[HI, {"role": "assistant", "content": "So"}], thinking={"type": "enabled",
                                                                                         "budget_tokens": 1024}))
    with pytest.raises(ValueError, match="tool_use blocks"):
        ap.to_chat(_req(messages=[HI, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {}}]}]))


def test_a_system_turn_among_the_messages_stays_where_it_stands():
    """Claude Code sends them (it was a 400); the template joins them into the first where it must
    (tests/unit/test_peer_parity.py)."""
    system = {"role": "system", "content": [{"type": "text", "text": "Plan mode"}, {"type": "text", "text": "is off."}]}
    assert _turns(HI, system, {"role": "user", "content": "go"}) == [
        HI, {"role": "system", "content": "Plan mode\nis off."}, {"role": "user", "content": "go"}]
    with pytest.raises(ValueError, match="a system turn has blocks of type tool_result"):
        _req(messages=[HI, {"role": "system", "content": [{"type": "tool_result", "tool_use_id": "t"}]}])


def test_an_image_in_a_tool_result_is_refused_for_what_it_is():
    """(It was refused with pydantic's complaint that the content is not a string.)"""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "a chart"}, image]}
    with pytest.raises(ValueError) as caught:
        _req(messages=[{"role": "user", "content": [result]}])
    assert ("a tool_result's content has blocks of type image, which are not supported: the served model reads "
            "text only") in str(caught.value) and "string_type" not in str(caught.value)


@pytest.mark.parametrize("name,ok", [("a" * 64, True), ("a" * 65, False), ("a" * 128, False), ("get weather", False)])
def test_a_tool_name_passes_both_apis_or_neither(name, ok):
    """Anthropic's tool-use guide's ^[a-zA-Z0-9_-]{1,64}$ is OpenAI's: a name of 65-128 characters
    passed the Messages model and then failed the chat request's pattern, by pattern."""
    body = {"messages": [HI], "tools": [{"name": name, "input_schema": {"type": "object"}}]}
    if ok:
        assert ap.to_chat(_req(**body)).tools[0].function.name == name
        return
    with pytest.raises(ValueError, match=f"the tool name '{name}' \\({len(name)} characters\\) is not allowed"):
        _req(**body)


def test_a_tool_use_cut_short_has_an_empty_input_and_a_stop_sequence_wins():
    cut = {"choices": [{"finish_reason": "length", "matched_stop": None, "message": {
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "call_1", "function": {"name": "add", "arguments": '{"a": 1, "b'}}]}}], "usage": USAGE}
    m = ap.whole_message(_req(messages=[HI]), "model", cut)
    Message.model_validate(m)
    assert m["stop_reason"] == "max_tokens" and m["content"][0]["input"] == {}
    assert ap.stop_reason("stop", '"', ['"'], True) == ("stop_sequence", '"')  # it cut a forced call
    assert ap.stop_reason("stop", 2, ['"'], True) == ("tool_use", None)


def test_413_is_request_too_large():
    assert ap.error_body("too big", 413)["error"]["type"] == "request_too_large"
