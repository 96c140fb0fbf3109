"""The CUDA-graph decode path's buffers and padding, run eagerly on the CPU (cuda_graph.py): decode
steps go through the runner's static buffers, padded to their bucket, and give the tokens of
the plain path: HF's greedy tokens, and under --deterministic bitwise the plain engine's tokens
and logprobs. A padding row that wrote its K/V anywhere but the pool's spare page would
overwrite a real request's KV and change its tokens."""

from __future__ import annotations

import pytest

from conftest import NEW_TOKENS
from helpers import assert_drained
from oracle import assert_matches
from radixlm.runtime.args import ServerArgs
from radixlm.runtime.worker.cuda_graph import DecodeGraphRunner, buckets, graph_batch_limit


def _params(n: int) -> list[dict]:
    # different lengths: the decode batch shrinks 5 -> 1 and crosses buckets 8, 4, 2 and 1
    return [{"max_new_tokens": NEW_TOKENS - 5 * i, "temperature": 0, "ignore_eos": True} for i in range(n)]


def _with_runner(engine, max_bs: int = 16) -> DecodeGraphRunner:
    worker = engine.worker
    assert worker.graph_runner is None  # a CPU captures nothing by itself
    worker.graph_runner = DecodeGraphRunner(worker, max_bs)
    return worker.graph_runner


def test_buckets_end_at_the_largest_batch():
    assert buckets(1) == [1]
    assert buckets(10) == [1, 2, 4, 8, 10]
    assert buckets(160)[-2:] == [128, 160] and buckets(13)[-2:] == [12, 13]


def test_every_decode_batch_the_scheduler_runs_has_a_graph():
    """By default graphs are captured up to the largest running batch (batches between the old
    fixed 160 and --max-running-requests' 256 ran eagerly); a smaller --cuda-graph-max-bs holds, a
    larger one is cut to what can run."""
    assert graph_batch_limit(ServerArgs()) == ServerArgs().max_running_requests == 256
    assert graph_batch_limit(ServerArgs(max_running_requests=300)) == 300
    assert buckets(graph_batch_limit(ServerArgs()))[-1] == 256
    assert graph_batch_limit(ServerArgs(cuda_graph_max_bs=48)) == 48
    assert graph_batch_limit(ServerArgs(cuda_graph_max_bs=512, max_running_requests=64)) == 64


@pytest.mark.parametrize("page_size", [1, 4])
def test_padded_static_decode_steps_match_hf(tiny_llama, page_size):
    engine = tiny_llama.engine(page_size=page_size)
    runner = _with_runner(engine)
    prompts = tiny_llama.prompts[:5]
    results = engine.generate(input_ids=prompts, sampling_params=_params(5))
    for i, (res, ref) in enumerate(zip(results, tiny_llama.refs)):
        assert_matches(res["output_ids"], ref.truncated(NEW_TOKENS - 5 * i), f"prompt {i}")
    assert runner.replays >= NEW_TOKENS - 1, "decode steps did not go through the runner"
    assert_drained(engine)


@pytest.mark.parametrize("page_size", [1, 4])
def test_padding_changes_no_bit_under_deterministic(tiny_llama, page_size):
    plain = tiny_llama.engine(page_size=page_size, deterministic=True)
    graphed = tiny_llama.engine(page_size=page_size, deterministic=True)
    runner = _with_runner(graphed, max_bs=6)  # buckets 1, 2, 4, 6: every batch but 1, 2 and 4 padded
    prompts = tiny_llama.prompts[:5]
    want = plain.generate(input_ids=prompts, sampling_params=_params(5), return_logprob=True)
    got = graphed.generate(input_ids=prompts, sampling_params=_params(5), return_logprob=True)
    for w, g in zip(want, got):
        assert g["output_ids"] == w["output_ids"]
        assert g["meta_info"]["output_token_logprobs"] == w["meta_info"]["output_token_logprobs"]
    assert runner.replays > 0
    # with more requests than the largest bucket, steps run the plain path and join the runner later
    more = tiny_llama.prompts[:9]
    params = (_params(5) * 2)[:9]
    want = plain.generate(input_ids=more, sampling_params=params)
    got = graphed.generate(input_ids=more, sampling_params=params)
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert_drained(plain)
    assert_drained(graphed)
