"""`choices`: the selected answer is the argmax of token-length-normalised logprobs, as
`transformers` computes them independently on the same weights."""

from __future__ import annotations

import httpx
import pytest
import torch

from server.conftest import assert_kv_clean

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
CASES = [
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"]),
    ("Is water wet? Answer yes or no.", ["Yes", "No"]),
    ("Which is a fruit?", ["A carrot", "An apple", "A potato"]),
]


def _hf_normalised(smol, prompt_ids, full_ids, start):
    with torch.inference_mode():
        logits = smol.hf(torch.tensor([full_ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    picked = [lp[i - 1, full_ids[i]].item() for i in range(start, len(full_ids))]
    return sum(picked) / len(picked)


@pytest.mark.parametrize("question,choices", CASES)
def test_choice_equals_hf_argmax(server, smol, question, choices):
    from radixlm.runtime.constrained.choices import choice_boundary

    prompt = CHAT.format(question)
    res = httpx.post(server.url + "/generate", json={"text": prompt, "sampling_params": {"choices": choices}},
                     timeout=120).json()
    tok = smol.engine.tokenizer
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    expected = []
    for c in choices:
        full = tok.encode(prompt + c, add_special_tokens=False)
        expected.append(_hf_normalised(smol, prompt_ids, full, choice_boundary(prompt_ids, full)))
    best = max(range(len(choices)), key=expected.__getitem__)
    meta = res["meta_info"]
    assert res["text"] == choices[best] and meta["selected_index"] == best
    assert meta["normalized_scores"] == pytest.approx(expected, abs=1e-3)
    assert_kv_clean(server.url)


def test_unconditional_method_and_bad_choices(server):
    prompt = CHAT.format("What colour is grass?")
    res = httpx.post(server.url + "/generate", json={"text": prompt, "sampling_params": {
        "choices": ["green", "purple"], "choices_method": "unconditional_likelihood_normalized"}}, timeout=120).json()
    assert res["meta_info"]["method"] == "unconditional_likelihood_normalized" and res["text"] in ("green", "purple")
    for bad in ({"choices": []}, {"choices": ["a", 3]}, {"choices": ["a"], "choices_method": "vibes"}):
        r = httpx.post(server.url + "/generate", json={"text": prompt, "sampling_params": bad}, timeout=60)
        assert r.status_code == 400, r.text
    assert_kv_clean(server.url)


def test_greedy_token_method_follows_hf_argmax(server, smol):
    from radixlm.runtime.constrained.choices import choice_boundary

    prompt = CHAT.format("What is the capital of France?")
    choices = ["The capital of France is Paris.", "Paris", "I don't know."]
    res = httpx.post(server.url + "/generate", json={"text": prompt, "sampling_params": {
        "choices": choices, "choices_method": "greedy_token"}}, timeout=120).json()
    tok = smol.engine.tokenizer
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    keys = []
    for c in choices:
        full = tok.encode(prompt + c, add_special_tokens=False)
        start = choice_boundary(prompt_ids, full)
        with torch.inference_mode():
            lp = torch.log_softmax(smol.hf(torch.tensor([full])).logits[0].float(), dim=-1)
        run = 0
        for i in range(start, len(full)):
            if int(lp[i - 1].argmax()) != full[i]:
                break
            run += 1
        keys.append((run, _hf_normalised(smol, prompt_ids, full, start)))
    best = max(range(len(choices)), key=keys.__getitem__)
    assert res["meta_info"]["greedy_runs"] == [k[0] for k in keys]
    assert res["meta_info"]["selected_index"] == best and res["text"] == choices[best]
