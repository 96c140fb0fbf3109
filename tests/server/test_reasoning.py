"""`--reasoning-parser qwen3` on a tiny random Qwen3 with Qwen3's real chat template, through the
official `openai` client and the native API.

A random model writes noise, so the reasoning's end is made likely with a `logit_bias` on
`</think>`, and each test first checks, on the raw output (`separate_reasoning: false`), that its
seed gave one end tag with text on both sides. The expected split is the raw text cut at that
tag (Qwen3 with thinking on: the output begins inside the block). `--deterministic` makes a
seeded request give the same tokens whatever the prefix cache holds.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from server.conftest import LiveServer, assert_kv_clean
from tiny_qwen3 import make_tokenizer

END = "</think>"
END_ID = "401"  # </think> in tiny_qwen3's tokenizer
QUESTION = [{"role": "user", "content": "What is the answer?"}]
SAMPLING = dict(seed=2, temperature=1, logit_bias={END_ID: 3})
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def srv(tiny_qwen3):
    assert str(make_tokenizer().convert_tokens_to_ids(END)) == END_ID
    s = LiveServer("--model-path", tiny_qwen3, "--reasoning-parser", "qwen3", "--deterministic", "--constraint-timeout", "20")
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def chat(client, **kw):
    kw = {"model": "default", "messages": QUESTION, "max_tokens": 40, **SAMPLING, **kw}
    return client.chat.completions.create(**kw)


def raw_text(client, **kw) -> str:
    extra = {"separate_reasoning": False, **kw.pop("extra_body", {})}
    message = chat(client, extra_body=extra, **kw).choices[0].message
    assert getattr(message, "reasoning_content", None) is None
    return message.content


def cut(raw: str) -> tuple[str, str]:
    assert raw.count(END) == 1, f"the seed no longer gives one end tag: {raw!r}"
    reasoning, _, content = raw.partition(END)
    assert reasoning and content, f"the seed no longer gives text on both sides: {raw!r}"
    return reasoning, content


def streamed(client, **kw) -> tuple[list[str], list[str]]:
    reasoning, content = [], []
    for chunk in chat(client, stream=True, **kw):
        for choice in chunk.choices:
            if getattr(choice.delta, "reasoning_content", None):
                reasoning.append(choice.delta.reasoning_content)
            if choice.delta.content:
                content.append(choice.delta.content)
    return reasoning, content


def test_reasoning_content_whole_and_streamed(srv, client):
    reasoning, content = cut(raw_text(client))
    message = chat(client).choices[0].message
    assert (message.reasoning_content, message.content) == (reasoning, content)
    thoughts, answer = streamed(client)
    assert ("".join(thoughts), "".join(answer)) == (reasoning, content)
    assert len(thoughts) > 1, "reasoning streams as it comes"
    thoughts, answer = streamed(client, extra_body={"stream_reasoning": False})
    assert thoughts == [reasoning] and "".join(answer) == content, "stream_reasoning=false: one delta"
    assert_kv_clean(srv.url)


def test_enable_thinking_false_closes_the_block_in_the_prompt(srv, client):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    closed = chat(client, extra_body=off)
    opened = chat(client)
    assert closed.usage.prompt_tokens - opened.usage.prompt_tokens == len(
        make_tokenizer().encode("<think>\n\n</think>\n\n")), "Qwen3's template got enable_thinking"
    raw = raw_text(client, extra_body=off)
    assert END in raw, "the seed no longer gives an end tag"
    message = closed.choices[0].message
    assert message.reasoning_content is None and message.content == raw, "with thinking off all of it is content"
    assert_kv_clean(srv.url)


def test_json_schema_holds_only_after_the_reasoning(srv, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    response = chat(client, response_format=fmt, max_tokens=80)
    message, finish = response.choices[0].message, response.choices[0].finish_reason
    assert finish == "stop", message
    assert message.reasoning_content and not message.reasoning_content.lstrip().startswith("{"), \
        "the reasoning is free text: no constraint held there"
    jsonschema.validate(json.loads(message.content), SCHEMA)
    thoughts, answer = streamed(client, response_format=fmt, max_tokens=80)
    assert ("".join(thoughts), "".join(answer)) == (message.reasoning_content, message.content)
    assert_kv_clean(srv.url)


def test_a_forced_tool_call_follows_the_reasoning(srv, client):
    tool = {"type": "function", "function": {"name": "answer", "parameters": SCHEMA}}
    response = chat(client, tools=[tool], tool_choice={"type": "function", "function": {"name": "answer"}},
                    max_tokens=80)
    message = response.choices[0].message
    assert message.reasoning_content, "the seed no longer reasons before the call"
    (call,) = message.tool_calls
    assert call.function.name == "answer"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    assert_kv_clean(srv.url)


def test_messages_think_only_when_asked(srv, client):
    """Anthropic's default is no thinking (the Messages API thought unless told not to): Qwen3's
    template closes an empty block in the prompt unless thinking is enabled."""
    messages = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0).messages
    ask = dict(model="default", messages=QUESTION, max_tokens=8, extra_body={"temperature": 0})
    off, on = messages.create(**ask), messages.create(**ask, thinking={"type": "enabled", "budget_tokens": 1024})
    plain = chat(client, temperature=0, seed=None, logit_bias=None, max_tokens=8,
                 extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    thinking = chat(client, temperature=0, seed=None, logit_bias=None, max_tokens=8)
    assert off.usage.input_tokens + off.usage.cache_read_input_tokens == plain.usage.prompt_tokens
    assert on.usage.input_tokens + on.usage.cache_read_input_tokens == thinking.usage.prompt_tokens
    assert plain.usage.prompt_tokens > thinking.usage.prompt_tokens  # (the closed block)
    assert [b.type for b in on.content][:1] == ["thinking"] and "thinking" not in [b.type for b in off.content]
    assert_kv_clean(srv.url)


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_the_budget_never_reached_is_no_call_in_the_responses_api(srv, client, stream):
    """The budget spent in the reasoning: chat's answer keeps its forced call, with no arguments;
    the Responses API emits no such call (it did, streamed and not) and is incomplete."""
    # (strict said, as the Responses API assumes it otherwise: the template shows the same tool)
    tool = {"type": "function", "function": {"name": "answer", "parameters": SCHEMA, "strict": False}}
    seeded = dict(temperature=1, max_tokens=4)
    told = chat(client, tools=[tool], tool_choice={"type": "function", "function": {"name": "answer"}},
                logit_bias=None, **seeded).choices[0]
    assert told.finish_reason == "length" and told.message.reasoning_content, "the seed no longer reasons for 4 tokens"
    assert told.message.tool_calls[0].function.arguments == ""
    ask = dict(model="default", input=QUESTION, tools=[{"type": "function", **tool["function"]}],
               tool_choice={"type": "function", "name": "answer"}, temperature=1, max_output_tokens=4,
               extra_body={"seed": SAMPLING["seed"]})
    if stream:
        events = list(client.responses.create(stream=True, **ask))
        assert "function_call" not in [e.item.type for e in events if e.type == "response.output_item.added"]
        response = events[-1].response
        assert events[-1].type == "response.incomplete"
    else:
        response = client.responses.create(**ask)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert [i.type for i in response.output] == ["reasoning"]
    assert response.output[0].content[0].text == told.message.reasoning_content
    assert_kv_clean(srv.url)


def test_native_generate_and_separate_reasoning(srv):
    params = {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 80, "seed": 2, "temperature": 1,
              "logit_bias": {END_ID: 3}}
    body = {"messages": QUESTION, "require_reasoning": True, "sampling_params": params}
    text = httpx.post(srv.url + "/generate", json=body, timeout=120).json()["text"]
    reasoning, content = cut(text)
    jsonschema.validate(json.loads(content), SCHEMA)
    free = httpx.post(srv.url + "/generate", json={**body, "require_reasoning": False}, timeout=120).json()["text"]
    jsonschema.validate(json.loads(free), SCHEMA)  # without it, the constraint holds from the first token
    split = httpx.post(srv.url + "/separate_reasoning", json={"text": text, "reasoning_parser": "deepseek-r1"}).json()
    assert split == {"reasoning_text": reasoning, "text": content}
    split = httpx.post(srv.url + "/separate_reasoning", json={"text": "<think>a</think>b"}).json()  # the server's qwen3
    assert split == {"reasoning_text": "a", "text": "b"}
    bad = httpx.post(srv.url + "/separate_reasoning", json={"text": "x", "reasoning_parser": "nope"})
    assert bad.status_code == 400 and "qwen3" in bad.json()["error"]["message"]
    assert_kv_clean(srv.url)


def test_chat_template_kwargs_may_not_override_the_server(client):
    with pytest.raises(openai.BadRequestError, match="tokenize"):
        chat(client, extra_body={"chat_template_kwargs": {"tokenize": True}})
