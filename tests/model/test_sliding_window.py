"""Sliding-window models (Gemma 2/3, gpt-oss): the sliding layers keep only about a window of each
request's K/V (window pages, cache/allocator.WindowedPageAllocator), the global layers all of it,
and the radix cache matches a prefix only as far as its last window is still held.

The tiny Gemma 3 and gpt-oss slide over 8 tokens beside global layers; prompts here are 200
tokens, so nearly all of a request's sliding K/V is given back while it runs. HF fp32 is the
oracle of every output, KV accounting (with the window pages' own invariants) is checked after
each workload."""

from __future__ import annotations

import random

import pytest

from conftest import NEW_TOKENS, TINY_VOCAB
from helpers import assert_drained
from oracle import assert_matches, hf_greedy

GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0}
LONG = 200


def _random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, TINY_VOCAB) for _ in range(n)]


def _peak_bound(kv) -> dict:
    """Record the most window pages bound at once (after every allocation)."""
    alloc, seen = kv.allocator, {"peak": 0}
    take = alloc.alloc

    def recording(n):
        pages = take(n)
        seen["peak"] = max(seen["peak"], alloc.num_bound_pages)
        return pages

    alloc.alloc = recording
    return seen


@pytest.mark.parametrize("tiny,backend,page_size,chunk", [("gemma3", "torch", 1, 64), ("gpt_oss", "native", 4, 1024),
                                                         ("gpt_oss", "deterministic", 1, 48)], indirect=["tiny"])
def test_long_requests_hold_a_window_of_sliding_kv_and_match_hf(tiny, backend, page_size, chunk):
    kwargs = {"deterministic": True} if backend == "deterministic" else {"attention_backend": backend}
    engine = tiny.engine(page_size=page_size, chunked_prefill_size=chunk, overlap_schedule="off", **kwargs)
    try:
        kv = engine.scheduler.kv
        assert kv.window == 8, "the tiny model's sliding layers keep window pages"
        seen = _peak_bound(kv)
        prompts = [_random_tokens(LONG, seed) for seed in range(3)]
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        for i, (res, ref) in enumerate(zip(results, hf_greedy(tiny.hf, prompts, NEW_TOKENS))):
            assert_matches(res["output_ids"], ref, f"{tiny.kind}, long prompt {i}")
        assert_drained(engine)

        # Held now, in the tree: every token for the global layers, and for the sliding ones the
        # last window (plus the rollback margin and a granule) of each prompt and of each output.
        P, n = kv.page_size, len(prompts)
        tail = kv._keep + kv._granule + P
        cached = (kv.cache.evictable_pages + kv.cache.locked_pages) * P
        assert cached >= sum(LONG + len(r["output_ids"]) - 1 - P for r in results)
        assert kv.window_bound_tokens <= n * 2 * tail, (kv.window_bound_tokens, cached)
        # While they ran: a window and a chunk each (whole prompts are bound while they prefill)
        assert seen["peak"] * P <= n * (tail + min(chunk, LONG) + P) + n * tail, (seen["peak"] * P, cached)

        # The next turn of each conversation finds all of it: its last window is held
        turns = [p + r["output_ids"] + _random_tokens(20, 10 + i) for i, (p, r) in enumerate(zip(prompts, results))]
        # and a prompt that shares only the first 120 tokens of one, whose window pages are gone,
        # finds nothing: its new tokens would read keys no longer held (a window-less match would
        # serve them garbage)
        early = prompts[0][:120] + _random_tokens(30, 20)
        again = engine.generate(input_ids=turns + [early], sampling_params=GREEDY)
        for i, (res, ref) in enumerate(zip(again, hf_greedy(tiny.hf, turns + [early], NEW_TOKENS))):
            assert_matches(res["output_ids"], ref, f"{tiny.kind}, second turn {i}")
        for turn, prompt, res in zip(again, prompts, results):
            history = len(prompt) + len(res["output_ids"]) - 1
            assert turn["meta_info"]["cached_tokens"] >= history // P * P
        assert again[-1]["meta_info"]["cached_tokens"] == 0
        assert_drained(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("tiny", ["gemma3"], indirect=True)
def test_a_prompt_that_another_ran_past_reads_the_window_it_computed(tiny):
    """Two prompts in one step, X + Y and X: the longer goes into the tree first, its window pages
    of X's end already given back; X's own copy of them is freed as a duplicate, and X reads the
    tree's pages from then on, so its still-bound window pages move to them. The accounting
    (window rows included) is checked after every step."""
    engine = tiny.engine(schedule_policy="fcfs", chunked_prefill_size=1024, overlap_schedule="off",
                         attention_backend="torch", debug_accounting=True)
    try:
        x = _random_tokens(LONG, 30)
        prompts = [x + _random_tokens(60, 31), x]
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert engine.scheduler.kv.window == 8
        for i, (res, ref) in enumerate(zip(results, hf_greedy(tiny.hf, prompts, NEW_TOKENS))):
            assert_matches(res["output_ids"], ref, f"prompt {i} of a pair sharing {LONG} tokens")
        assert_drained(engine)
    finally:
        engine.shutdown()


def test_the_native_decoder_reads_window_pages_when_every_layer_slides(tmp_path):
    """A Mistral whose every layer slides (window 8) on int8 codes: its decode steps run in the
    native decoder, which stores and reads the window space alone. The same weights through the
    torch attention backend (the step op by op, the same int8 matmuls) give the same tokens."""
    from conftest import make_tiny_checkpoint
    from radixlm.runtime.local_engine import LocalEngine

    make_tiny_checkpoint("mistral", str(tmp_path), sliding_window=8)
    prompts = [_random_tokens(LONG, seed) for seed in (40, 41)]
    outputs = []
    for backend in ("native", "torch"):
        engine = LocalEngine(str(tmp_path), skip_tokenizer_init=True, quantization="int8", attention_backend=backend,
                             max_total_tokens=4096, overlap_schedule="off", debug_accounting=True)
        try:
            kv = engine.scheduler.kv
            assert kv.window == 8
            results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
            decoder = engine.worker.native_decoder
            assert (decoder is not None and decoder.steps > 0) == (backend == "native")
            assert kv.window_bound_tokens <= len(prompts) * 2 * (kv._keep + kv._granule + kv.page_size)
            assert_drained(engine)
            outputs.append([r["output_ids"] for r in results])
        finally:
            engine.shutdown()
    assert outputs[0] == outputs[1]
