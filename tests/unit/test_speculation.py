"""Speculative decoding's parts without a model: the proposers against brute force, the verify's
losslessness as a distribution (chi-square), and the per-step decision against costs given."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.runtime.cache.allocator import PageAllocator
from radixlm.runtime.cache.continuations import NGRAM_SIZES, NgramIndex, TreeContinuations
from radixlm.runtime.cache.radix_cache import RadixCache
from radixlm.runtime.messages import TokenizedRequest
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler.req import Req
from radixlm.runtime.scheduler.speculation import Acceptance, Speculator, StepCosts, kept_prefix
from radixlm.runtime.worker.sampler import Sampler, SamplingBatch


def _brute_proposal(seq: list[int], k: int) -> tuple[int, list[int]]:
    """The longest n whose last-n gram occurred ending before len(seq); its latest such end."""
    L = len(seq)
    for n in NGRAM_SIZES:
        if n > L:
            continue
        gram = seq[L - n :]
        for end in range(L - 1, n - 1, -1):
            if seq[end - n : end] == gram:
                return n, seq[end : end + k]
    return 0, []


@settings(max_examples=1500)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), st.lists(st.integers(1, 5), min_size=1, max_size=8),
       st.integers(1, 6))
def test_ngram_index_proposes_what_brute_force_finds(tokens, growth, k):
    """Grown in steps of any size (decode adds one, a verify several), the index proposes what a
    scan of the whole sequence would."""
    index, length = NgramIndex(), 0
    seq = lambda a, b: tokens[a:b]  # noqa: E731
    for g in growth * 20:
        length = min(length + g, len(tokens))
        assert index.propose(length, seq, k) == _brute_proposal(tokens[:length], k)
        if length == len(tokens):
            break


def _cache() -> tuple[RadixCache, TreeContinuations, PageAllocator]:
    index = TreeContinuations()
    alloc = PageAllocator(4096, 1, torch.device("cpu"))
    return RadixCache(alloc, index), index, alloc


def _cache_seq(cache: RadixCache, alloc: PageAllocator, seq: list[int]) -> None:
    m = cache.match_prefix(seq)
    cache.lock(m.node)
    own = alloc.alloc(len(seq) - len(m.slots))
    cache.cache_request(seq, torch.cat([m.slots, own]), len(m.slots), m.node)


def _occurs_in(seqs: list[list[int]], part: list[int]) -> bool:
    return any(s[i : i + len(part)] == part for s in seqs for i in range(len(s) - len(part) + 1))


@settings(max_examples=1500)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=40), min_size=1, max_size=6),
       st.lists(st.integers(0, 4), min_size=2, max_size=6), st.integers(1, 8))
def test_tree_proposals_are_continuations_of_cached_sequences(seqs, tail, k):
    """Whatever was cached (and split on the way), a proposal after `tail` continues the matched
    gram along a path of the tree: gram + proposal is a run of tokens some cached sequence holds
    on its path from the root (a path may end one sequence and go on in another sharing its head)."""
    cache, index, alloc = _cache()
    for s in seqs:
        _cache_seq(cache, alloc, s)
    n, proposal = index.propose(tail, k)
    if not n:
        # nothing: then no cached sequence holds any of tail's end grams before its own last token
        for size in NGRAM_SIZES:
            gram = tail[len(tail) - size :] if size <= len(tail) else None
            assert gram is None or not any(s[i : i + size] == gram for s in seqs for i in range(len(s) - size))
        return
    assert 1 <= len(proposal) <= k
    gram = list(tail[len(tail) - n :])
    paths = _paths(cache)
    assert _occurs_in(paths, gram + proposal), (gram, proposal, paths)
    cache.check_invariants()


def _paths(cache: RadixCache) -> list[list[int]]:
    out, stack = [], [(cache.root, [])]
    while stack:
        node, prefix = stack.pop()
        here = prefix + node.key
        if not node.children:
            out.append(here)
        stack.extend((c, here) for c in node.children.values())
    return out


def test_tree_proposals_survive_a_split_and_end_with_eviction():
    cache, index, alloc = _cache()
    a = list(range(100, 140))
    _cache_seq(cache, alloc, a)
    assert index.propose([104, 105, 106, 107], 5) == (4, [108, 109, 110, 111, 112])
    _cache_seq(cache, alloc, a[:10] + [7, 8, 9])  # splits a's node after 10 tokens
    assert index.propose([104, 105, 106, 107], 3) == (4, [108, 109, 7])  # the newest branch at the cut
    assert index.propose([120, 121, 122, 123], 3) == (4, [124, 125, 126])  # in the tail, past the cut
    cache.evict(10_000)
    before = len(index)
    for tail in ([120, 121, 122, 123], [104, 105, 106, 107], [7, 8], [130, 131, 132]):
        assert index.propose(tail, 3) == (0, [])  # nothing is cached: every entry met is dead
    assert len(index) < before  # and dropped
    cache.check_invariants()


def test_acceptance_sets_depth_and_expectation():
    acc = Acceptance(0.5)
    assert acc.depth(8) == 2 and math.isclose(acc.expected(2), 0.75)
    for _ in range(20):
        acc.record(8, 8)
    assert acc.rate > 0.95 and acc.depth(8) == 8
    for _ in range(20):
        acc.record(4, 0)
    assert acc.rate < 0.05 and acc.depth(8) == 0


def test_step_costs_interpolate_between_measured_sizes():
    costs = StepCosts()
    assert costs.estimate(False, 4) is None
    costs.observe(False, 1, 0.010)
    costs.observe(True, 257, 0.200)
    assert costs.estimate(False, 1) == 0.010
    # an extend step of 9 tokens: between the decode step of 1 (a floor) and the measured 257
    assert 0.010 < costs.estimate(True, 9) < 0.200
    assert costs.estimate(True, 9) == pytest.approx(0.010 + 0.190 * 8 / 256, rel=0.01)
    costs.observe(True, 9, 0.011)
    assert costs.estimate(True, 9) == 0.011


# ---- the verify is lossless: a chi-square test on a 3-token vocabulary ----

def _two_step_model() -> tuple[torch.Tensor, torch.Tensor]:
    """p(x1) and p(x2 | x1) over a vocabulary of 3: the 'model' the verify samples from."""
    first = torch.tensor([0.5, 0.3, 0.2])
    second = torch.tensor([[0.6, 0.3, 0.1], [0.1, 0.1, 0.8], [0.3, 0.4, 0.3]])
    return first, second


def _sampling(n: int) -> SamplingBatch:
    params = [SamplingParams(temperature=1.0, max_new_tokens=4) for _ in range(n)]
    for p in params:
        p.validate(3)
    return SamplingBatch.build(params, [[0]] * n, [[]] * n, [], 3, "cpu")


def test_verified_tokens_follow_the_models_distribution():
    """Drafts [0, 2] after a prompt: row 0 samples x1 ~ p, row 1 samples x2 ~ p(. | 0) (its logits
    assume the draft), row 2 a third token we ignore. The kept tokens' first two are distributed
    as p(x1) p(x2 | x1), whatever the drafts; a chi-square test at the 0.1% level on 60,000 draws."""
    first, second = _two_step_model()
    draft = [0, 2]
    trials = 60_000
    rows = torch.stack([first.log(), second[draft[0]].log(), torch.zeros(3)])  # row j: after draft[:j]
    logits = rows.repeat(trials, 1)
    torch.manual_seed(0)
    sampled = Sampler()(logits, _sampling(3 * trials)).next_token_ids.view(trials, 3)
    # where the first draft is rejected, the second token comes from decoding on after the sample
    follow = torch.multinomial(second, trials, replacement=True).T  # [trials, 3]: x2 after each x1
    counts = torch.zeros(3, 3)
    for row, f in zip(sampled.tolist(), follow.tolist()):
        kept = kept_prefix(draft, row)
        out = draft[:kept] + [row[kept]]
        x1 = out[0]
        x2 = out[1] if len(out) > 1 else f[x1]
        counts[x1, x2] += 1
    expected = (first[:, None] * second) * trials
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 27.9, (chi2, counts)  # 8 degrees of freedom: P(chi2 > 26.1) = 0.001
    # and the verify kept the first draft as often as the model gives it: p(0) = 0.5
    assert abs(float((sampled[:, 0] == 0).float().mean()) - 0.5) < 0.01


def test_a_seeded_verify_draws_what_decoding_would():
    """A seeded row's noise depends on (seed, output length, token): the verify's row j, sampled at
    output length n + j, draws what decoding's step n + j would, so seeded output is identical."""
    first, second = _two_step_model()
    for seed in range(40):
        p = SamplingParams(temperature=1.0, max_new_tokens=4, seed=seed)
        p.validate(3)
        plain0 = Sampler()(first.log()[None], SamplingBatch.build([p], [[0]], [[]], [], 3, "cpu")).next_token_ids
        x1 = int(plain0)
        plain1 = Sampler()(second[x1].log()[None], SamplingBatch.build([p], [[0]], [[x1]], [], 3, "cpu")).next_token_ids
        draft = [x1, 1]  # a right first draft
        verify = SamplingBatch.build([p, p], [[0], [0]], [[], []], [], 3, "cpu", output_lens=[0, 1])
        got = Sampler()(torch.stack([first.log(), second[x1].log()]), verify).next_token_ids.tolist()
        assert got == [x1, int(plain1)]
        assert kept_prefix(draft, got) >= 1


# ---- when to speculate ----

def _req(tokens: list[int], max_new: int = 64) -> Req:
    params = SamplingParams(max_new_tokens=max_new, temperature=0)
    req = Req(TokenizedRequest(rid=f"r{id(tokens)}", input_ids=tokens, sampling_params=params), 0)
    req.output_ids = [tokens[0]]  # the cycle goes on
    req.cached_len = req.seq_len - 1  # decoding: one token to compute
    return req


def _kv() -> SimpleNamespace:
    return SimpleNamespace(cache=SimpleNamespace(), pages_to_extend=lambda req, n: n)


def _speculator(costs: dict[tuple[bool, int], float]) -> Speculator:
    spec = Speculator("auto", 8, _kv(), 4096, [2])
    for (extend, tokens), seconds in costs.items():
        spec.observe_step(extend, tokens, seconds)
    return spec


def _repetitive(i: int) -> list[int]:
    return [10 + i, 11, 12, 13, 14, 15, 16, 17] * 6


def test_auto_speculates_when_a_longer_step_costs_little():
    spec = _speculator({(False, 1): 0.010, (True, 9): 0.011, (True, 257): 0.2})
    reqs = [_req(_repetitive(0))]
    for r in reqs:
        r.spec_acceptance = Acceptance(0.9)
    assert spec.plan(reqs, 100, 1, False) > 0 and reqs[0].draft


def test_auto_checks_as_many_drafts_as_the_measured_costs_make_best():
    """Measured on this CPU's int4 path: up to 4 tokens a step costs little more than one, past 7
    rows the kernel changes and a step costs 3x. At acceptance 0.8, 3 drafts give the most tokens/s."""
    ms = {(False, 1): 9.4, (True, 2): 11.0, (True, 3): 12.2, (True, 4): 13.1, (True, 5): 17.2, (True, 7): 18.1,
          (True, 9): 26.9, (True, 257): 200.0}
    spec = _speculator({key: v / 1000 for key, v in ms.items()})
    req = _req(_repetitive(0))
    req.spec_acceptance = Acceptance(0.8)
    spec.plan([req], 100, 1, False)
    assert len(req.draft) == 3


def test_auto_stays_off_when_steps_cost_by_the_token():
    """At batch 32 where a step costs in proportion to its tokens, no draft is worth it."""
    per_token = {(False, 32): 0.064, (True, 64): 0.128, (True, 128): 0.256, (True, 256): 0.512, (True, 512): 1.024}
    spec = _speculator(per_token)
    reqs = [_req(_repetitive(i)) for i in range(32)]
    for r in reqs:
        r.spec_acceptance = Acceptance(0.6)
    assert spec.plan(reqs, 10_000, 32, False) == 0
    assert all(not r.draft for r in reqs)


def test_auto_stays_off_above_its_batch_size_cap():
    cheap = {(False, 4): 0.010, (False, 8): 0.010, (True, 64): 0.011, (True, 257): 0.2}
    spec = Speculator("auto", 8, _kv(), 4096, [2], max_batch=4)
    for (extend, tokens), seconds in cheap.items():
        spec.observe_step(extend, tokens, seconds)
    reqs = [_req(_repetitive(i)) for i in range(8)]
    for r in reqs:
        r.spec_acceptance = Acceptance(0.9)
    assert spec.plan(reqs, 1000, 8, False) == 0
    assert spec.plan(reqs[:4], 1000, 4, False) > 0  # at 4 it may


def test_auto_runs_plain_until_a_step_was_measured():
    spec = _speculator({})
    reqs = [_req(_repetitive(0))]
    assert spec.plan(reqs, 100, 1, False) == 0


def test_drafts_stay_within_the_spare_pages_and_the_room_left():
    spec = Speculator("ngram", 8, _kv(), 4096, [2])
    a, b = _req(_repetitive(0)), _req(_repetitive(1), max_new=3)
    spec.plan([a, b], 100, 2, False)
    assert len(a.draft) == 8 and len(b.draft) == 1  # b may add 2 more tokens: its next and one draft
    spec.plan([a, b], 5, 2, False)
    assert len(a.draft) == 0 and len(b.draft) == 1  # a's 8 drafts do not fit in 5 pages; b's one does


def test_metrics_count_verifies_and_kept_drafts():
    from prometheus_client.parser import text_string_to_metric_families

    from radixlm.runtime.messages import ClientOutput
    from radixlm.runtime.server.metrics import Metrics

    m = Metrics()
    done = {"finish_reason": {"type": "length"}, "prompt_tokens": 5, "completion_tokens": 20}
    m.observe(ClientOutput("a", meta_info={**done, "spec_verify_ct": 6, "spec_proposed_tokens": 30,
                                           "spec_accepted_tokens": 12}))
    m.observe(ClientOutput("b", meta_info={**done, "spec_verify_ct": 4, "spec_proposed_tokens": 10,
                                           "spec_accepted_tokens": 8}))
    m.observe(ClientOutput("c", meta_info=done))  # a request that never speculated
    values = {s.name: s.value for f in text_string_to_metric_families(m.render({}).decode()) for s in f.samples}
    assert values["radixlm_spec_verify_passes_total"] == 10
    assert values["radixlm_spec_proposed_tokens_total"] == 40
    assert values["radixlm_spec_accepted_tokens_total"] == 20
    assert values["radixlm_spec_accept_rate"] == pytest.approx(0.5)
    assert values["radixlm_spec_tokens_per_verify"] == pytest.approx(3.0)  # (20 kept + 10 verifies) / 10


def test_a_draft_model_gets_placeholders_as_deep_as_its_acceptance_pays():
    """`draft`: the worker's draft model fills the placeholders; how many follows the request's
    acceptance (each costs a pass of the draft model), at least one; none under a constraint."""
    from radixlm.runtime.worker.draft_model import DRAFT_PENDING

    spec = Speculator("draft", 8, _kv(), 4096, [2])
    good, poor, bound = _req(_repetitive(0)), _req(_repetitive(1)), _req(_repetitive(2))
    good.spec_acceptance, poor.spec_acceptance = Acceptance(0.9), Acceptance(0.1)
    bound.guide = SimpleNamespace()  # a constrained request: the draft model samples without its mask
    spec.plan([good, poor, bound], 100, 3, False)
    assert good.draft == [DRAFT_PENDING] * Acceptance(0.9).depth(8) and len(good.draft) > 4
    assert poor.draft == [DRAFT_PENDING]
    assert bound.draft == []


@pytest.mark.parametrize("kwargs, message", [
    ({"speculative": "draft"}, "go together"),
    ({"speculative": "ngram", "speculative_draft_model": "/m"}, "go together"),
    ({"speculative_draft_model": "/m", "tp_size": 2}, "--tp-size 1 only"),
])
def test_draft_model_options_are_checked(kwargs, message):
    from radixlm.runtime.args import ServerArgs

    with pytest.raises(ValueError, match=message):
        ServerArgs(**kwargs)
    assert ServerArgs(speculative_draft_model="/m").speculative == "draft"
