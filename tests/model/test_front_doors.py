"""LocalEngine and the served runtime take requests through the same preparation: the same bad
requests are refused with the same messages, `max_new_tokens: null` and the logprob options mean
the same, and `choices` works in both."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_VOCAB
from helpers import assert_drained
from radixlm.runtime.native import BadRequest, native_requests
from radixlm.runtime.sampling_params import SamplingParamsError

# native bodies LocalEngine.generate and the served /generate both refuse (the tiny model: no tokenizer)
BAD = [
    ({"input_ids": []}, BadRequest, "the prompt is empty"),
    ({"input_ids": [5, TINY_VOCAB + 3]}, BadRequest, f"input_ids must lie in [0, {TINY_VOCAB})"),
    ({"input_ids": [5] * 1024}, BadRequest, "the context length is 1024"),
    ({"text": "words"}, BadRequest, "no tokenizer (--skip-tokenizer-init): send input_ids"),
    ({"input_ids": [5, 6], "sampling_params": {"top_p": 1.5}}, SamplingParamsError, "top_p=1.5"),
    ({"input_ids": [5, 6], "sampling_params": {"logit_bias": {str(TINY_VOCAB): 1.0}}}, SamplingParamsError,
     f"allowed: in [0, {TINY_VOCAB})"),  # (stop_token_ids outside it are accepted and ignored, as SGLang does)
    ({"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 2}, BadRequest,
     "logprob_start_len 2 must be below the prompt length 2"),
    ({"input_ids": [5, 6], "return_logprob": True, "top_logprobs_num": 21}, BadRequest,
     "top_logprobs_num must lie in [0, 20]"),
    ({"input_ids": [5, 6], "require_reasoning": True}, BadRequest, "require_reasoning needs a server started"),
    ({"input_ids": [5, 6], "sampling_params": {"choices": ["a", "b"]}}, BadRequest, "choices need a tokenizer"),
]


def _served_refusal(engine, body) -> str:
    """What the tokenizer process answers the body with (its own code, its sockets stood in)."""
    from radixlm.runtime.tokenizer.manager import TokenizerManager

    m = TokenizerManager.__new__(TokenizerManager)
    m.prep, m.tokenizer, m.in_flight, m.choice_groups, replies, sent = engine.prep, None, {}, {}, [], []
    m._reply = lambda client, msg: replies.append(msg)
    m.to_scheduler = type("Sink", (), {"send": lambda self, raw: sent.append(raw)})()
    (req,), _ = native_requests(body)
    m._admit(b"client", req)
    (reply,) = replies
    assert reply.status == 400 and not sent
    return reply.error


@pytest.mark.parametrize("body,error,message", BAD, ids=[m[:40] for *_, m in BAD])
def test_both_front_doors_refuse_alike(tiny_llama, body, error, message):
    engine = tiny_llama.engine()
    kwargs = {("prompt" if k == "text" else k): v for k, v in body.items()}
    with pytest.raises(error) as caught:
        engine.generate(**kwargs)
    assert message in str(caught.value)
    assert _served_refusal(engine, body) == str(caught.value)
    assert_drained(engine)


def test_max_new_tokens_null_is_as_many_as_fit(tiny_llama):
    engine = tiny_llama.engine(context_length=48)
    prompt = tiny_llama.prompts[0][:10]
    res = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": None, "temperature": 0,
                                                             "ignore_eos": True})
    assert len(res["output_ids"]) == 48 - len(prompt)
    assert res["meta_info"]["finish_reason"] == {"type": "length", "length": 48 - len(prompt)}
    assert_drained(engine)


def test_logprob_start_len_range(tiny_llama):
    engine = tiny_llama.engine()
    prompt = tiny_llama.prompts[1][:6]
    with pytest.raises(BadRequest, match="logprob_start_len 6 must be below the prompt length 6"):
        engine.generate(input_ids=prompt, return_logprob=True, logprob_start_len=6)
    res = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 2, "temperature": 0},
                          return_logprob=True, logprob_start_len=5)
    (entry,) = res["meta_info"]["input_token_logprobs"]
    assert entry[1] == prompt[5] and entry[0] < 0 and entry[2] is None
    assert_drained(engine)


def test_a_batch_with_one_refused_request_leaves_nothing_behind(tiny_llama):
    engine = tiny_llama.engine()
    with pytest.raises(BadRequest, match="already in flight"):
        engine.generate(input_ids=[[5, 6], [7, 8]], rid=["same", "same"], sampling_params={"max_new_tokens": 4})
    with pytest.raises(BadRequest, match="does not fit"):
        engine.generate(input_ids=[[5, 6], [7, 8]], sampling_params=[{}, {"max_new_tokens": 5000}])
    assert_drained(engine)


def test_a_prompt_the_kv_pool_cannot_hold_is_refused_at_the_door(tiny_llama):
    """The front door knows the pool's size (the scheduler's, in tokens) and refuses what can never
    run; a prompt of exactly that size runs."""
    engine = tiny_llama.engine(max_total_tokens=64, page_size=16)
    pool = engine.worker.num_pages * engine.worker.page_size
    assert pool == 64
    with pytest.raises(BadRequest, match=f"the prompt has {pool + 1} tokens; the KV cache pool holds {pool}"):
        engine.generate(input_ids=[5] * (pool + 1), sampling_params={"max_new_tokens": 1})
    res = engine.generate(input_ids=[5] * pool, sampling_params={"max_new_tokens": 1, "ignore_eos": True})
    assert res["meta_info"]["prompt_tokens"] == pool
    assert_drained(engine)


# ---- choices -----------------------------------------------------------------------------------

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def _hf_normalised(smol, full_ids, start):
    with torch.inference_mode():
        logits = smol.hf(torch.tensor([full_ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    picked = [lp[i - 1, full_ids[i]].item() for i in range(start, len(full_ids))]
    return sum(picked) / len(picked)


def test_choices_on_the_local_engine(smol):
    from radixlm.runtime.constrained.choices import choice_boundary

    engine, tok = smol.engine, smol.engine.tokenizer
    prompt, choices = CHAT.format("What is the capital of France?"), ["Paris", "London", "Berlin"]
    res = engine.generate(prompt, {"choices": choices})
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    expected = []
    for c in choices:
        full = tok.encode(prompt + c, add_special_tokens=False)
        expected.append(_hf_normalised(smol, full, choice_boundary(prompt_ids, full)))
    best = max(range(len(choices)), key=expected.__getitem__)
    meta = res["meta_info"]
    assert res["text"] == choices[best] and meta["selected_index"] == best and res["output_ids"] == []
    assert meta["normalized_scores"] == pytest.approx(expected, abs=1e-3)
    assert meta["prompt_tokens"] == len(prompt_ids) and meta["finish_reason"] == {"type": "stop", "matched": None}
    # the other methods, and a batch of choices requests beside a plain one
    out = engine.generate([prompt, CHAT.format("Is water wet?")], [
        {"choices": choices, "choices_method": "greedy_token"},
        {"choices": ["Yes", "No"], "choices_method": "unconditional_likelihood_normalized"}])
    assert out[0]["meta_info"]["method"] == "greedy_token" and len(out[0]["meta_info"]["greedy_logprob_matrix"]) == 3
    assert out[1]["meta_info"]["method"] == "unconditional_likelihood_normalized"
    assert out[1]["text"] in ("Yes", "No") and len(out[1]["meta_info"]["unconditional_token_logprobs"]) == 2
    plain = engine.generate(prompt, {"max_new_tokens": 3, "temperature": 0})
    assert len(plain["output_ids"]) == 3
    for bad in ({"choices": []}, {"choices": ["a", 3]}, {"choices": ["a"], "choices_method": "vibes"}):
        with pytest.raises(BadRequest, match="choices"):
            engine.generate(prompt, bad)
    assert_drained(engine)
