"""The scheduler's penalty counts kept across steps against counting every id afresh each step."""

from __future__ import annotations

import random

import torch

from radixlm.runtime.messages import TokenizedRequest
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler.batch import PenaltyTracker
from radixlm.runtime.scheduler.req import Req
from radixlm.runtime.worker.sampler import SamplingBatch

VOCAB = 64


def _fresh(reqs: list[Req]) -> tuple[torch.Tensor, torch.Tensor]:
    b = SamplingBatch.build([r.params for r in reqs], [r.prompt_ids for r in reqs], [r.output_ids for r in reqs],
                            [0], VOCAB, "cpu")
    return b.seen_mask, b.output_counts


def test_kept_counts_equal_fresh_counts_through_rows_reused_retractions_and_rewrites():
    rng = random.Random(0)
    params = SamplingParams(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1)
    tracker = PenaltyTracker(rows=4, vocab_size=VOCAB, device=torch.device("cpu"))
    reqs = []
    for i in range(6):
        r = Req(TokenizedRequest(f"r{i}", [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))], params), i)
        reqs.append(r)
    free_rows = [0, 1, 2, 3]
    running: list[Req] = []
    waiting = list(reqs)
    for step in range(60):
        while waiting and free_rows and rng.random() < 0.7:  # admit (a retracted one keeps its outputs)
            r = waiting.pop(0)
            r.row = free_rows.pop(rng.randrange(len(free_rows)))
            running.append(r)
        if not running:
            continue
        seen, counts = tracker.counts_for(running)
        want_seen, want_counts = _fresh(running)
        assert torch.equal(seen, want_seen) and torch.equal(counts, want_counts), f"step {step}"
        for r in running:
            r.output_ids.append(rng.randrange(VOCAB))
        if rng.random() < 0.15:  # jump-forward rewrites a request's last outputs in place
            r = rng.choice(running)
            keep = max(len(r.output_ids) - 3, 0)
            r.output_ids[keep:] = [rng.randrange(VOCAB) for _ in range(4)]
            r.penalty_counted = -1
        if rng.random() < 0.2:  # retraction or finish: the row goes to someone else
            r = running.pop(rng.randrange(len(running)))
            free_rows.append(r.row)
            r.row = None
            if rng.random() < 0.5:
                waiting.append(r)


def test_requests_without_penalties_build_nothing():
    tracker = PenaltyTracker(rows=2, vocab_size=VOCAB, device=torch.device("cpu"))
    r = Req(TokenizedRequest("plain", [1, 2, 3], SamplingParams(temperature=0.5)), 0)
    r.row = 0
    assert tracker.counts_for([r]) is None and tracker._counts is None
