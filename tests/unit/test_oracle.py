"""The oracle itself: a flip passes only at a near-tie, the rest of the sequence is then held to
the reference's own decoding from the flip, and more than MAX_FLIPS flips fail."""

from __future__ import annotations

import dataclasses

import pytest

import oracle
from oracle import MAX_FLIPS, NearTieWarning, Reference, assert_matches


def _flipping_at(ref: Reference, steps: list[int]) -> list[int]:
    """The reference's greedy tokens, but its runner-up at each of `steps`, and its decoding on from there."""
    ours: list[int] = []
    for step in steps:
        at = step - len(ours)  # where `ref`, which continues from ours, stands
        flipped = ref.tokens[:at] + [ref.top2[at][1]]
        ours += flipped
        ref = ref.continued(flipped)
    return ours + ref.tokens


def _tie_at(ref: Reference, step: int) -> Reference:
    return dataclasses.replace(ref, gaps=[0.0 if i == step else g for i, g in enumerate(ref.gaps)])


@pytest.fixture
def ref(tiny_llama) -> Reference:
    return tiny_llama.refs[0]


def test_the_reference_itself_matches_with_no_flip(ref):
    assert assert_matches(ref.tokens, ref, "itself") == 0
    with pytest.raises(AssertionError, match="reference 32"):
        assert_matches(ref.tokens[:-1], ref, "one short")


def test_a_flip_passes_only_at_a_near_tie(ref):
    step = max(range(len(ref.gaps)), key=ref.gaps.__getitem__)  # the clearest choice of all
    ours = _flipping_at(ref, [step])
    with pytest.raises(AssertionError, match="gap"):
        assert_matches(ours, ref, "clear choice")
    with pytest.warns(NearTieWarning):
        assert assert_matches(ours, _tie_at(ref, step), "near-tie") == 1


def test_after_a_flip_the_rest_is_held_to_the_reference_from_there(ref):
    step = 5
    flipped = ref.tokens[:step] + [ref.top2[step][1]]
    stale = flipped + ref.tokens[step + 1:]  # goes on as if nothing had flipped
    assert stale != _flipping_at(ref, [step]), "the flip was meant to change what follows"
    with pytest.warns(NearTieWarning), pytest.raises(AssertionError, match=f"token {step + 1} is"):
        assert_matches(stale, _tie_at(ref, step), "stale tail")


def test_more_than_max_flips_fail(ref, monkeypatch):
    monkeypatch.setattr(oracle, "NEAR_TIE", float("inf"))  # every step a near-tie
    steps = [3 + 5 * k for k in range(MAX_FLIPS + 1)]
    with pytest.warns(NearTieWarning):
        assert assert_matches(_flipping_at(ref, steps[:-1]), ref, "at most") == MAX_FLIPS
    with pytest.warns(NearTieWarning), pytest.raises(AssertionError, match=f"more than {MAX_FLIPS}"):
        assert_matches(_flipping_at(ref, steps), ref, "one too many")
