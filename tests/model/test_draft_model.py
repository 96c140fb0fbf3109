"""Speculative decoding from a draft model (`--speculative-draft-model`), on tiny checkpoints.

The target is the tiny Llama; the drafts come from its first layer alone (the same embeddings,
norm and head: a draft that agrees with the target some of the time, so verifies both keep and
reject), from a different model of the same vocabulary (rejects nearly all), or from the target
itself (keeps nearly all: any error in the draft's KV, which lives in the target's pages, would
show as rejections). Under --deterministic the outputs must be bitwise plain decoding's,
whatever the draft proposed.
"""

from __future__ import annotations

import pytest
import torch

from conftest import NEW_TOKENS, TINY_VOCAB, make_tiny_checkpoint
from helpers import assert_drained
from oracle import assert_matches, random_prompts


@pytest.fixture(scope="module")
def truncated(tiny_llama, tmp_path_factory) -> str:
    """The tiny Llama's first layer as a checkpoint of its own."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama.path, dtype=torch.float32)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    path = str(tmp_path_factory.mktemp("tiny-llama-first-layer"))
    model.save_pretrained(path)
    return path


PARAMS = [{"max_new_tokens": 40, "temperature": 0},
          {"max_new_tokens": 40, "temperature": 0.9, "top_k": 50, "seed": 11},
          {"max_new_tokens": 40, "temperature": 0, "min_new_tokens": 30, "stop_token_ids": [5, 9]},
          {"max_new_tokens": 24, "temperature": 0.7, "seed": 3}]


def _outcome(results: list[dict]) -> list[tuple]:
    return [(r["output_ids"], r["meta_info"]["output_token_logprobs"], r["meta_info"]["finish_reason"])
            for r in results]


def _run(engine, prompts: list[list[int]], params: list[dict]) -> list[dict]:
    results = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    assert_drained(engine)
    return results


def _stats(engine) -> dict:
    return engine.scheduler.speculator.stats()


@pytest.mark.parametrize("page_size", [1, 4])
def test_outputs_are_bitwise_those_of_plain_decoding(tiny_llama, truncated, page_size):
    prompts = tiny_llama.prompts[:8]
    params = [PARAMS[i % len(PARAMS)] for i in range(len(prompts))]
    plain = _run(tiny_llama.engine(deterministic=True, page_size=page_size), prompts, params)
    engine = tiny_llama.engine(deterministic=True, page_size=page_size, speculative_draft_model=truncated,
                               debug_accounting=True)
    assert engine.args.speculative == "draft"  # the draft model alone turns it on
    spec = _run(engine, prompts, params)
    assert _outcome(spec) == _outcome(plain)
    stats = _stats(engine)
    assert 0 < stats["accepted_tokens"] < stats["proposed_tokens"], stats  # kept some, rejected some
    verified = [r["meta_info"] for r in spec if r["meta_info"].get("spec_verify_ct")]
    assert verified
    for meta in verified:
        assert meta["completion_tokens"] >= meta["spec_verify_ct"] + meta["spec_accepted_tokens"]


def test_the_target_as_its_own_draft_keeps_nearly_everything(tiny_llama):
    """The draft's KV is written into the target's pages by the step that computes the target's:
    prefill chunks, decode rows, verify rows and prefixes shared from the cache. The target
    drafting for itself keeps what it proposes only if all of that KV is right."""
    prompts = tiny_llama.shared_prompts  # one 64-token prefix: the second and later share it from the cache
    engine = tiny_llama.engine(speculative_draft_model=tiny_llama.path, draft_model=tiny_llama._model,
                               chunked_prefill_size=32, debug_accounting=True)
    for _ in range(2):  # the second round's prompts come wholly from the cache, draft KV included
        before = dict(_stats(engine))
        results = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0})
        assert_drained(engine)
        stats = _stats(engine)
        proposed = stats["proposed_tokens"] - before["proposed_tokens"]
        accepted = stats["accepted_tokens"] - before["accepted_tokens"]
        assert proposed > 100 and accepted >= 0.95 * proposed, (proposed, accepted)
    for i, (r, ref) in enumerate(zip(results, tiny_llama.shared_refs)):
        assert_matches(r["output_ids"], ref, f"self-drafted prompt {i}")


def test_greedy_tokens_match_hf_and_an_unrelated_draft_costs_nothing_but_time(tiny_llama, tmp_path):
    """A draft of another architecture, same vocabulary: its proposals are nearly all rejected,
    and the tokens are still HF's."""
    other = str(tmp_path / "qwen3")
    make_tiny_checkpoint("qwen3", other)
    engine = tiny_llama.engine(speculative_draft_model=other, debug_accounting=True)
    results = engine.generate(input_ids=tiny_llama.prompts,
                              sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0})
    assert_drained(engine)
    for i, (r, ref) in enumerate(zip(results, tiny_llama.refs)):
        assert_matches(r["output_ids"], ref, f"drafted prompt {i}")
    stats = _stats(engine)
    assert stats["verify_rows"] > 0 and stats["accepted_tokens"] < 0.2 * stats["proposed_tokens"]


def test_retraction_in_a_small_pool(tiny_llama, truncated):
    """Requests step back when the pool is full, drafts or not; the draft's KV shares the pages."""
    prompts = random_prompts(TINY_VOCAB, 8, seed=23, min_len=40, max_len=60)
    params = {"max_new_tokens": 96, "temperature": 0, "ignore_eos": True}
    small = dict(deterministic=True, max_total_tokens=400, chunked_prefill_size=64, init_new_token_ratio=0.0,
                 min_new_token_ratio=0.0)
    plain = _run(tiny_llama.engine(**small), prompts, [params] * len(prompts))
    engine = tiny_llama.engine(speculative_draft_model=truncated, debug_accounting=True, **small)
    spec = _run(engine, prompts, [params] * len(prompts))
    assert [r["output_ids"] for r in spec] == [r["output_ids"] for r in plain]
    assert engine.scheduler.num_retractions > 0
    assert _stats(engine)["accepted_tokens"] > 0


def test_the_pool_holds_both_models_kv_in_the_same_slots(tiny_llama, truncated, monkeypatch):
    """Sized from the memory asked for, the pool's tokens pay for the draft's layers too."""
    from radixlm.runtime.worker import model_worker

    free = {"SC_AVPHYS_PAGES": 1 << 20, "SC_PAGE_SIZE": 4096}  # 4 GiB free, whatever this machine has now
    monkeypatch.setattr(model_worker.os, "sysconf", lambda name: free[name])
    plain = tiny_llama.engine(max_total_tokens=0, mem_fraction=0.01)
    drafted = tiny_llama.engine(max_total_tokens=0, mem_fraction=0.01, speculative_draft_model=truncated)
    worker = drafted.worker
    # the tiny Llama has 2 layers, its draft 1 of the same shape: 2/3 of the tokens fit
    assert abs(worker.num_pages / plain.worker.num_pages - 2 / 3) < 1e-3
    assert worker.draft.kv_pool.num_slots == worker.kv_pool.num_slots
    assert len(worker.draft.kv_pool.k) == 1 and len(worker.kv_pool.k) == 2


def test_a_draft_of_another_vocabulary_is_refused(tiny_llama, tmp_path):
    other = str(tmp_path / "small-vocab")
    make_tiny_checkpoint("llama", other, vocab_size=TINY_VOCAB // 2)
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        tiny_llama.engine(speculative_draft_model=other)
