"""top-k / top-p / min-p through ``topk`` candidates, against the full-vocabulary sort they replace."""

from __future__ import annotations

import random

import pytest
import torch

from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.worker.sampler import Sampler, SamplingBatch, filter_probs, top_k_candidates

VOCAB = 300


def reference_filter(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The sampler's filters as they were: one full sort of every row, settings read per row."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    top_ks = torch.tensor([p.top_k if p.top_k >= 1 else probs.shape[-1] for p in params])
    ranks = torch.arange(probs.shape[-1])
    sorted_probs = sorted_probs.masked_fill(ranks >= top_ks[:, None], 0.0)
    top_ps = torch.tensor([p.top_p for p in params])[:, None]
    cumulative = sorted_probs.cumsum(dim=-1)
    drop = (cumulative - sorted_probs >= top_ps * cumulative[:, -1:]) & (top_ps < 1)
    filtered = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(drop, 0.0))
    min_ps = torch.tensor([p.min_p for p in params])[:, None]
    return filtered.masked_fill(filtered < min_ps * filtered.amax(dim=-1, keepdim=True), 0.0)


KINDS = {
    "plain": lambda r: SamplingParams(),
    "greedy": lambda r: SamplingParams(temperature=0.0, top_k=r.choice([-1, 5])),
    "top_k": lambda r: SamplingParams(top_k=r.choice([2, 7, 50, 120])),
    "top_k_over_vocab": lambda r: SamplingParams(top_k=1000),  # keeps every token: no top-k
    "top_k_top_p": lambda r: SamplingParams(top_k=r.choice([3, 40, 120]), top_p=r.choice([0.3, 0.8, 0.95])),
    "top_k_min_p": lambda r: SamplingParams(top_k=r.choice([10, 80]), min_p=0.2),
    "top_p": lambda r: SamplingParams(top_p=r.choice([0.5, 0.9])),
    "min_p": lambda r: SamplingParams(min_p=0.1),
}
BATCHES = {  # -> the path filter_probs takes
    ("top_k",): "candidates",
    ("top_k", "greedy"): "candidates",
    ("top_k", "top_k_top_p", "top_k_min_p"): "candidates",
    ("top_k", "plain", "top_k_top_p"): "topk beside whole rows",
    ("top_k", "min_p", "greedy"): "topk beside whole rows",
    ("top_k_top_p", "top_k_over_vocab"): "topk beside whole rows",
    ("top_p",): "full sort",
    ("top_k", "top_k_top_p", "top_p", "plain", "greedy", "min_p"): "full sort",
}


def random_batch(kinds: tuple[str, ...], rows: int, seed: int) -> tuple[torch.Tensor, list[SamplingParams]]:
    rng = random.Random(seed)
    params = [KINDS[kinds[i % len(kinds)]](rng) for i in range(rows)]
    probs = torch.softmax(torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2, -1)
    return probs, params


def build(params: list[SamplingParams]) -> SamplingBatch:
    return SamplingBatch.build(params, [[] for _ in params], [[] for _ in params], [0], VOCAB, "cpu")


@pytest.mark.parametrize("kinds", list(BATCHES))
def test_filters_keep_what_the_full_sort_kept(kinds: tuple[str, ...]) -> None:
    for seed in range(5):
        probs, params = random_batch(kinds, 24, seed)
        batch = build(params)
        path = "full sort" if batch.need_full_sort else "candidates" if batch.all_top_k else "topk beside whole rows"
        assert path == BATCHES[kinds]
        sampled = [i for i, p in enumerate(params) if p.temperature > 0 and p.top_k != 1]
        got, expected = filter_probs(probs, batch)[sampled], reference_filter(probs, params)[sampled]
        assert torch.equal(got, expected), (kinds, seed)


@pytest.mark.parametrize("kinds", [k for k, path in BATCHES.items() if path == "candidates"])
def test_top_k_candidates_keep_what_the_full_sort_kept(kinds: tuple[str, ...]) -> None:
    """The race's own candidates (softmax over the top-k logits alone): the same tokens kept, with
    the same probabilities once renormalised."""
    for seed in range(5):
        _, params = random_batch(kinds, 24, seed)
        logits = torch.randn(24, VOCAB, generator=torch.Generator().manual_seed(100 + seed)) * 3
        for i, p in enumerate(params):
            params[i] = SamplingParams(**{**p.to_dict(), "temperature": p.temperature and 0.5 + i / 10})
        batch = build(params)
        probs, token_ids = top_k_candidates(logits, batch)
        got = torch.zeros(24, VOCAB).scatter_(-1, token_ids, probs)
        temperatures = torch.tensor([p.temperature or 1.0 for p in params])[:, None]
        expected = reference_filter(torch.softmax(logits / temperatures, -1), params)
        sampled = [i for i, p in enumerate(params) if p.temperature > 0 and p.top_k != 1]
        got, expected = got[sampled], expected[sampled]
        assert torch.equal(got > 0, expected > 0), (kinds, seed)
        torch.testing.assert_close(got / got.sum(-1, keepdim=True), expected / expected.sum(-1, keepdim=True))


@pytest.mark.parametrize("kinds", [k for k, path in BATCHES.items() if path != "full sort"])
def test_top_k_batches_sort_nothing(kinds: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a full sort where topk serves")

    monkeypatch.setattr(torch.Tensor, "sort", refuse)
    probs, params = random_batch(kinds, 12, 0)
    Sampler()(probs.log(), build(params))


def test_ties_at_the_kth_probability_keep_exactly_k() -> None:
    """Which of the tied tokens survives is arbitrary, as it was with the (unstable) full sort."""
    probs = torch.tensor([[0.3, 0.1, 0.1, 0.2, 0.1, 0.1, 0.1]])
    kept = filter_probs(probs, build([SamplingParams(top_k=3)]))
    assert int((kept > 0).sum()) == 3
    assert kept[0, 0] == 0.3 and kept[0, 3] == 0.2 and float(kept[0].sum()) == pytest.approx(0.6)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=4),
        SamplingParams(top_k=5, top_p=0.7),
        SamplingParams(top_k=6, min_p=0.3, temperature=1.5),
    ],
)
def test_candidate_race_draws_the_filtered_distribution(params: SamplingParams) -> None:
    """Rows race among their top-k candidates only: frequencies follow the renormalised kept mass."""
    torch.manual_seed(0)
    rows = 20_000
    row = torch.tensor([2.0, 1.6, 1.3, 1.0, 0.8, 0.5, 0.3, 0.0, -0.5, -1.0])
    batch = build([params] * rows)
    assert batch.all_top_k
    ids = Sampler()(row.expand(rows, -1).contiguous(), batch).next_token_ids
    empirical = torch.bincount(ids, minlength=row.numel()).float() / rows
    kept = reference_filter(torch.softmax(row / params.temperature, -1)[None], [params])[0]
    expected = kept / kept.sum()
    assert torch.allclose(empirical, expected, atol=4.5 * (0.25 / rows) ** 0.5), (empirical, expected)
    assert set(ids.tolist()) == set(expected.nonzero().flatten().tolist())
