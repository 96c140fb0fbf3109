"""Speculative decoding on SmolLM2, against plain decoding and against HF.

Under --deterministic a token's logits are bitwise the same whatever step computes it, so a
verify row (an extend of 1 + k tokens) must give what decoding gives one step at a time:
greedy and seeded outputs, their logprobs and finish reasons are compared with ==. Every
speculating engine checks KV accounting after every step, and each test checks that drafts were
in fact checked and kept, so that equality cannot come from speculation never running.
"""

from __future__ import annotations

import json

import pytest

from conftest import NEW_TOKENS
from helpers import assert_drained
from oracle import assert_matches

RECORD = ("Name: Alice Smith\nCity: Paris\nAge: 34\nJob: engineer at Acme Corp\n"
          "Name: Bob Jones\nCity: Lyon\nAge: 41\nJob: baker at Pain Doré\n")
PROMPTS = [
    f"Copy these records exactly, then copy them again.\n{RECORD}\nCopy:\n",
    "Count from 1 to 40, separated by commas: 1, 2, 3,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Write a short story about a cat who learns to bake bread.",
]


def _params(i: int) -> dict:
    kinds = [
        {"temperature": 0},
        {"temperature": 0.8, "top_k": 30, "seed": 7 + i},
        {"temperature": 0, "stop": ["mul", "\n\n\n"]},
        {"temperature": 0.7, "seed": 3, "min_new_tokens": 40},
    ]
    return {"max_new_tokens": 48, **kinds[i % len(kinds)]}


def _outcome(results: list[dict]) -> list[tuple]:
    return [(r["output_ids"], [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]],
             r["meta_info"]["finish_reason"]) for r in results]


def _run(engine, prompts, params) -> list[dict]:
    results = engine.generate(prompts, params, return_logprob=True)
    assert_drained(engine)
    return results


@pytest.fixture(scope="module")
def plain(smol):
    engine = smol.engine_with(deterministic=True)
    params = [_params(i) for i in range(len(PROMPTS))]
    return _outcome(_run(engine, PROMPTS, params))


def _kept(results: list[dict]) -> int:
    return sum(r["meta_info"].get("spec_accepted_tokens", 0) for r in results)


@pytest.mark.parametrize("method", ["ngram", "radix", "auto"])
def test_outputs_are_bitwise_those_of_plain_decoding(smol, plain, method):
    """Greedy, seeded, stop strings and min_new_tokens: the same tokens, logprobs and finish reasons."""
    engine = smol.engine_with(deterministic=True, speculative=method, debug_accounting=True)
    params = [_params(i) for i in range(len(PROMPTS))]
    if method == "radix":  # the tree proposes from what it holds: the prompts, then finished outputs
        _run(engine, PROMPTS, params)
    results = _run(engine, PROMPTS, params)
    assert _outcome(results) == plain
    stats = engine.scheduler.speculator.stats()
    assert stats["accepted_tokens"] <= stats["proposed_tokens"]
    if method == "auto":
        # auto's choices follow this machine's measured step times (tests/unit/test_speculation.py
        # tests them on given costs): here, that whatever it chose, the outputs are plain decoding's
        assert engine.scheduler.speculator.costs.measured(False, len(PROMPTS))
    else:
        assert _kept(results) > 10
    for r in results:
        meta = r["meta_info"]
        if "spec_verify_ct" in meta:
            assert meta["spec_accepted_tokens"] <= meta["spec_proposed_tokens"]
            assert meta["completion_tokens"] >= meta["spec_verify_ct"] + meta["spec_accepted_tokens"]


def test_many_requests_in_one_batch_and_retraction(smol):
    """Eight requests in a pool too small for all: some step back and re-prefill, drafts or not."""
    prompts = PROMPTS * 2
    params = [{"max_new_tokens": 64, "temperature": 0, "ignore_eos": True} for _ in prompts]
    # prompts of ~200 distinct tokens, outputs of 512: admitted without reserving room, some must step back
    small = dict(deterministic=True, max_total_tokens=300, chunked_prefill_size=128, init_new_token_ratio=0.0,
                 min_new_token_ratio=0.0)
    base = _run(smol.engine_with(**small), prompts, params)
    engine = smol.engine_with(speculative="ngram", debug_accounting=True, **small)
    spec = _run(engine, prompts, params)
    assert [r["output_ids"] for r in spec] == [r["output_ids"] for r in base]
    assert engine.scheduler.num_retractions > 0
    assert _kept(spec) > 20


def test_constrained_outputs_and_jump_forward(smol):
    """Drafts are cut to what the constraint admits, the masks of a verify's rows follow its drafts,
    and jump-forward appends forced text after the kept tokens."""
    schema = {"type": "array", "minItems": 3, "maxItems": 3,
              "items": {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
                        "required": ["name", "city"]}}
    prompts = [f"{RECORD}\nThe records as a JSON list:", "Say yes or no, five times: "]
    params = [{"max_new_tokens": 80, "temperature": 0, "json_schema": json.dumps(schema)},
              {"max_new_tokens": 30, "temperature": 0, "regex": "((yes|no), ){4}(yes|no)"}]
    base = _run(smol.engine_with(deterministic=True), prompts, params)
    engine = smol.engine_with(deterministic=True, speculative="ngram", debug_accounting=True)
    spec = _run(engine, prompts, params)
    assert _outcome(spec) == _outcome(base)
    json.loads(spec[0]["text"])
    assert _kept(spec) > 0


def test_a_draft_model_gives_plain_decodings_outputs(smol, plain):
    """SmolLM2 drafting for itself (its KV beside the target's in the same pages): under
    --deterministic a draft step computes what the target's step computes, so a greedy request
    keeps every draft, and every request's outputs are plain decoding's."""
    engine = smol.engine_with(deterministic=True, speculative_draft_model=smol.path,
                              draft_model=smol.engine.worker.model, debug_accounting=True)
    results = _run(engine, PROMPTS, [_params(i) for i in range(len(PROMPTS))])
    assert _outcome(results) == plain
    greedy = results[0]["meta_info"]
    assert greedy["spec_proposed_tokens"] > 10 and greedy["spec_accepted_tokens"] == greedy["spec_proposed_tokens"]
    stats = engine.scheduler.speculator.stats()
    assert stats["accepted_tokens"] < stats["proposed_tokens"]  # the sampled ones reject some greedy drafts


def test_a_constrained_request_decodes_plainly_beside_a_draft_model(smol):
    params = {"max_new_tokens": 30, "temperature": 0, "regex": "((yes|no), ){4}(yes|no)"}
    base = _run(smol.engine_with(deterministic=True), ["Say yes or no, five times: "], params)
    engine = smol.engine_with(deterministic=True, speculative_draft_model=smol.path,
                              draft_model=smol.engine.worker.model, debug_accounting=True)
    spec = _run(engine, ["Say yes or no, five times: "], params)
    assert _outcome(spec) == _outcome(base)
    assert not spec[0]["meta_info"].get("spec_verify_ct")


def test_greedy_tokens_match_hf(smol):
    """Without --deterministic a verify row runs other kernels than a decode row: tokens may differ
    from HF only at certified near-ties, as plain decoding's may."""
    engine = smol.engine_with(speculative="ngram", debug_accounting=True)
    results = engine.generate(input_ids=smol.prompts, sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0})
    flips = [assert_matches(r["output_ids"], ref, f"speculative smollm2 prompt {i}")
             for i, (r, ref) in enumerate(zip(results, smol.refs))]
    assert sum(f > 0 for f in flips) <= 1, flips
    assert engine.scheduler.speculator.stats()["verify_rows"] > 0
    assert_drained(engine)
