"""vLLM's common request fields (issue 47), served with vLLM's meaning on the OpenAI endpoints of
the shared server (SmolLM2 in fp32): `return_token_ids`, `prompt_logprobs` (against HF fp32 on the
same weights, the oracle), `truncate_prompt_tokens`, `structured_outputs`, chat's `echo`; and the
stream options vLLM's and SGLang's own suites check (`stream_options` without a stream refused,
`continuous_usage_stats`), unknown fields refused by name, model cards with `root`."""

from __future__ import annotations

import json

import httpx
import pytest

from oracle import hf_logprobs

TEXT = "The capital of France is Paris. The capital of Italy is"
MESSAGES = [{"role": "user", "content": "Name a colour."}]
GREEDY = {"model": "m", "temperature": 0, "max_tokens": 4}
# |ours - HF| of a prompt logprob, fp32 both, the server's batch and chunking against HF's one pass
PROMPT_LOGPROB_TOL = 1e-3


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def _events(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_prompt_logprobs_are_hfs(server, smol, smol_tokenizer):
    """Per prompt token: null for the first; the token and the 3 likeliest there, each with its logprob,
    rank and text, as HF fp32 computes them on the same weights."""
    ids = smol_tokenizer.encode(TEXT)
    ref = hf_logprobs(smol.hf, ids)  # row i scores token i + 1
    r = _post(server, "/v1/completions", {**GREEDY, "prompt": TEXT, "prompt_logprobs": 3, "logprobs": 1}).json()
    chat = _post(server, "/v1/chat/completions", {**GREEDY, "messages": MESSAGES, "prompt_logprobs": 0}).json()
    choice = r["choices"][0]
    got = choice["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for i, (entry, token) in enumerate(zip(got[1:], ids[1:])):
        row = ref[i]
        own = entry[str(token)]
        assert abs(own["logprob"] - float(row[token])) < PROMPT_LOGPROB_TOL, (i, own, float(row[token]))
        hf_rank = int((row > row[token]).sum()) + 1  # (tokens within the tolerance of it may stand either side)
        ties = int(((row - row[token]).abs() < PROMPT_LOGPROB_TOL).sum()) - 1
        assert abs(own["rank"] - hf_rank) <= ties, (i, own, hf_rank, ties)
        assert own["decoded_token"] == smol_tokenizer.decode([token])
        alternatives = sorted((e for e in entry.values() if e["rank"] is not None and e["rank"] <= 3),
                              key=lambda e: e["rank"])
        assert [e["rank"] for e in alternatives] == [1, 2, 3]
        top = row.topk(3)
        assert all(abs(e["logprob"] - float(v)) < PROMPT_LOGPROB_TOL for e, v in zip(alternatives, top.values))
    # the output's logprobs keep their own count (1 alternative), whatever the prompt's asked for
    assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"])
    # chat: the rendered prompt's, beside the choices; 0: each token alone
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


def test_token_ids_beside_the_text_streamed_or_not(server, smol_tokenizer):
    body = {**GREEDY, "prompt": TEXT, "return_token_ids": True}
    whole = _post(server, "/v1/completions", body).json()["choices"][0]
    assert whole["prompt_token_ids"] == smol_tokenizer.encode(TEXT)
    assert smol_tokenizer.decode(whole["token_ids"]) == whole["text"] and len(whole["token_ids"]) == 4
    chunks = [c["choices"][0] for c in _events(server, "/v1/completions", body) if c["choices"]]
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == whole["token_ids"]
    chat_body = {**GREEDY, "messages": MESSAGES, "return_token_ids": True}
    chat = _post(server, "/v1/chat/completions", chat_body).json()
    counted = _post(server, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    assert chat["prompt_token_ids"] == counted
    assert smol_tokenizer.decode(chat["choices"][0]["token_ids"]) == chat["choices"][0]["message"]["content"]
    events = _events(server, "/v1/chat/completions", chat_body)
    assert events[0]["prompt_token_ids"] == counted
    assert [t for e in events for c in e["choices"] for t in c.get("token_ids", [])] == chat["choices"][0]["token_ids"]


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(server, smol_tokenizer):
    ids = smol_tokenizer.encode(TEXT)
    r = _post(server, "/v1/completions", {**GREEDY, "prompt": TEXT, "truncate_prompt_tokens": 5,
                                           "return_token_ids": True}).json()
    assert r["usage"]["prompt_tokens"] == 5 and r["choices"][0]["prompt_token_ids"] == ids[-5:]
    short = _post(server, "/v1/completions", {**GREEDY, "prompt": ids[-5:]}).json()
    assert r["choices"][0]["text"] == short["choices"][0]["text"]
    whole = _post(server, "/v1/completions", {**GREEDY, "prompt": TEXT, "truncate_prompt_tokens": -1}).json()
    assert whole["usage"]["prompt_tokens"] == len(ids)  # -1: as many as the context holds


def test_structured_outputs_constrain_as_vllms_do(server):
    colours = ["dark red", "light blue (sky)"]
    for path, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": TEXT})):
        r = _post(server, path, {**GREEDY, **body, "max_tokens": 12, "structured_outputs": {"choice": colours}}).json()
        choice = r["choices"][0]
        assert choice.get("text", choice.get("message", {}).get("content")) in colours, r
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"]}
    r = _post(server, "/v1/chat/completions", {**GREEDY, "messages": MESSAGES, "max_tokens": 24,
                                                 "structured_outputs": {"json": schema}}).json()
    assert json.loads(r["choices"][0]["message"]["content"])["n"] in (1, 2, 3), r


def test_chat_echo_puts_the_assistants_last_message_first(server):
    prefill = [*MESSAGES, {"role": "assistant", "content": "My favourite colour is"}]
    body = {**GREEDY, "messages": prefill, "continue_final_message": True, "echo": True}
    whole = _post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    plain = _post(server, "/v1/chat/completions", {**body, "echo": False}).json()["choices"][0]["message"]["content"]
    assert whole == "My favourite colour is" + plain
    streamed = "".join(c["delta"].get("content") or "" for e in _events(server, "/v1/chat/completions", body)
                       for c in e["choices"])
    assert streamed == whole


def test_continuous_usage_stats_put_usage_on_every_chunk(server):
    body = {**GREEDY, "messages": MESSAGES, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = _events(server, "/v1/chat/completions", body)
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert all(e.get("usage") for e in events) and counts == sorted(counts)
    last = events[-1]["usage"]  # the include_usage chunk: the whole request's
    assert not events[-1]["choices"] and counts[-2] == last["completion_tokens"] == 4
    assert all(e["usage"]["prompt_tokens"] == last["prompt_tokens"] for e in events)


@pytest.mark.parametrize("path,body,says", [
    ("/v1/chat/completions", {"messages": MESSAGES, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": TEXT, "stream_options": {}}, "stream_options"),
    ("/v1/completions", {"prompt": TEXT, "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": TEXT, "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": TEXT, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "structured_outputs": {"regex": "a", "choice": ["b"]}},
     "regex and choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "structured_outputs": {"regex": "a"}, "regex": "b"},
     "structured_outputs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
     "whitespace_pattern"),
    ("/v1/chat/completions", {"messages": MESSAGES, "bogus_option": 1}, "bogus_option"),  # unknown: refused by name
])
def test_bad_input_is_a_400_naming_it(server, path, body, says):
    r = _post(server, path, {**GREEDY, **body})
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


def test_model_cards_have_root(server):
    card = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]
    assert card["root"] == card["id"] and card["parent"] is None  # (the default model: its file's name)
