"""The seeded rows' noise: SplitMix64 in int64 torch arithmetic, checked against a pure-Python
SplitMix64 and its published outputs, then for the uniformity a broken mix would lose."""

from __future__ import annotations

import random
from typing import Callable

import pytest
import torch

from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.worker.sampler import Sampler, SamplingBatch, _exponential_noise, counter_uniform, mix64

MASK = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


def ref_mix(z: int) -> int:
    """SplitMix64's output function on an unsigned 64-bit Python int."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def ref_output(seed: int, index: int) -> int:
    """Output number `index` (from 0) of SplitMix64 seeded with `seed`."""
    return ref_mix((seed + (index + 1) * GAMMA) & MASK)


def signed(value: int) -> int:
    value &= MASK
    return value - (1 << 64) if value >= 1 << 63 else value


def int64s(values: list[int]) -> torch.Tensor:
    return torch.tensor([signed(v) for v in values], dtype=torch.int64)


EDGES = [0, 1, 2, (1 << 63) - 1, 1 << 63, MASK, MASK - 1, 0x8000_0000, 0xFFFF_FFFF]


def test_mix64_matches_python_reference() -> None:
    rng = random.Random(0)
    values = EDGES + [rng.getrandbits(64) for _ in range(5000)]  # long enough for vectorised kernels
    got = mix64(int64s(values)).tolist()
    assert got == [signed(ref_mix(v)) for v in values]


@pytest.mark.parametrize(
    "seed, outputs",
    [
        # Published first outputs of SplitMix64 (Vigna's splitmix64.c) for these seeds.
        (0, [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]),
        (1234567, [6457827717110365317, 3203168211198807973, 9817491932198370423]),
    ],
)
def test_counter_streams_are_splitmix64(seed: int, outputs: list[int]) -> None:
    counters = torch.arange(len(outputs))
    assert mix64(signed(seed) + (counters + 1) * signed(GAMMA)).tolist() == [signed(o) for o in outputs]
    expected = torch.tensor([((o >> 41) + 0.5) / 2**23 for o in outputs], dtype=torch.float32)
    assert torch.equal(counter_uniform(int64s([seed]), counters), expected)


def test_step_seeds_mix_seed_and_output_length() -> None:
    seeds = [0, 7, -5, (1 << 63) - 1, MASK, 123456789]
    lengths = [0, 3, 0, 11, 1, 250]
    params = [SamplingParams(seed=s) for s in seeds] + [SamplingParams(), SamplingParams(temperature=0, seed=1)]
    outputs = [[1] * n for n in lengths] + [[], []]
    batch = SamplingBatch.build(params, [[] for _ in params], outputs, [0], 10, "cpu")
    assert batch.seeded_rows.tolist() == list(range(len(seeds)))  # unseeded and greedy rows left out
    expected = [signed(ref_output((ref_output(s & MASK, 0) + n) & MASK, 0)) for s, n in zip(seeds, lengths)]
    assert batch.step_seeds.tolist() == expected


def chi_square(uniform: torch.Tensor, bins: int = 100) -> float:
    counts = torch.histc(uniform.double(), bins=bins, min=0.0, max=1.0)
    expected = uniform.numel() / bins
    return float(((counts - expected) ** 2 / expected).sum())


def looks_uniform(uniform: torch.Tensor) -> bool:
    """100k draws: inside (0, 1), Exp(1) = -log(u) with mean within 1% of 1, chi-square over 100 bins
    within 5 standard deviations of its mean (99 +- 14) both ways (too even is as wrong as too
    lumpy), and neighbours uncorrelated along each row and across rows."""
    if not bool(((uniform > 0) & (uniform < 1)).all()):
        return False
    exp_mean = float(-uniform.double().log().mean())
    centred = uniform.double() - 0.5
    along = float((centred[:, 1:] * centred[:, :-1]).mean() / centred.var())
    across = float((centred[1:] * centred[:-1]).mean() / centred.var())
    chi2 = chi_square(uniform)
    return abs(exp_mean - 1) < 0.01 and 29 < chi2 < 169 and abs(along) < 0.02 and abs(across) < 0.02


KEYS = int64s(list(range(100)))  # adjacent keys: the hardest case for a weak mix
COUNTERS = torch.arange(1000)[None]


def top_bits(bits: torch.Tensor) -> torch.Tensor:
    return ((bits >> 41) & ((1 << 23) - 1)).float().add_(0.5).mul_(2.0**-23)


def without_mix(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    return top_bits(keys + (counters + 1) * signed(GAMMA))  # the Weyl sequence alone


def unspread_counter(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    return top_bits(mix64(keys + (counters + 1)))  # neighbouring keys' streams overlap


def arithmetic_shifts(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    z = keys + (counters + 1) * signed(GAMMA)
    z = (z ^ (z >> 30)) * signed(0xBF58476D1CE4E5B9)  # >> without the masks copies the sign bit
    z = (z ^ (z >> 27)) * signed(0x94D049BB133111EB)
    return top_bits(z ^ (z >> 31))


def test_counter_uniform_is_uniform() -> None:
    assert looks_uniform(counter_uniform(KEYS[:, None], COUNTERS))


@pytest.mark.parametrize("broken", [without_mix, unspread_counter, arithmetic_shifts])
def test_uniformity_check_rejects_broken_mixes(broken: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    assert not looks_uniform(broken(KEYS[:, None], COUNTERS))


def test_noise_stays_positive_and_finite_when_rand_hits_its_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """rand may return 0 (then -log is inf) and a backend may round to 1 (then E = 0 wins every race)."""
    vocab = 8
    ends = torch.tensor([[0.0, 1.0] * (vocab // 2)] * 2)
    monkeypatch.setattr(torch, "rand_like", lambda t: ends.clone())
    logits = torch.zeros(2, vocab)
    batch = SamplingBatch.build([SamplingParams()] * 2, [[], []], [[], []], [0], vocab, "cpu")
    noise = _exponential_noise(torch.softmax(logits, -1), batch, None)
    assert bool(torch.isfinite(noise).all()) and bool((noise > 0).all())
    assert Sampler()(logits, batch).next_token_ids.tolist() == [1, 1]  # u = 1 -> the smallest E


def test_seeded_rows_make_no_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a per-row torch.Generator")

    monkeypatch.setattr(torch, "Generator", refuse)
    params = [SamplingParams(seed=i) for i in range(8)] + [SamplingParams()] * 4
    batch = SamplingBatch.build(params, [[]] * 12, [[]] * 12, [0], 500, "cpu")
    ids = Sampler()(torch.randn(12, 500), batch).next_token_ids
    assert ids.shape == (12,)


def sample_one(row: torch.Tensor, target: SamplingParams, output: list[int], others: list[SamplingParams]) -> int:
    """`target`'s token when it sits last in a batch after `others`."""
    params = others + [target]
    logits = torch.cat([torch.randn(len(others), row.numel()), row[None]])
    outputs = [[] for _ in others] + [output]
    batch = SamplingBatch.build(params, [[] for _ in params], outputs, [0], row.numel(), "cpu")
    return int(Sampler()(logits, batch).next_token_ids[-1])


@pytest.mark.parametrize(
    "target",
    [SamplingParams(top_k=50), SamplingParams(top_k=40, top_p=0.8), SamplingParams(top_k=30, min_p=0.1)],
)
def test_seeded_token_is_the_same_on_every_path(target: SamplingParams) -> None:
    """Alone (candidates only), beside an unfiltered row (the whole vocabulary races) and beside a
    top-p row (full sort): the same token, because the noise is keyed by token id, not column."""
    torch.manual_seed(0)
    vocab = 2000
    neighbours = [[], [SamplingParams()], [SamplingParams(top_p=0.9, seed=5), SamplingParams(top_k=200)]]
    drawn = set()
    for seed in range(40):
        params = SamplingParams(**{**target.to_dict(), "seed": seed})
        row, output = torch.randn(vocab) * 2, [3] * (seed % 7)
        tokens = {sample_one(row, params, output, others) for others in neighbours}
        assert len(tokens) == 1, (seed, tokens)
        drawn |= tokens
    assert len(drawn) > 20  # the seeds do pick different tokens
