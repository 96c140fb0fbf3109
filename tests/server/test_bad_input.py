"""Bad input on every API: each gets a 4xx whose message says what was wrong, and the server serves on."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from conftest import COMPILE_LIMIT_S
from server.conftest import assert_kv_clean

HI = [{"role": "user", "content": "hi"}]


def _nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


NATIVE = [
    ({"text": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": 10**12}}, "at most 8191"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": 1.5}}, "must be an integer"),
    ({"text": "hi", "sampling_params": {"max_tokens": 3}}, "max_tokens"),
    ({"text": "hi", "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"text": "hi", "bogus": 1}, "bogus"),
    ({"sampling_params": {}}, "exactly one"),
    ({"text": ""}, "empty"),
    ({"input_ids": [1, 99999999]}, "input_ids"),
    ({"input_ids": [[1, 2], []]}, "empty"),
    ({"text": "word " * 9000}, "context length"),
    ({"text": "hi", "sampling_params": {"n": 0}}, "n must"),
    ({"text": "hi", "sampling_params": {"n": 10**9}}, "more than 1024 generations"),  # refused before expanding
    ({"text": ["hi"] * 2000}, "more than 1024 generations"),
    ({"text": "hi", "return_logprob": True, "top_logprobs_num": 10**6}, "top_logprobs_num"),
    ({"text": "hi", "sampling_params": {"logit_bias": {10**9: 1}}}, "logit_bias"),
    ({"text": "hi", "sampling_params": {"regex": "(unclosed"}}, "regex constraint"),
    ({"text": "hi", "sampling_params": {"regex": "a", "json_schema": "{}"}}, "mutually exclusive"),
    ({"text": "hi", "sampling_params": {"json_schema": "{not json"}}, "json_schema"),
    ({"text": "hi", "sampling_params": {"json_schema": json.dumps(_nested_arrays(200))}}, "more than 128 deep"),
    # (the test server runs --grammar-backend outlines, which has no grammars)
    ({"text": "hi", "sampling_params": {"ebnf": 'root ::= "a"'}}, "ebnf grammars need --grammar-backend xgrammar"),
    ({"text": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, "'tools' goes with 'messages'"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "f"}]}, "'tools' goes with 'messages'"),
    ({"messages": [{"content": "hi"}]}, "with a role"),
    ({"messages": "hi"}, "'messages' must be a non-empty list"),
    ({"text": "hi", "sampling_params": {"structural_tag": {"structures": [], "triggers": ["<a>"]}}}, "structures"),
    ({"text": "hi", "sampling_params": {"structural_tag": "{}", "regex": "a"}}, "mutually exclusive"),
    ({"input_ids": True}, "'input_ids' must be a list of token ids"),
    ({"input_ids": [[1], 2]}, "'input_ids' must be a list of token ids"),
    ({"input_ids": [1, "a"]}, "'input_ids' must be a list of token ids"),
    ({"text": ["a", 3]}, "'text' must be a string"),
]


@pytest.mark.parametrize("body,fragment", NATIVE)
def test_native_bad_input(server, body, fragment):
    r = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]
    streamed = httpx.post(server.url + "/generate", json={**body, "stream": True}, timeout=60)
    assert streamed.status_code == 400, streamed.text


OPENAI = [
    ("completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 2**63}, "does not fit"),
    ("completions", {"prompt": ""}, "empty"),
    ("completions", {"prompt": [[]]}, "non-empty"),
    ("completions", {"prompt": {"a": 1}}, "prompt"),
    ("completions", {"prompt": [1, 2, 10**9]}, "input_ids must lie"),
    ("completions", {"prompt": "hi", "n": 1000}, "n"),
    ("completions", {"prompt": "hi", "logprobs": 10**6}, "logprobs"),
    ("completions", {"prompt": "hi", "top_p": 2}, "top_p"),
    ("completions", {"prompt": "hi", "seed": 2**70}, "seed"),
    ("completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("completions", {"prompt": "hi", "max_token": 5}, "max_token"),  # a misspelt field is not ignored
    ("completions", {"prompt": "word " * 9000}, "context length"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": 5}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ("chat/completions", {"messages": HI, "max_completion_tokens": 10**9}, "does not fit"),
    ("chat/completions", {"messages": HI, "n": 10**6}, "n"),
    ("chat/completions", {"messages": HI, "temperature": "hot"}, "temperature"),
    ("chat/completions", {"messages": HI, "tools": [{"type": "function", "function": {"name": "f g"}}]}, "tool name 'f g'"),
    ("chat/completions", {"messages": HI, "tool_choice": "required"}, "tool_choice needs tools"),
    ("chat/completions", {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}],
                          "tool_choice": {"type": "function", "function": {"name": "g"}}}, "not among the tools"),
    ("chat/completions", {"messages": [{"role": "tool", "content": "1"}]}, "tool_call_id"),
    ("chat/completions", {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{oops"}}]}]}, "must be a JSON object"),
    ("chat/completions", {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": _nested_arrays(200)}}}, "more than 128 deep"),
]


@pytest.mark.parametrize("path,body,fragment", OPENAI, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(OPENAI)])
def test_openai_bad_input(server, path, body, fragment):
    r = httpx.post(f"{server.url}/v1/{path}", json={"model": "default", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"], r.text


RAW = [
    (b'{"text": "\xff\xfe", "sampling_params": {}}', "UTF-8"),
    (b'{"text": "\\ud800"}', "surrogate"),
    (b"[" * 100_000 + b"]" * 100_000, "depth"),
    (b"", "empty"),
    (b"hello", "not valid JSON"),
    (b'{"text": "hi", "sampling_params": {"temperature": NaN}}', "not valid JSON"),
    (b'{"text": "hi", "sampling_params": {"temperature": 1e999}}', "infinity"),
    (b"[1, 2]", "JSON object"),
]


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("raw,fragment", RAW)
def test_malformed_bodies(server, path, raw, fragment):
    r = httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"], r.text


def test_wrong_method_and_unknown_path(server):
    assert httpx.get(server.url + "/generate", timeout=30).status_code == 405
    assert httpx.post(server.url + "/no_such_endpoint", content=b"{}", timeout=30).status_code == 404


def test_an_exploding_regex_hits_the_compile_time_limit_alone(compile_limit_server):
    """The server runs with a short --constraint-timeout: the compile is stopped, the request gets a
    400, and a plain request sent meanwhile is not held up."""
    server = compile_limit_server
    body = {"text": "hi", "sampling_params": {"regex": "(a|b)*a(a|b){40}", "max_new_tokens": 2}}
    with httpx.Client(timeout=60) as c:
        started = time.monotonic()
        from concurrent.futures import ThreadPoolExecutor

        slow = ThreadPoolExecutor(1).submit(c.post, server.url + "/generate", json=body)
        time.sleep(0.5)
        plain = c.post(server.url + "/generate", json={"text": "ok", "sampling_params": {"max_new_tokens": 2}})
        assert plain.status_code == 200 and not slow.done()
        r = slow.result()
    assert r.status_code == 400 and f"more than {COMPILE_LIMIT_S}s" in r.json()["error"]["message"], r.text
    assert time.monotonic() - started < COMPILE_LIMIT_S + 25


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_with_one_bad_prompt_leaves_nothing_running(server, stream):
    """The good prompt of a refused batch reached the scheduler before the bad one failed: it is
    aborted with the batch, not left generating thousands of tokens for nobody."""
    body = {"input_ids": [[1, 2, 3], []], "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True},
            "stream": stream}
    r = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 400 and "empty" in r.json()["error"]["message"], r.text
    assert_kv_clean(server.url, wait=5)


def test_the_server_serves_on_after_all_of_it(server):
    r = httpx.post(server.url + "/generate", json={"text": "ok", "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 200
    assert_kv_clean(server.url)
