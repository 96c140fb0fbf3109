"""The same greedy tokens whatever the batch composition, chunk size, page size, cache and pool size."""

from __future__ import annotations

import pytest

from oracle import assert_matches
from conftest import NEW_TOKENS
from helpers import assert_drained
from radixlm.runtime.messages import TokenizedRequest
from radixlm.runtime.sampling_params import SamplingParams

CONFIGS = {
    "page1-nochunk": dict(page_size=1, chunked_prefill_size=-1),
    "page16-chunk16": dict(page_size=16, chunked_prefill_size=16),
    "page16-chunk64-nocache": dict(page_size=16, chunked_prefill_size=64, disable_radix_cache=True),
    "page1-chunk16-nocache": dict(page_size=1, chunked_prefill_size=16, disable_radix_cache=True),
    "page4-chunk32-fcfs": dict(page_size=4, chunked_prefill_size=32, schedule_policy="fcfs"),
    "page1-dfs-weight": dict(page_size=1, schedule_policy="dfs-weight", chunked_prefill_size=64),
    "page16-lof": dict(page_size=16, schedule_policy="lof"),
    # a pool too small for all requests, admitted optimistically, so decode must retract
    "page1-retract": dict(page_size=1, max_total_tokens=400, init_new_token_ratio=0.02, min_new_token_ratio=0.0),
    "page16-retract": dict(page_size=16, max_total_tokens=480, init_new_token_ratio=0.02, min_new_token_ratio=0.0,
                           chunked_prefill_size=32),
}


def _requests(prompts, tag):
    return [TokenizedRequest(f"{tag}-{i}", p, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0))
            for i, p in enumerate(prompts)]


def _run(engine, prompts, mode, tag):
    """Outputs by prompt index for one arrival pattern."""
    reqs = _requests(prompts, tag)
    if mode == "all":
        results = engine.run(reqs)
    elif mode == "groups-of-4":
        results = [r for i in range(0, len(reqs), 4) for r in engine.run(reqs[i : i + 4])]
    elif mode == "one-by-one":
        results = [engine.run([r])[0] for r in reqs]
    else:  # staggered: a new arrival every step while earlier ones decode
        results = _staggered(engine.scheduler, reqs)
    return [r["output_ids"] for r in results]


def _staggered(sched, reqs):
    done: dict[str, list[int]] = {r.rid: [] for r in reqs}
    pending, finished = list(reqs), set()
    while len(finished) < len(reqs):
        if pending:
            sched.add_request(pending.pop(0))
        for out in sched.step():
            done[out.rid].extend(out.new_token_ids)
            if out.finished:
                finished.add(out.rid)
    return [{"output_ids": done[r.rid]} for r in reqs]


@pytest.mark.parametrize("mode", ["all", "groups-of-4", "one-by-one", "staggered"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_same_tokens(tiny_llama, config, mode):
    engine = tiny_llama.engine(**CONFIGS[config])
    for attempt in ("cold", "warm"):  # the second pass hits the prefix cache (unless disabled)
        outs = _run(engine, tiny_llama.prompts, mode, attempt)
        for i, (out, ref) in enumerate(zip(outs, tiny_llama.refs)):
            assert_matches(out, ref, f"{config}/{mode}/{attempt} prompt {i}")
        assert_drained(engine)
    if "retract" in config and mode in ("all", "staggered"):
        assert engine.scheduler.num_retractions > 0, "the small pool was meant to force retraction"


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_length_buckets(tiny_llama, monkeypatch, page_size):
    """Decode batches split into length buckets (forced here: a bucket costs nothing) give the same tokens."""
    from radixlm.runtime.worker.attention import torch_backend

    monkeypatch.setattr(torch_backend, "BUCKET_COST_KEYS", 0)
    buckets = []
    prepare = torch_backend._prepare_decode

    def counting(*args):
        plan = prepare(*args)
        buckets.append(len(plan[0]))
        return plan

    monkeypatch.setattr(torch_backend, "_prepare_decode", counting)
    engine = tiny_llama.engine(page_size=page_size, disable_radix_cache=True)
    for i, (out, ref) in enumerate(zip(_run(engine, tiny_llama.prompts, "all", "buckets"), tiny_llama.refs)):
        assert_matches(out, ref, f"length buckets, page {page_size}, prompt {i}")
    assert_drained(engine)
    assert buckets and max(buckets) > 1, "the batch was meant to decode in several length buckets"


def test_smollm2_page16_chunked_nocache_matches_hf(smol):
    engine = smol.engine_with(page_size=16, chunked_prefill_size=24, disable_radix_cache=True)
    results = engine.generate(input_ids=smol.prompts, sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0})
    for i, (r, ref) in enumerate(zip(results, smol.refs)):
        assert_matches(r["output_ids"], ref, f"smollm2 page16 prompt {i}")
    assert_drained(engine)


def test_dummy_weights_need_only_a_config(tiny_llama, tmp_path):
    """`--load-format dummy` (for benchmarks) builds the config's model with random weights: a
    directory holding config.json alone serves, deterministically for a seed."""
    import shutil

    from radixlm.runtime.local_engine import LocalEngine

    shutil.copy(f"{tiny_llama.path}/config.json", tmp_path / "config.json")
    outs = []
    for _ in range(2):
        engine = LocalEngine(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, max_total_tokens=2048)
        outs.append(engine.generate(input_ids=tiny_llama.prompts[:2], sampling_params={"max_new_tokens": 6, "temperature": 0}))
    assert [r["output_ids"] for r in outs[0]] == [r["output_ids"] for r in outs[1]]
    assert all(len(r["output_ids"]) == 6 for r in outs[0])
