"""/v1/score and /v1/rerank against HF transformers on the same weights (SmolLM2's GGUF codes,
dequantized: `smol.hf`): the next-token probabilities the server serves from the codes, with its
own quantized activations, within a stated tolerance of HF's fp32 ones."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

# |log p - log p_HF| of a label: the served default (Q4_1 codes, activations quantized per block of
# 32) against HF fp32 on the same codes; measured up to ~0.05 on these prompts
LOGPROB_TOL = 0.15


def _hf_next(smol, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(smol.hf(torch.tensor([ids])).logits[0, -1].float(), dim=-1)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def test_score_is_the_next_token_probability_of_each_label(server, smol, smol_tokenizer):
    query = "Question: what is the capital of France? Answer:"
    items = [" The capital is", " I think it is", " Paris is"]
    labels = [smol_tokenizer.encode(w, add_special_tokens=False)[0] for w in (" Paris", " Berlin", " the")]
    r = _post(server, "/v1/score", {"query": query, "items": items, "label_token_ids": labels}).json()
    soft = _post(server, "/v1/score", {"query": query, "items": items, "label_token_ids": labels,
                                       "apply_softmax": True}).json()
    assert r["object"] == "scoring" and len(r["scores"]) == len(items)
    for item, probs, norm in zip(items, r["scores"], soft["scores"]):
        ref = _hf_next(smol, smol_tokenizer.encode(query + item, add_special_tokens=False))[labels]
        assert all(abs(math.log(p) - float(q)) < LOGPROB_TOL for p, q in zip(probs, ref)), (item, probs, ref.exp())
        # (another request: its logprobs may differ in the last digits with what the cache and the
        # batch hold, outside --deterministic)
        assert abs(sum(norm) - 1) < 1e-6 and all(abs(n - p / sum(probs)) < 1e-3 for n, p in zip(norm, probs))
    # token ids work as texts do; item_first puts each item before the query
    ids = _post(server, "/v1/score", {"query": smol_tokenizer.encode(query, add_special_tokens=False),
                                      "items": [smol_tokenizer.encode(i, add_special_tokens=False) for i in items],
                                      "label_token_ids": labels}).json()
    assert all(abs(a - b) < 1e-3 * max(a, 1e-3) for x, y in zip(ids["scores"], r["scores"]) for a, b in zip(x, y))
    first = _post(server, "/v1/score", {"query": " is my city.", "items": ["Paris"], "label_token_ids": labels,
                                        "item_first": True}).json()
    ref = _hf_next(smol, smol_tokenizer.encode("Paris is my city.", add_special_tokens=False))[labels]
    assert all(abs(math.log(p) - float(q)) < LOGPROB_TOL for p, q in zip(first["scores"][0], ref))


def test_rerank_ranks_by_the_models_yes(server, smol, smol_tokenizer):
    query = "What is the capital of France?"
    docs = ["Bananas are yellow and grow in warm places.", "Paris is the capital and largest city of France.",
            "The stock market fell on Tuesday."]
    r = _post(server, "/v1/rerank", {"query": query, "documents": docs}).json()
    yes, no = (smol_tokenizer.encode(w, add_special_tokens=False)[0] for w in ("yes", "no"))
    want = []
    for doc in docs:
        text = smol_tokenizer.apply_chat_template([
            {"role": "system", "content": 'Judge whether the Document meets the requirements based on the Query and '
                                         'the Instruct provided. Note that the answer can only be "yes" or "no".'},
            {"role": "user", "content": "<Instruct>: Given a web search query, retrieve relevant passages that "
                                        f"answer the query\n<Query>: {query}\n<Document>: {doc}"}],
            tokenize=False, add_generation_prompt=True)
        lp = _hf_next(smol, smol_tokenizer.encode(text, add_special_tokens=False))
        want.append(float(torch.sigmoid(lp[yes] - lp[no])))
    got = {res["index"]: res["relevance_score"] for res in r["results"]}
    assert sorted(got) == [0, 1, 2] and all(abs(got[i] - want[i]) < 0.05 for i in got), (got, want)
    scores = [res["relevance_score"] for res in r["results"]]
    assert scores == sorted(scores, reverse=True) and r["results"][0]["document"]["text"] == docs[r["results"][0]["index"]]
    assert r["usage"]["total_tokens"] > 0 and r["id"].startswith("rerank-")
    top = _post(server, "/v1/rerank", {"query": query, "documents": [{"text": d} for d in docs], "top_n": 1,
                                       "return_documents": False}).json()
    assert [res["index"] for res in top["results"]] == [r["results"][0]["index"]] and "document" not in top["results"][0]


@pytest.mark.parametrize("path,body,says", [
    ("/v1/score", {"query": "a", "items": [], "label_token_ids": [1]}, "items"),
    ("/v1/score", {"query": "a", "items": ["b"], "label_token_ids": [10**9]}, "label_token_ids"),
    ("/v1/score", {"query": "a", "items": [[1, 2]], "label_token_ids": [1]}, "both"),
    ("/v1/score", {"query": "", "items": [""], "label_token_ids": [1]}, "empty"),
    ("/v1/score", {"query": "a", "items": ["b" * 40000], "label_token_ids": [1]}, "context length"),  # (the runtime's)
    ("/v1/rerank", {"query": "a", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": 0}, "top_n"),
])
def test_bad_input_is_a_400_naming_it(server, path, body, says):
    r = _post(server, path, body)
    if path == "/v1/score":  # SGLang's endpoint answers in SGLang's error object (its ErrorResponse)
        assert r.status_code == 400 and r.json()["object"] == "error" and r.json()["code"] == 400, r.text
        assert r.json()["type"] == "BadRequestError" and says in r.json()["message"], r.text
    else:
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
