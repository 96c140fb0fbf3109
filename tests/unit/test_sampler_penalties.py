"""Penalty tensors: the per-step build and the incremental ``PenaltyCounts``, against counts made
one token at a time in Python."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.worker.sampler import PenaltyCounts, SamplingBatch

VOCAB = 97


def python_seen(rows: list[list[int]]) -> torch.Tensor:
    seen = torch.zeros(len(rows), VOCAB, dtype=torch.bool)
    for i, ids in enumerate(rows):
        for t in ids:
            seen[i, t] = True
    return seen


def python_counts(rows: list[list[int]]) -> torch.Tensor:
    counts = torch.zeros(len(rows), VOCAB)
    for i, ids in enumerate(rows):
        for t, n in Counter(ids).items():
            counts[i, t] = n
    return counts


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) if rng.random() < 0.7 else 5 for _ in range(n)]  # many repeats of 5


def test_build_counts_each_row_and_leaves_other_rows_neutral() -> None:
    rng = random.Random(0)
    rows = 12
    prompts = [random_ids(rng, rng.choice([0, 1, 40])) for _ in range(rows)]
    outputs = [random_ids(rng, rng.choice([0, 3, 25])) for _ in range(rows)]
    params = [
        SamplingParams(repetition_penalty=1.3 if i % 3 else 1.0, frequency_penalty=0.5 if i % 2 else 0.0)
        for i in range(rows)
    ]
    batch = SamplingBatch.build(params, prompts, outputs, [0], VOCAB, "cpu")
    rep = [p.repetition_penalty != 1.0 for p in params]
    freq = [p.frequency_penalty != 0.0 for p in params]
    expected_seen = python_seen([pr + out if r else [] for pr, out, r in zip(prompts, outputs, rep)])
    assert torch.equal(batch.seen_mask, expected_seen)
    assert torch.equal(batch.output_counts, python_counts([out if f else [] for out, f in zip(outputs, freq)]))


def test_build_without_penalties_makes_no_tensors() -> None:
    batch = SamplingBatch.build([SamplingParams()] * 2, [[1, 2], [3]], [[4], []], [0], VOCAB, "cpu")
    assert batch.seen_mask is None and batch.output_counts is None and not batch.needs_processing


def test_penalty_counts_follow_requests_step_by_step() -> None:
    """Rows reset when a request takes them, grow by each step's tokens (several at once on a
    jump), and gather in any order to what a full rebuild from the lists gives."""
    rng = random.Random(1)
    counts = PenaltyCounts(max_rows=6, vocab_size=VOCAB, device="cpu")
    prompts = {row: random_ids(rng, rng.choice([0, 30])) for row in range(6)}
    outputs: dict[int, list[int]] = {row: random_ids(rng, 4) for row in range(6)}
    for row in range(6):
        counts.reset(row, prompts[row], outputs[row])
    for step in range(20):
        if step == 10:  # row 2 finishes; a new request takes it
            prompts[2], outputs[2] = random_ids(rng, 7), []
            counts.reset(2, prompts[2], outputs[2])
        rows = [r for r in range(6) for _ in range(3 if r == 4 and step % 5 == 0 else 1)]
        tokens = [rng.choice([5, rng.randrange(VOCAB)]) for _ in rows]
        counts.add(torch.tensor(rows), torch.tensor(tokens))
        for r, t in zip(rows, tokens):
            outputs[r].append(t)
    order = [3, 0, 5, 2]
    seen, output = counts.gather(torch.tensor(order))
    assert torch.equal(seen, python_seen([prompts[r] + outputs[r] for r in order]))
    assert torch.equal(output, python_counts([outputs[r] for r in order]))
    params = [SamplingParams(repetition_penalty=1.2, frequency_penalty=0.1)] * len(order)
    batch = SamplingBatch.build(params, [prompts[r] for r in order], [outputs[r] for r in order], [0], VOCAB, "cpu")
    assert torch.equal(seen, batch.seen_mask) and torch.equal(output, batch.output_counts)


def test_out_of_vocabulary_ids_are_refused_not_counted_in_the_next_row() -> None:
    params = [SamplingParams(repetition_penalty=1.2)] * 2
    with pytest.raises(AssertionError, match="outside"):
        SamplingBatch.build(params, [[VOCAB], [1]], [[], []], [0], VOCAB, "cpu")
