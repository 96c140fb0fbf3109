"""/v1/embeddings and /encode against HF transformers on the same weights (SmolLM2's GGUF codes,
dequantized: `smol.hf`): the final hidden states after the model's last norm, pooled."""

from __future__ import annotations

import base64
import struct

import httpx
import openai
import pytest
import torch

from server.conftest import assert_kv_clean

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Embeddings map text to vectors.", "héllo 👋"]
# cosine of ours (Q4_1 codes, activations quantized per block of 32) with HF fp32 on the same codes
MIN_COSINE = 0.995


def _hf(smol, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.inference_mode():
        hidden = smol.hf.model(torch.tensor([ids])).last_hidden_state[0].double()
    v = hidden[-1] if pooling == "last" else hidden.mean(0)
    return v / v.norm()


def _cos(a, b: torch.Tensor) -> float:
    a = torch.tensor(a, dtype=torch.float64)
    return float(a @ b / a.norm() / b.norm())


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_are_hfs_pooled_hidden_states(server, smol, smol_tokenizer, pooling):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    r = client.embeddings.create(model="m", input=TEXTS, extra_body={"pooling": pooling})
    assert [d.index for d in r.data] == [0, 1, 2] and r.object == "list"
    ids = [smol_tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    for d, t in zip(r.data, ids):
        assert abs(sum(x * x for x in d.embedding) - 1) < 1e-5  # normalized
        assert _cos(d.embedding, _hf(smol, t, pooling)) > MIN_COSINE
    # the same text again: the same vector, whether its prompt came from the cache or not
    again = client.embeddings.create(model="m", input=TEXTS[0], extra_body={"pooling": pooling})
    assert _cos(again.data[0].embedding, torch.tensor(r.data[0].embedding, dtype=torch.float64)) > 0.9999
    assert_kv_clean(server.url)


def test_dimensions_base64_tokens_and_encode(server, smol, smol_tokenizer):
    full = httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS[1]}, timeout=60).json()["data"][0]["embedding"]
    cut = httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS[1], "dimensions": 64,
                                                          "encoding_format": "base64"}, timeout=60).json()
    vector = struct.unpack("<64f", base64.b64decode(cut["data"][0]["embedding"]))
    head = torch.tensor(full[:64], dtype=torch.float64)
    # (two requests: their hidden states may differ in the last digits with what the cache and the batch hold)
    assert torch.allclose(torch.tensor(vector, dtype=torch.float64), head / head.norm(), atol=1e-4)
    ids = smol_tokenizer.encode(TEXTS[1], add_special_tokens=False)
    by_ids = httpx.post(server.url + "/v1/embeddings", json={"input": [ids]}, timeout=60).json()["data"][0]
    assert _cos(by_ids["embedding"], torch.tensor(full, dtype=torch.float64)) > 0.9999
    native = httpx.post(server.url + "/encode", json={"text": TEXTS[1], "normalize": False}, timeout=60).json()
    assert native["meta_info"]["prompt_tokens"] == len(ids) and native["meta_info"]["completion_tokens"] == 0
    assert _cos(native["embedding"], _hf(smol, ids, "last")) > MIN_COSINE
    batch = httpx.post(server.url + "/encode", json={"input_ids": [ids, ids[:3]]}, timeout=60).json()
    assert len(batch) == 2 and all(abs(sum(x * x for x in b["embedding"]) - 1) < 1e-5 for b in batch)


@pytest.mark.parametrize("path,body,says", [
    ("/v1/embeddings", {"input": ""}, "empty"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": "x", "dimensions": 100000}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": "x", "pooling": "cls"}, "pooling"),
    ("/v1/embeddings", {"input": [[1, 10**9]]}, "input_ids"),
    ("/encode", {"text": "x", "input_ids": [1]}, "exactly one"),
])
def test_bad_input_is_a_400_naming_it(server, path, body, says):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
