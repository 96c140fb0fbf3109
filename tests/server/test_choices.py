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


def test_greedy_token_method_is_sglangs_greedy_token_selection_on_hfs_logprobs(server, smol):
    """greedy_token is SGLang's greedy_token_selection, the language's and the server's alike: token
    by token, keep the choices with the highest logprob at that position (a shorter choice goes on
    with its own mean) until one is left; here on logprobs HF computes on the same weights. (The
    server used to pick the choice greedy decoding follows furthest: another method by that name.)"""
    from radixlm.runtime.constrained.choices import choice_boundary

    prompt = CHAT.format("What is the capital of France?")
    choices = ["The capital of France is Paris.", "Paris", "I don't know."]
    res = httpx.post(server.url + "/generate", json={"text": prompt, "sampling_params": {
        "choices": choices, "choices_method": "greedy_token"}}, timeout=120).json()
    tok = smol.engine.tokenizer
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    rows = []
    for c in choices:
        full = tok.encode(prompt + c, add_special_tokens=False)
        start = choice_boundary(prompt_ids, full)
        with torch.inference_mode():
            lp = torch.log_softmax(smol.hf(torch.tensor([full])).logits[0].float(), dim=-1)
        rows.append([lp[i - 1, full[i]].item() for i in range(start, len(full))])
    width = max(map(len, rows))
    padded = [r + [sum(r) / len(r)] * (width - len(r)) for r in rows]
    left = list(range(len(choices)))
    for column in range(width):  # (a tie within 1e-4 would make the oracle's pick unsure: none here)
        best = max(padded[i][column] for i in left)
        left = [i for i in left if padded[i][column] > best - 1e-4]
        if len(left) == 1:
            break
    assert len(left) == 1
    meta = res["meta_info"]
    assert meta["selected_index"] == left[0] and res["text"] == choices[left[0]]
    assert [len(r) for r in meta["greedy_logprob_matrix"]] == [width] * len(choices)
    assert meta["greedy_logprob_matrix"] == [pytest.approx(r, abs=1e-3) for r in padded]