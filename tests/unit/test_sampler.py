from __future__ import annotations

import math
from typing import Sequence

import pytest
import torch

from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.worker.sampler import (
    Sampler,
    SamplingBatch,
    apply_logit_processors,
    filter_probs,
)

EOS = 0


def make_batch(
    params: Sequence[SamplingParams],
    vocab_size: int,
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
) -> SamplingBatch:
    prompts = prompts if prompts is not None else [[] for _ in params]
    outputs = outputs if outputs is not None else [[] for _ in params]
    return SamplingBatch.build(params, prompts, outputs, [EOS], vocab_size, "cpu")


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], **kwargs) -> torch.Tensor:
    batch = make_batch(params, logits.shape[-1], **kwargs)
    return Sampler()(logits, batch).next_token_ids


def repeat_row(probs: list[float], rows: int) -> torch.Tensor:
    return torch.tensor(probs).log().expand(rows, -1).contiguous()


@pytest.fixture(autouse=True)
def _fixed_global_seed() -> None:
    torch.manual_seed(0)


def test_greedy_equals_argmax_without_copy() -> None:
    logits = torch.randn(8, 50)
    batch = make_batch([SamplingParams(temperature=0.0)] * 8, 50)
    assert apply_logit_processors(logits, batch) is logits
    assert torch.equal(Sampler()(logits, batch).next_token_ids, logits.argmax(-1))


def test_top_k_one_equals_greedy_at_any_temperature() -> None:
    logits = torch.randn(16, 100)
    params = [SamplingParams(temperature=t, top_k=1) for t in torch.rand(16).mul(5).add(0.1).tolist()]
    assert torch.equal(sample(logits, params), logits.argmax(-1))


def test_mixed_greedy_and_sampled_rows() -> None:
    logits = torch.randn(6, 40)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=3.0) if i % 2 == 0
        else SamplingParams(temperature=1.5)
        for i in range(6)
    ]
    prompts = [[int(logits[i].argmax())] for i in range(6)]
    batch = make_batch(params, 40, prompts=prompts)
    ids = Sampler()(logits, batch).next_token_ids
    expected = apply_logit_processors(logits, batch).argmax(-1)
    assert torch.equal(ids[0::2], expected[0::2])
    # The penalty moved the greedy choice off the raw argmax.
    assert not torch.equal(ids[0::2], logits.argmax(-1)[0::2])


def test_seeded_row_is_independent_of_batch_composition() -> None:
    vocab = 1000
    for seed in range(20):
        row = torch.randn(vocab) * 0.5
        target = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
        alone = sample(row[None], [target], outputs=[[1, 2, 3]])
        others = [
            SamplingParams(temperature=0.7),
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=1.3, seed=seed + 1000, top_k=50),
            SamplingParams(temperature=0.9, min_p=0.05),
        ]
        logits = torch.cat([torch.randn(4, vocab), row[None]])
        outputs = [[5], [], [7, 7], [1, 2, 3, 4, 5], [1, 2, 3]]
        mixed = sample(logits, others + [target], outputs=outputs)
        first = sample(torch.cat([row[None], logits[:2]]), [target] + others[:2],
                       outputs=[[1, 2, 3], [], []])
        assert mixed[4] == alone[0] == first[0]


def test_seeded_noise_depends_on_seed_and_step() -> None:
    vocab, rows = 1000, 200
    logits = torch.zeros(rows, vocab)
    by_seed = sample(logits, [SamplingParams(seed=s) for s in range(rows)])
    assert len(set(by_seed.tolist())) > 150  # ~181 expected for 200 draws from 1000
    same = sample(logits, [SamplingParams(seed=7)] * rows)
    assert len(set(same.tolist())) == 1
    by_step = sample(logits, [SamplingParams(seed=7)] * rows, outputs=[[1] * i for i in range(rows)])
    assert len(set(by_step.tolist())) > 150


def test_unseeded_rows_draw_independently() -> None:
    ids = sample(torch.zeros(200, 1000), [SamplingParams()] * 200)
    assert len(set(ids.tolist())) > 150


@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_sampling_matches_softmax(seeded: bool) -> None:
    logits_row = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    temperature, draws = 0.7, 20_000 if not seeded else 5_000
    params = [SamplingParams(temperature=temperature, seed=i if seeded else None) for i in range(draws)]
    ids = sample(logits_row.expand(draws, -1).contiguous(), params)
    empirical = torch.bincount(ids, minlength=6).float() / draws
    expected = torch.softmax(logits_row / temperature, -1)
    # ~4.5 standard deviations of the largest-variance cell.
    tolerance = 4.5 * math.sqrt(0.25 / draws)
    assert torch.allclose(empirical, expected, atol=tolerance), (empirical, expected)


PROBS = [0.4, 0.25, 0.2, 0.1, 0.05]


def support(params: SamplingParams, probs: list[float] = PROBS, rows: int = 4000) -> set[int]:
    """Tokens drawn over many rows; with these sizes every kept token appears."""
    logits = repeat_row(probs, rows)
    return set(sample(logits, [params] * rows).tolist())


def kept(params: SamplingParams, probs: list[float] = PROBS) -> set[int]:
    batch = make_batch([params], len(probs))
    filtered = filter_probs(torch.tensor([probs]), batch)
    return set(filtered[0].nonzero().flatten().tolist())


@pytest.mark.parametrize(
    "params, expected",
    [
        (SamplingParams(top_p=0.6), {0, 1}),
        (SamplingParams(top_p=0.7), {0, 1, 2}),
        (SamplingParams(top_p=0.1), {0}),
        (SamplingParams(top_p=1.0), {0, 1, 2, 3, 4}),
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_k=4), {0, 1, 2, 3}),
        (SamplingParams(min_p=0.3), {0, 1, 2}),  # floor 0.12
        (SamplingParams(min_p=0.6), {0, 1}),  # floor 0.24
        # top-p is taken over the top-k mass (0.85): 0.45 * 0.85 < 0.4 keeps one.
        (SamplingParams(top_k=3, top_p=0.45), {0}),
        (SamplingParams(top_k=3, top_p=0.5), {0, 1}),
        (SamplingParams(top_p=0.7, min_p=0.55), {0, 1}),
    ],
)
def test_filters_restrict_support_exactly(params: SamplingParams, expected: set[int]) -> None:
    assert kept(params) == expected
    assert support(params) == expected


def test_filters_apply_per_row() -> None:
    params = [SamplingParams(top_k=1 + i % 5, temperature=2.0) for i in range(2000)]
    ids = sample(repeat_row(PROBS, 2000), params)
    for k in range(1, 6):
        assert set(ids[k - 1 :: 5].tolist()) == set(range(k))


def test_repetition_penalty_divides_positive_multiplies_negative() -> None:
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0, 0.5]] * 2)
    params = [SamplingParams(repetition_penalty=2.0), SamplingParams()]
    batch = make_batch(params, 5, prompts=[[0], [0]], outputs=[[1], [1]])
    out = apply_logit_processors(logits, batch)
    assert torch.equal(out[0], torch.tensor([1.0, -4.0, 3.0, -1.0, 0.5]))
    assert torch.equal(out[1], logits[1])


def test_frequency_and_presence_count_output_tokens_only() -> None:
    logits = torch.zeros(2, 5)
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), SamplingParams()]
    batch = make_batch(params, 5, prompts=[[4], [4]], outputs=[[2, 2, 3], [2, 2, 3]])
    out = apply_logit_processors(logits, batch)
    assert torch.allclose(out[0], torch.tensor([0.0, 0.0, -1.25, -0.75, 0.0]))
    assert torch.equal(out[1], logits[1])


def test_processors_leave_input_untouched() -> None:
    logits = torch.randn(3, 20)
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0, logit_bias={3: 5.0},
                             min_new_tokens=2)] * 3
    batch = make_batch(params, 20, prompts=[[1, 2]] * 3, outputs=[[3]] * 3)
    Sampler()(logits, batch)
    assert torch.equal(logits, before)


def test_logit_bias_forces_token() -> None:
    logits = torch.randn(64, 30) * 3
    params = [SamplingParams(logit_bias={"7": 100.0}, temperature=t) for t in (0.0, 1.0)] * 32
    assert (sample(logits, params) == 7).all()


def test_min_new_tokens_blocks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(4, 10)
    logits[:, EOS] = 50.0
    logits[:, 3] = 40.0
    logits[:, 5] = 30.0
    params = SamplingParams(min_new_tokens=3, stop_token_ids=[3], temperature=0.0)
    ignoring = SamplingParams(min_new_tokens=3, stop_token_ids=[3], ignore_eos=True, temperature=1.0)
    outputs = [[1, 1], [1, 1, 1], [1, 1], [1, 1, 1]]
    ids = sample(logits, [params, params, ignoring, ignoring], outputs=outputs)
    assert ids.tolist() == [5, EOS, 5, EOS]


def test_logprobs_are_of_raw_distribution() -> None:
    logits = torch.randn(8, 30)
    params = [SamplingParams(temperature=0.5, repetition_penalty=1.3, logit_bias={1: 2.0})] * 8
    batch = make_batch(params, 30, prompts=[[1, 2, 3]] * 8)
    out = Sampler()(logits, batch, return_logprob=True, top_logprobs_num=4)
    raw = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs, raw.gather(1, out.next_token_ids[:, None]).squeeze(1))
    top = torch.topk(raw, 4, dim=-1)
    assert torch.allclose(out.top_logprobs, top.values)
    assert torch.equal(out.top_logprob_ids, top.indices)


def test_logprobs_only_when_requested() -> None:
    logits = torch.randn(2, 10)
    batch = make_batch([SamplingParams()] * 2, 10)
    out = Sampler()(logits, batch)
    assert out.logprobs is None and out.top_logprobs is None and out.top_logprob_ids is None
    out = Sampler()(logits, batch, top_logprobs_num=3)
    assert out.logprobs is None and out.top_logprobs.shape == (2, 3)
