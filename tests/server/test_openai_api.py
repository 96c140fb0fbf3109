"""The OpenAI API through the official `openai` client, unchanged."""

from __future__ import annotations

import openai
import pytest

from server.conftest import assert_kv_clean


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models(client):
    models = client.models.list().data
    assert len(models) == 1 and models[0].id.endswith(".gguf")


def test_chat_matches_native_greedy(client, server, smol):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model="default", messages=msgs, max_tokens=16, temperature=0)
    local = smol.engine.generate(smol.engine.apply_chat_template(msgs), {"max_new_tokens": 16, "temperature": 0})
    assert r.choices[0].message.content == local["text"]
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens == local["meta_info"]["completion_tokens"]
    assert r.usage.prompt_tokens == local["meta_info"]["prompt_tokens"]
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_completions_batch_n_logprobs(client):
    r = client.completions.create(model="default", prompt=["The capital of France is", "1, 2, 3,"],
                                  max_tokens=5, temperature=0, n=2, logprobs=2)
    assert len(r.choices) == 4 and r.choices[0].text == r.choices[1].text
    lp = r.choices[2].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 5 and all(len(t) <= 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[2].text
    assert r.usage.completion_tokens == 20


def test_chat_stream_with_usage(client):
    msgs = [{"role": "user", "content": "Count from one to five."}]
    whole = client.chat.completions.create(model="default", messages=msgs, max_tokens=20, temperature=0)
    stream = client.chat.completions.create(model="default", messages=msgs, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    parts, usage, finish = [], None, None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        else:
            usage = chunk.usage
    assert "".join(parts) == whole.choices[0].message.content
    assert usage.completion_tokens == whole.usage.completion_tokens and finish == whole.choices[0].finish_reason


def test_completion_stream_and_seeded_sampling(client):
    kw = dict(model="default", prompt="Once upon a time", max_tokens=12, temperature=0.9, seed=7)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    text = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
    assert text == a.choices[0].text


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and len(content[0].top_logprobs) == 3
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob


def test_errors(client, server):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-99", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="default", prompt="x", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="n"):
        client.completions.create(model="default", prompt="x", n=1000)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model="default", prompt="word " * 9000, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="image_url"):
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    assert client.completions.create(model="default", prompt="still alive", max_tokens=1).choices
    assert_kv_clean(server.url)


def test_response_format_json_schema(client):
    import json

    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 30},
                                               "code": {"type": "string", "pattern": "^[A-Z]{2}$"},
                                               "coastal": {"type": "boolean"}},
              "required": ["capital", "code", "coastal"]}
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Give France's capital and population as JSON."}],
        max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "country", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    data = json.loads(r.choices[0].message.content)
    assert isinstance(data["capital"], str) and len(data["code"]) == 2 and isinstance(data["coastal"], bool)
    r = client.completions.create(model="default", prompt="A JSON object describing a cat: ", max_tokens=60,
                                  temperature=0, extra_body={"regex": r"\{\"name\": \"[A-Za-z]{1,12}\"\}"})
    assert json.loads(r.choices[0].text)["name"].isalpha()


@pytest.mark.parametrize("top", [0, 2])
def test_echo_scores_every_prompt_token(client, top):
    """`echo` + `logprobs` with max_tokens=0 scores the prompt itself (how a client scores given text)."""
    prompt = "Is the sky blue? Answer: yes"
    r = client.completions.create(model="default", prompt=prompt, max_tokens=0, echo=True, logprobs=top)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == prompt and "".join(lp.tokens) == prompt
    assert lp.token_logprobs[0] is None and all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(lp.top_logprobs) > 5
    assert all(len(t) == min(top, 1) or len(t) >= top for t in lp.top_logprobs[1:])
