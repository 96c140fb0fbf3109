"""The OpenAI API through the official `openai` client, unchanged."""

from __future__ import annotations


import httpx
import openai
import pytest

from helpers import common_prefix
from oracle import LOGPROB_TOL, hf_greedy, hf_logprobs
from server.conftest import assert_kv_clean


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models(client):
    models = client.models.list().data
    assert len(models) == 1 and models[0].id.endswith(".gguf")


def test_chat_matches_native_greedy_and_counts_cached_tokens(client, server, smol):
    """The prefix cache reports what it holds: a fresh conversation reuses exactly its longest prefix
    shared with earlier prompts, the same conversation again everything but the last prompt token."""
    tok = smol.engine.tokenizer
    page = httpx.get(server.url + "/get_server_info", timeout=30).json()["page_size"]

    def chat(nonce):  # a nonce no earlier prompt holds, so nothing else in the cache shares more
        return [{"role": "system", "content": f"Session {nonce}."},
                {"role": "user", "content": "What is the capital of France?"}]

    def prompt_ids(msgs):
        return tok.encode(smol.engine.apply_chat_template(msgs), add_special_tokens=False)

    earlier, msgs = chat("cached-tokens one"), chat("cached-tokens two")  # fixed: a rerun sees the same path
    client.chat.completions.create(model="default", messages=earlier, max_tokens=1)
    shared = common_prefix(prompt_ids(earlier), prompt_ids(msgs))
    assert shared > 0  # the template's start, "<|im_start|>system\nSession"
    r = client.chat.completions.create(model="default", messages=msgs, max_tokens=16, temperature=0)
    local = smol.engine.generate(smol.engine.apply_chat_template(msgs), {"max_new_tokens": 16, "temperature": 0})
    assert r.choices[0].message.content == local["text"]
    assert r.choices[0].finish_reason == local["meta_info"]["finish_reason"]["type"]
    assert r.usage.completion_tokens == local["meta_info"]["completion_tokens"]
    assert r.usage.prompt_tokens == local["meta_info"]["prompt_tokens"] == len(prompt_ids(msgs))
    assert r.usage.prompt_tokens_details.cached_tokens == shared // page * page
    again = client.chat.completions.create(model="default", messages=msgs, max_tokens=1)
    # one prompt token is always computed, for the logits of the next
    assert again.usage.prompt_tokens_details.cached_tokens == (r.usage.prompt_tokens - 1) // page * page


def _assert_greedy_logprobs(smol, prompt: list[int], chosen: list[tuple[str, float]],
                            tops: list[list[tuple[str, float]]], k: int) -> None:
    """A greedy output's (token text, logprob) per step and its `k` alternatives, best first, are
    those of the HF reference decoding the same prompt."""
    ref = hf_greedy(smol.hf, [prompt], len(chosen))[0]
    assert len(ref.tokens) == len(chosen) == len(tops)
    assert min(ref.gaps) > 10 * LOGPROB_TOL, "a near-tie: pick a prompt whose greedy path is clear"
    logprobs = hf_logprobs(smol.hf, prompt + ref.tokens)[len(prompt) - 1:]
    decode = lambda ids: [smol.engine.tokenizer.decode([t]) for t in ids]  # noqa: E731
    for step, (token, row, (text, lp), top) in enumerate(zip(ref.tokens, logprobs, chosen, tops)):
        assert text == decode([token])[0], step
        assert lp == pytest.approx(row[token].item(), abs=LOGPROB_TOL), step
        best = row.topk(k)
        assert [t for t, _ in top] == decode(best.indices.tolist()), step
        assert [v for _, v in top] == pytest.approx(best.values.tolist(), abs=LOGPROB_TOL), step
        assert all(a >= b for (_, a), (_, b) in zip(top, top[1:])), f"step {step}: not best first: {top}"
        assert top[0] == (text, lp), f"step {step}: the greedy token is not the best alternative: {top}"


def test_completions_batch_n_logprobs(client, smol):
    prompts = ["The capital of France is", "1, 2, 3,"]
    r = client.completions.create(model="default", prompt=prompts, max_tokens=5, temperature=0, n=2, logprobs=2)
    assert len(r.choices) == 4 and r.choices[0].text == r.choices[1].text and r.usage.completion_tokens == 20
    for choice in r.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
        assert "".join(lp.tokens) == choice.text
        prompt = smol.engine.tokenizer.encode(prompts[choice.index // 2], add_special_tokens=False)
        _assert_greedy_logprobs(smol, prompt, list(zip(lp.tokens, lp.token_logprobs)),
                                [list(t.items()) for t in lp.top_logprobs], 2)


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


def test_chat_logprobs(client, smol):
    msgs = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model="default", messages=msgs, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    assert "".join(c.token for c in content) == r.choices[0].message.content
    prompt = smol.engine.tokenizer.encode(smol.engine.apply_chat_template(msgs), add_special_tokens=False)
    assert len(prompt) == r.usage.prompt_tokens
    _assert_greedy_logprobs(smol, prompt, [(c.token, c.logprob) for c in content],
                            [[(t.token, t.logprob) for t in c.top_logprobs] for c in content], 3)


def test_errors(client, server):
    # one model is served: as in SGLang, any name means it (test_openai_peers.py has the rest)
    other = client.chat.completions.create(model="gpt-99", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    assert other.model == client.models.list().data[0].id
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
