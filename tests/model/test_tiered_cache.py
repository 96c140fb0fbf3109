"""The KV tier under a real model: prefixes evicted from a small pool come back from the folder,
after a restart too, and the tokens are those computed from scratch and HF's.

Under --deterministic a prefix's KV is bitwise the same however it was computed, so a prompt
whose prefix was read back must give exactly the tokens and logprobs of a run without the tier.
"""

from __future__ import annotations

import pytest

from conftest import NEW_TOKENS, TINY_VOCAB
from helpers import assert_drained
from oracle import assert_matches, hf_greedy, random_prompts

# five prompts of 150-250 tokens: their KV together is several times the 400-token pool
LONG = random_prompts(TINY_VOCAB, 5, seed=31, min_len=150, max_len=250)
PARAMS = {"max_new_tokens": NEW_TOKENS, "temperature": 0}


def _generate(engine, prompts: list[list[int]]) -> list[dict]:
    results = [engine.generate(input_ids=p, sampling_params=PARAMS, return_logprob=True) for p in prompts]
    assert_drained(engine)
    return results


def _outcome(results: list[dict]) -> list[tuple]:
    return [(r["output_ids"], r["meta_info"]["output_token_logprobs"]) for r in results]


@pytest.fixture(scope="module")
def plain(tiny_llama) -> list[tuple]:
    return _outcome(_generate(tiny_llama.engine(deterministic=True), LONG))


def _tiered(tiny_llama, folder, **kwargs):
    return tiny_llama.engine(kv_tier_path=str(folder), max_total_tokens=400, debug_accounting=True, **kwargs)


def test_evicted_prefixes_come_back_from_the_tier_bitwise(tiny_llama, plain, tmp_path):
    engine = _tiered(tiny_llama, tmp_path, deterministic=True)
    first = _generate(engine, LONG)
    assert _outcome(first) == plain
    engine.scheduler.kv.tier.store.drain()
    again = _generate(engine, LONG)  # each prompt was evicted by the others: only the tier has it
    assert _outcome(again) == plain
    cached = [r["meta_info"]["cached_tokens"] for r in again]
    assert all(c >= 128 for c in cached), cached  # whole 64-token blocks of each prompt
    info = engine.scheduler.kv.tier.store.info()
    assert info["hits"] == len(LONG) and 0 < info["tokens_loaded"] <= sum(cached) and info["corrupt_skipped"] == 0
    engine.shutdown()


def test_a_restarted_engine_serves_what_the_last_one_saw(tiny_llama, plain, tmp_path):
    before = _tiered(tiny_llama, tmp_path, deterministic=True)
    _generate(before, LONG[:2])
    before.shutdown()  # saves what the tree still holds
    after = _tiered(tiny_llama, tmp_path, deterministic=True)
    results = _generate(after, LONG[:2])
    assert _outcome(results) == plain[:2]
    assert all(r["meta_info"]["cached_tokens"] >= 128 for r in results)
    after.shutdown()
    # another configuration (here the page size) never reads those files
    other = _tiered(tiny_llama, tmp_path, deterministic=True, page_size=4)
    assert all(r["meta_info"]["cached_tokens"] == 0 for r in _generate(other, LONG[:2]))
    other.shutdown()


def test_an_int8_kv_comes_back_bitwise_and_another_kv_type_never_reads_it(tiny_llama, tmp_path):
    """The tier saves the pool's bytes: int8 codes with each row's scale, read back bitwise (under
    --deterministic, the outputs of a run without the tier). Its identity includes the KV type: a
    server on the same weights with another one finds the folder's blocks, and reads none."""
    plain_int8 = _outcome(_generate(tiny_llama.engine(deterministic=True, kv_cache_dtype="int8"), LONG))
    engine = _tiered(tiny_llama, tmp_path, deterministic=True, kv_cache_dtype="int8")
    assert _outcome(_generate(engine, LONG)) == plain_int8
    engine.scheduler.kv.tier.store.drain()
    again = _generate(engine, LONG)
    assert _outcome(again) == plain_int8 and all(r["meta_info"]["cached_tokens"] >= 128 for r in again)
    assert engine.scheduler.kv.tier.store.info()["hits"] == len(LONG)
    engine.shutdown()
    other = _tiered(tiny_llama, tmp_path, deterministic=True, kv_cache_dtype="bf16")
    assert all(r["meta_info"]["cached_tokens"] == 0 for r in _generate(other, LONG[:2]))
    info = other.scheduler.kv.tier.store.info()
    assert info["hits"] == 0 and info["other_identity_blocks"] > 0
    other.shutdown()


def test_greedy_tokens_from_the_tier_are_hfs(tiny_llama, tmp_path):
    refs = hf_greedy(tiny_llama.hf, LONG, NEW_TOKENS)
    engine = _tiered(tiny_llama, tmp_path)
    _generate(engine, LONG)
    engine.scheduler.kv.tier.store.drain()
    for i, (r, ref) in enumerate(zip(_generate(engine, LONG), refs)):
        assert r["meta_info"]["cached_tokens"] >= 128
        assert_matches(r["output_ids"], ref, f"tier prompt {i}")
    engine.shutdown()


def test_a_draft_models_kv_comes_back_with_the_targets(tiny_llama, tmp_path):
    """The target drafting for itself keeps nearly every draft only if the draft's KV of the
    prefix read back from the tier is right too."""
    engine = _tiered(tiny_llama, tmp_path, speculative_draft_model=tiny_llama.path, draft_model=tiny_llama._model)
    _generate(engine, LONG)
    engine.scheduler.kv.tier.store.drain()
    spec = engine.scheduler.speculator
    proposed, accepted = spec.proposed, spec.accepted
    again = _generate(engine, LONG)
    assert all(r["meta_info"]["cached_tokens"] >= 128 for r in again)
    assert spec.proposed - proposed > 50 and spec.accepted - accepted >= 0.95 * (spec.proposed - proposed)
    engine.shutdown()


def test_smollm2_tokens_after_a_reload_are_hfs(smol, tmp_path):
    tok = smol.engine.tokenizer
    text = ("The committee met on Tuesday to review the budget for the coming year. " * 12
            + "In one sentence, what did the committee do?")
    prompt = tok.encode(smol.engine.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)
    ref = hf_greedy(smol.hf, [prompt], NEW_TOKENS)[0]
    engine = smol.engine_with(kv_tier_path=str(tmp_path), max_total_tokens=len(prompt) + 64, debug_accounting=True)
    engine.generate(input_ids=prompt, sampling_params=PARAMS)
    engine.generate(input_ids=random_prompts(1000, 1, seed=5, min_len=len(prompt), max_len=len(prompt))[0],
                    sampling_params=PARAMS)  # evicts the first prompt
    engine.scheduler.kv.tier.store.drain()
    r = engine.generate(input_ids=prompt, sampling_params=PARAMS)
    assert r["meta_info"]["cached_tokens"] >= len(prompt) // 64 * 64 - 64
    assert_matches(r["output_ids"], ref, "smollm2 after a reload from the tier")
    assert_drained(engine)
    engine.shutdown()


def test_a_restarted_server_finds_the_prefixes_it_had_cached(tiny_llama, tmp_path):
    """The served runtime: stopping it (SIGTERM to the scheduler process, between steps) saves
    what its tree holds; the next server on the same folder reports the prompt as cached."""
    from radixlm.runtime.engine import Engine

    options = dict(skip_tokenizer_init=True, kv_tier_path=str(tmp_path), max_total_tokens=2048)
    with Engine(tiny_llama.path, **options) as engine:
        first = engine.generate(input_ids=LONG[0], sampling_params=PARAMS)
        assert first["meta_info"]["cached_tokens"] == 0
    with Engine(tiny_llama.path, **options) as engine:
        again = engine.generate(input_ids=LONG[0], sampling_params=PARAMS)
        info = engine.server_info()
    assert again["meta_info"]["cached_tokens"] == (len(LONG[0]) - 1) // 64 * 64  # the last token is computed
    assert again["output_ids"] == first["output_ids"]
    assert info["kv_tier"]["hits"] == 1 and info["kv_tier"]["blocks"] >= len(LONG[0]) // 64
