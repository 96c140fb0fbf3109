"""/tokenize and /detokenize in vLLM's and llama.cpp's shapes, against SmolLM2's own HF tokenizer
(the oracle), and a chat prompt's tokens against what a chat request counts."""

from __future__ import annotations

import httpx
import pytest

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there, héllo 👋"}]


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_tokenize_in_vllms_and_llama_cpps_shapes(server, smol_tokenizer):
    text = "Hello world, héllo 👋"
    r = _post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    want = smol_tokenizer.encode(text, add_special_tokens=True)
    assert r["tokens"] == want and r["count"] == len(want) and r["max_model_len"] > 0
    assert r["token_strs"] == smol_tokenizer.convert_ids_to_tokens(want)
    bare = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == smol_tokenizer.encode(text, add_special_tokens=False) and bare["token_strs"] is None
    llama = _post(server, "/tokenize", {"content": text, "with_pieces": True}).json()
    assert [t["id"] for t in llama["tokens"]] == bare["tokens"]
    # llama.cpp's pieces: each token's text (" world", not the vocabulary's "Ġworld"), or its bytes
    # where they are no UTF-8 alone (the emoji's); together, the text's bytes
    pieces = [t["piece"] for t in llama["tokens"]]
    assert " world" in pieces and any(isinstance(p, list) for p in pieces), pieces
    assert all(p == smol_tokenizer.decode([t]) for p, t in zip(pieces, bare["tokens"]) if isinstance(p, str))
    assert b"".join(p.encode() if isinstance(p, str) else bytes(p) for p in pieces) == text.encode()
    back = _post(server, "/detokenize", {"tokens": want}).json()
    assert back["prompt"] == back["content"] == smol_tokenizer.decode(want)


def test_a_chat_prompts_tokens_are_what_a_chat_request_counts(server, smol_tokenizer):
    r = _post(server, "/tokenize", {"messages": MESSAGES}).json()
    rendered = smol_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert r["tokens"] == smol_tokenizer.encode(rendered, add_special_tokens=False)
    chat = _post(server, "/v1/chat/completions", {"model": "m", "messages": MESSAGES, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == r["count"]


def test_a_chat_prompt_closed_or_continued_as_vllm_renders_it(server, smol_tokenizer):
    """vLLM's add_generation_prompt (false: no assistant header) and continue_final_message (the
    last, assistant, message left open), against HF's rendering of the same."""
    closed = _post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    rendered = smol_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    assert closed["tokens"] == smol_tokenizer.encode(rendered, add_special_tokens=False)
    prefill = [*MESSAGES, {"role": "assistant", "content": "Hello! I am"}]
    r = _post(server, "/tokenize", {"messages": prefill, "continue_final_message": True}).json()
    rendered = smol_tokenizer.apply_chat_template(prefill, tokenize=False, continue_final_message=True)
    assert r["tokens"] == smol_tokenizer.encode(rendered, add_special_tokens=False) and rendered.endswith("I am")


@pytest.mark.parametrize("path,body,says", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "boolean"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": True, "continue_final_message": True}, "both"),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ("/detokenize", {"tokens": [1, 10**9]}, "lie in"),
    ("/detokenize", {"tokens": "1 2"}, "list of integers"),
])
def test_bad_input_is_a_400_naming_it(server, path, body, says):
    r = _post(server, path, body)
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
