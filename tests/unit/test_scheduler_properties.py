"""The scheduler under random workloads, with a stand-in model whose KV is a hash chain.

`EchoWorker` computes each fed token's "KV" from the token and the KV of the position before it,
read back through the request's row of the req-to-token table, as attention would; the next token
is the last KV mod the vocabulary. A slot handed to the wrong request or reused while still
referenced, a prefix matched wrongly, a retraction or a chunk that loses a token: each changes the
chain, and so the output. The oracle computes every request's tokens directly from its prompt.
With a KV tier drawn, evicted prefixes are saved as the chain values they hold and read back
into new slots: one read back under the wrong prefix breaks the chain the same way. With a sliding
window drawn, each token's KV is also stored in the window space (the sliding layers' slots) and a
sampled row reads its last `window` positions back through its window row, as a sliding layer
would: a window page given back too early, or a prefix matched past where its window is held,
reads another token's KV there.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from hypothesis import event, given, settings, target
from hypothesis import strategies as st

from radixlm.runtime.args import SCHEDULE_POLICIES, ServerArgs
from radixlm.runtime.cache.kv_pool import ReqToTokenTable
from radixlm.runtime.messages import TokenizedRequest
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler import scheduler as scheduler_module
from radixlm.runtime.scheduler.scheduler import Scheduler
from radixlm.runtime.worker.forward_batch import FUTURE_BASE
from radixlm.runtime.worker.model_worker import WorkerOutput

VOCAB, EOS, CONTEXT = 50, 0, 96
_MOD = 1_000_003


def chain(kv_before: int, token: int) -> int:
    return (kv_before * 31 + token + 7) % _MOD


class EchoWorker:
    def __init__(self, num_pages: int, page_size: int, max_running: int, window: int | None = None) -> None:
        self.device = torch.device("cpu")
        self.context_length, self.page_size, self.num_pages = CONTEXT, page_size, num_pages
        self.config = SimpleNamespace(vocab_size=VOCAB, eos_token_ids=[EOS], sliding_window=window)
        self.req_to_token = ReqToTokenTable(max_running + 1, CONTEXT + 1, self.device, windowed=window is not None)
        self.kv = [(-1, -1)] * (num_pages * page_size)  # slot -> (chain value, token)
        self.window_kv = list(self.kv)  # the same in the window space
        self.window = window
        self.broken: list[str] = []  # contexts found inconsistent, as attention would read them
        self.kv_pools = [ListPool(self.kv)]  # what a KV tier saves and loads
        self.sampled: list[int] = []  # the latest step's tokens: what an overlapped step's placeholders stand for
        self.loras: dict = {}  # the LoRA adapters served: none

    def kv_identity(self) -> str:
        return f"echo, page {self.page_size}"

    def usable_after_fault(self) -> bool:
        return True

    def forward(self, b) -> WorkerOutput:
        table = self.req_to_token.table
        owner = torch.repeat_interleave(torch.arange(len(b.extend_lens)), b.extend_lens).tolist()
        rows, positions = b.req_rows.tolist(), b.positions.tolist()
        ids = b.input_ids.tolist()
        if b.future_ids:  # as the model worker does on the device
            ids = [self.sampled[FUTURE_BASE - t] if t <= FUTURE_BASE else t for t in ids]
        for i, (token, slot) in enumerate(zip(ids, b.out_slots.tolist())):
            row, pos = rows[owner[i]], positions[i]
            if int(table[row, pos]) != slot:
                self.broken.append(f"row {row} position {pos}: the table does not point at the slot written")
            before = self.kv[int(table[row, pos - 1])][0] if pos else 0
            self.kv[slot] = (chain(before, token), token)
        if self.window is not None:
            window_table = self.req_to_token.window_table
            for i, (slot, full) in enumerate(zip(b.window_slots.tolist(), b.out_slots.tolist())):
                row, pos = rows[owner[i]], positions[i]
                if int(window_table[row, pos]) != slot:
                    self.broken.append(f"row {row} position {pos}: the window row does not point at the slot written")
                self.window_kv[slot] = self.kv[full]
        next_ids = []
        for i in b.sample_rows.tolist():
            row, pos = rows[owner[i]], positions[i]
            context = [self.kv[s] for s in table[row, : pos + 1].tolist()]
            if self.window is not None:  # what a sliding layer reads: the last `window` positions
                first = max(pos + 1 - self.window, 0)
                seen = [self.window_kv[s] for s in self.req_to_token.window_table[row, first : pos + 1].tolist()]
                if seen != context[first:]:
                    self.broken.append(f"row {row}: its window at position {pos} reads another sequence's KV")
            value = 0
            for p, (kv, token) in enumerate(context):  # the whole context, as attention reads it
                value = chain(value, token)
                if kv != value:
                    self.broken.append(f"row {row}: the KV at position {p} belongs to another sequence")
                    break
            next_ids.append(context[-1][0] % VOCAB)
        self.sampled = next_ids
        out = WorkerOutput(next_token_ids=next_ids)
        if b.embed_rows is not None:  # a position's "hidden state": its chain value, as just computed
            slots = b.out_slots.tolist()
            out.embed_hidden = torch.tensor([[float(self.kv[slots[i]][0])] for i in b.embed_rows.tolist()])
        return out


class ListPool:
    """EchoWorker's slots as a KV pool for the tier: per slot its chain value and its token, as
    one layer's K and V of one head of dimension 1 (float64: exact for these integers)."""

    k_heads = [torch.zeros(1, 1, 1, dtype=torch.float64)]

    def __init__(self, kv: list[tuple[int, int]]) -> None:
        self.kv = kv

    def token_shape(self) -> tuple[int, int, int]:
        return 2, 1, 1

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        pairs = [self.kv[s] for s in slots.tolist()]
        return torch.tensor([[[[kv] for kv, _ in pairs]], [[[t] for _, t in pairs]]], dtype=torch.float64)

    def scatter(self, slots: torch.Tensor, data: torch.Tensor) -> None:
        for s, kv, t in zip(slots.tolist(), data[0, 0, :, 0].tolist(), data[1, 0, :, 0].tolist()):
            self.kv[s] = (int(kv), int(t))


def reference_embedding(prompt: list[int], pooling: str) -> float:
    """The pooled "hidden state" of EchoWorker: the chain value of the last prompt position, or
    the mean over every position."""
    kv, values = 0, []
    for t in prompt:
        kv = chain(kv, t)
        values.append(kv)
    return float(values[-1]) if pooling == "last" else sum(values) / len(values)


def reference(prompt: list[int], max_new: int, ignore_eos: bool) -> list[int]:
    kv = 0
    for t in prompt:
        kv = chain(kv, t)
    out: list[int] = []
    while len(out) < max_new and len(prompt) + len(out) < CONTEXT:
        t = kv % VOCAB
        out.append(t)
        kv = chain(kv, t)
        if t == EOS and not ignore_eos:
            break
    return out


@dataclass
class Arrival:
    step: int
    prompt: list[int]
    max_new: int
    ignore_eos: bool
    abort_after: int | None  # steps after arrival
    embed: str | None = None  # an embedding request ("last", "mean"): its prompt pooled, no output


prefixes = st.lists(st.integers(1, VOCAB - 1), min_size=0, max_size=24)


@st.composite
def workloads(draw):
    heads = draw(st.lists(prefixes, min_size=1, max_size=3))
    arrivals = []
    for _ in range(draw(st.integers(1, 10))):
        if arrivals and draw(st.integers(0, 3)) == 0:  # a prompt asked before: its continuation is in the
            prompt = draw(st.sampled_from(arrivals)).prompt  # tree (radix drafts that are right)
        else:
            head = draw(st.sampled_from(heads))
            prompt = (head + draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=12)))[: CONTEXT - 24]
        embed = draw(st.sampled_from([None, None, None, "last", "mean"]))
        arrivals.append(Arrival(
            step=draw(st.integers(0, 12)), prompt=prompt, max_new=0 if embed else draw(st.integers(0, 20)),
            ignore_eos=draw(st.booleans()), abort_after=draw(st.none() | st.integers(0, 10)), embed=embed,
        ))
    return arrivals


@settings(deadline=None, max_examples=300)
@given(
    arrivals=workloads(),
    page_size=st.sampled_from([1, 2, 4]),
    spare_pages=st.integers(0, 40) | st.integers(0, 4),  # often tight: retraction
    chunk=st.sampled_from([0, 3, 8, 64]),
    policy=st.sampled_from(SCHEDULE_POLICIES),
    radix=st.booleans(),
    max_running=st.integers(1, 6),
    reserve=st.sampled_from([0.0, 0.7]),  # share of max_new_tokens reserved at admission; 0: retract often
    tier=st.booleans(),  # a KV tier (with the radix cache), in blocks of 4 tokens
    overlap=st.booleans(),  # the next step built while this one runs, on a thread of its own
    speculative=st.sampled_from(["off", "off", "ngram", "radix"]),  # verify rows: drafts kept up to the first miss
    window=st.sampled_from([None, None, 2, 5]),  # sliding-window layers (window pages; not with a tier)
)
def test_every_request_ends_once_with_the_oracles_tokens(arrivals, page_size, spare_pages, chunk, policy, radix,
                                                         max_running, reserve, tier, overlap, speculative, window):
    # the smallest pool that still holds the longest request: tight pools force retraction
    longest = max(len(a.prompt) + a.max_new for a in arrivals)
    num_pages = -(-longest // page_size) + 1 + spare_pages // page_size
    folder = tempfile.mkdtemp(prefix="radixlm-tier-") if tier and radix and window is None else None
    args = ServerArgs(chunked_prefill_size=chunk, max_prefill_tokens=64, schedule_policy=policy,
                      disable_radix_cache=not radix, max_running_requests=max_running, debug_accounting=True,
                      init_new_token_ratio=reserve, min_new_token_ratio=min(reserve, 0.1), kv_tier_path=folder,
                      overlap_schedule="on" if overlap else "off", speculative=speculative,
                      speculative_num_draft_tokens=3)
    worker = EchoWorker(num_pages, page_size, max_running, window)
    with mock.patch.object(scheduler_module, "BLOCK_TOKENS", 4):
        sched = Scheduler(args, worker)
    unbound = []
    if window is not None:  # window pages given back a page at a time, not 32 tokens, and kept only for
        sched.kv._granule = page_size  # the cut backs of this workload (rejected drafts; no jump-forward)
        sched.kv._keep = window + args.speculative_num_draft_tokens
        unbind = sched.kv.allocator.unbind
        sched.kv.allocator.unbind = lambda pages: (unbound.append(len(pages)), unbind(pages))
    try:
        _run_workload(sched, worker, arrivals)
        if window is not None:
            event(f"window pages given back: {sum(unbound) > 0}")
        sched.shutdown()  # with a tier: everything the tree holds saved, every write done
        if folder is not None:
            sched.kv.tier.store.check_files()
            loaded = sched.kv.tier.store.stats.tokens_loaded
            event(f"read back from the tier: {loaded > 0}")
            target(float(loaded), label="tokens read back from the tier")
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def _run_workload(sched: Scheduler, worker: EchoWorker, arrivals: list[Arrival]) -> None:
    tokens: dict[str, list[int]] = {}
    finishes: dict[str, list[dict]] = {}
    aborts = {}
    embeddings: dict[str, list[float] | None] = {}
    retracted_embeds = set()
    real_make_room = sched._make_room

    def make_room() -> None:  # which embedding requests stepped back (and so pooled their prompt again)
        before = {r.rid for r in sched.running if r.embed} | ({sched.chunked.rid} if sched.chunked else set())
        real_make_room()
        retracted_embeds.update(r.rid for r in sched.waiting if r.rid in before)

    sched._make_room = make_room
    step = 0
    while step < 2000:
        for i, a in enumerate(arrivals):
            if a.step == step:
                sched.add_request(TokenizedRequest(f"r{i}", a.prompt, SamplingParams(
                    max_new_tokens=a.max_new, ignore_eos=a.ignore_eos, temperature=0), embed=a.embed))
                tokens[f"r{i}"], finishes[f"r{i}"] = [], []
                if a.abort_after is not None:
                    aborts[f"r{i}"] = step + a.abort_after
        for rid, when in aborts.items():
            if when == step:
                out = sched.abort(rid)
                if out is not None:
                    tokens[rid] += out.new_token_ids
                    finishes[rid].append(out.finish_reason)
        for out in sched.step():
            assert not finishes[out.rid], f"{out.rid} sent output after it ended"
            tokens[out.rid] += out.new_token_ids
            if out.finish_reason:
                finishes[out.rid].append(out.finish_reason)
                embeddings[out.rid] = out.embedding
        step += 1
        if step > max(a.step for a in arrivals) and not sched.has_work:
            break
    assert not sched.has_work, "the workload did not drain"
    assert not worker.broken, worker.broken[:3]
    event(f"retracted: {sched.num_retractions > 0}")  # --hypothesis-show-statistics shows the mix
    if sched.speculator is not None:
        event(f"drafts checked: {sched.speculator.proposed > 0}, some kept: {sched.speculator.accepted > 0}")
    event(f"aborted: {sum(f[0]['type'] == 'abort' for f in finishes.values()) > 0}")
    for i, a in enumerate(arrivals):
        rid = f"r{i}"
        assert len(finishes[rid]) == 1, f"{rid} ended {len(finishes[rid])} times: {finishes[rid]}"
        want = reference(a.prompt, a.max_new, a.ignore_eos)
        if finishes[rid][0]["type"] == "abort":
            assert finishes[rid][0]["message"] == "aborted", finishes[rid]
            assert tokens[rid] == want[: len(tokens[rid])], f"{rid} diverged before its abort"
        else:
            assert tokens[rid] == want, f"{rid}: {tokens[rid]} != oracle {want}"
            if a.embed:  # float32, as the worker's hidden states are
                assert embeddings[rid] == [pytest.approx(reference_embedding(a.prompt, a.embed), rel=1e-6)], rid
    event(f"an embedding request retracted: {bool(retracted_embeds)}")
    sched.check_accounting()
    kv = sched.kv
    assert kv.cache.locked_pages == 0
    assert kv.allocator.num_free_pages + kv.cache.evictable_pages == kv.num_pages


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_an_embedding_retracted_while_chunked_pools_its_prompt_once(pooling):
    """A long embedding prompt is prefilled 3 tokens a step beside a decode that outgrows the pool:
    the chunked prompt steps back, is prefilled again from the start once the decode ends, and its
    pooled state is that of its prompt, each position once."""
    sched = Scheduler(ServerArgs(chunked_prefill_size=3, max_running_requests=4, debug_accounting=True,
                                 init_new_token_ratio=0.0, min_new_token_ratio=0.0, overlap_schedule="off"),
                      EchoWorker(50, 1, 4))
    decode, embed = [3, 4, 5, 6], list(range(1, 41))  # 4 + 40 new tokens and 40 to pool: 84 > 50 pages
    sched.add_request(TokenizedRequest("decode", decode, SamplingParams(max_new_tokens=40, ignore_eos=True,
                                                                        temperature=0)))
    sched.add_request(TokenizedRequest("embed", embed, SamplingParams(max_new_tokens=0), embed=pooling))
    tokens, pooled = [], None
    while sched.has_work:
        for out in sched.step():
            if out.rid == "decode":
                tokens += out.new_token_ids
            elif out.finish_reason:
                pooled = out.embedding
    assert sched.num_retractions > 0, "the pool was meant to make the chunked prompt step back"
    assert tokens == reference(decode, 40, True)
    assert pooled == [pytest.approx(reference_embedding(embed, pooling), rel=1e-6)]
    sched.check_accounting()


@pytest.mark.parametrize("overlap", ["off", "on"])
@pytest.mark.parametrize("site", ["_append_sampled", "_check_finish"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_a_fault_in_one_requests_bookkeeping_fails_it_alone(site, page_size, overlap, caplog):
    """Our code raising on one request after a good forward pass (taking its token, checking its
    stop conditions) ends that request with a 500 and an error id; the others finish exactly."""
    sched = Scheduler(ServerArgs(max_running_requests=4, debug_accounting=True, overlap_schedule=overlap),
                      EchoWorker(48, page_size, 4))
    prompts = {"r0": [3, 4, 5, 6, 11, 12], "r1": [3, 4, 5, 6, 11, 13, 14], "r2": [9, 10]}
    for rid, prompt in prompts.items():
        sched.add_request(TokenizedRequest(rid, prompt, SamplingParams(max_new_tokens=12, ignore_eos=True,
                                                                       temperature=0)))
    real = getattr(sched, site)

    def faulty(req, *rest):
        if req.rid == "r1" and len(req.output_ids) == 3:
            raise RuntimeError("injected")
        return real(req, *rest)

    setattr(sched, site, faulty)
    tokens = {rid: [] for rid in prompts}
    finishes = {rid: [] for rid in prompts}
    while sched.has_work:
        for out in sched.step():
            tokens[out.rid] += out.new_token_ids
            if out.finish_reason:
                finishes[out.rid].append(out.finish_reason)
    assert [f["type"] for f in finishes["r0"] + finishes["r2"]] == ["length", "length"]
    assert tokens["r0"] == reference(prompts["r0"], 12, True) and tokens["r2"] == reference(prompts["r2"], 12, True)
    [failed] = finishes["r1"]
    assert failed["type"] == "abort" and failed["status"] == 500 and "error id" in failed["message"], failed
    assert failed["message"].split("error id ")[1].rstrip(")") in caplog.text
    assert tokens["r1"] == reference(prompts["r1"], 12, True)[: len(tokens["r1"])]
    sched.check_accounting()
    assert sched.kv.cache.locked_pages == 0
    assert sched.kv.allocator.num_free_pages + sched.kv.cache.evictable_pages == sched.kv.num_pages
    # what the failed request left in the cache is sound: the same prompt again decodes exactly
    setattr(sched, site, real)
    sched.add_request(TokenizedRequest("again", prompts["r1"], SamplingParams(max_new_tokens=12, temperature=0,
                                                                              ignore_eos=True)))
    again = []
    while sched.has_work:
        again += [t for out in sched.step() for t in out.new_token_ids]
    assert again == reference(prompts["r1"], 12, True) and not sched.kv.cache.locked_pages
    assert not sched.worker.broken


def _drive(sched: Scheduler, requests: dict[str, list[int]], new: int = 8,
           late: tuple[int, str, list[int], int] | None = None) -> tuple[dict, dict]:
    """Every request at once (and `late` = (step, id, prompt, new tokens) added before that step),
    stepped to the end, greedy: (tokens, finishes) by id."""
    def add(rid: str, prompt: list[int], n: int) -> None:
        sched.add_request(TokenizedRequest(rid, prompt, SamplingParams(max_new_tokens=n, ignore_eos=True,
                                                                       temperature=0)))

    for rid, prompt in requests.items():
        add(rid, prompt, new)
    tokens = {rid: [] for rid in [*requests, *([late[1]] if late else [])]}
    finishes = {rid: [] for rid in tokens}
    step = 0
    while sched.has_work:
        if late is not None and step == late[0]:
            add(*late[1:])
        for out in sched.step():
            tokens[out.rid] += out.new_token_ids
            if out.finish_reason:
                finishes[out.rid].append(out.finish_reason)
        step += 1
    return tokens, finishes


@pytest.mark.parametrize("page_size", [1, 4])
def test_an_overlapped_step_that_raises_fails_its_requests_alone(page_size, caplog):
    """With overlap, the model raises on a step while the next one is already launched (its
    decodes read the failed step's placeholders): the failed step's requests end with a 500,
    a request admitted beside them finishes exactly, no page leaks, and the cache stays sound."""
    worker = EchoWorker(64, page_size, 4)
    sched = Scheduler(ServerArgs(max_running_requests=4, debug_accounting=True, overlap_schedule="on"), worker)
    real, steps = worker.forward, []

    def faulty(b):
        steps.append(bool(b.future_ids))
        if len(steps) == 4:  # a decode step launched while the one before it ran
            assert b.future_ids
            raise RuntimeError("injected")
        return real(b)

    worker.forward = faulty
    prompts = {"r0": [3, 4, 5, 6], "r1": [7, 8, 9]}
    # "late" arrives while the faulty step runs: prefilled in the step launched beside it
    tokens, finishes = _drive(sched, prompts, 12, late=(4, "late", [11, 12, 13], 8))
    for rid in prompts:
        [failed] = finishes[rid]
        assert failed["status"] == 500 and "running the model" in failed["message"], failed
        assert failed["message"].split("error id ")[1].rstrip(")") in caplog.text
        assert tokens[rid] == reference(prompts[rid], 12, True)[: len(tokens[rid])]
    assert [f["type"] for f in finishes["late"]] == ["length"]
    assert tokens["late"] == reference([11, 12, 13], 8, True)
    sched.check_accounting()
    assert sched.kv.cache.locked_pages == 0
    assert sched.kv.allocator.num_free_pages + sched.kv.cache.evictable_pages == sched.kv.num_pages
    # the step launched beside the failed one read the KV that step never wrote, for its
    # requests alone (rows 0 and 1), and those rows' results were dropped
    assert worker.broken and all(b.startswith(("row 0:", "row 1:")) for b in worker.broken), worker.broken
    worker.broken.clear()
    worker.forward = real
    for rid, prompt in prompts.items():  # nothing the failed step wrote was cached
        sched.add_request(TokenizedRequest(rid + "-again", prompt, SamplingParams(max_new_tokens=12, ignore_eos=True,
                                                                                  temperature=0)))
    again = {rid + "-again": [] for rid in prompts}
    while sched.has_work:
        for out in sched.step():
            again[out.rid] += out.new_token_ids
    assert again == {rid + "-again": reference(p, 12, True) for rid, p in prompts.items()}
    assert not worker.broken
    sched.shutdown()


@pytest.mark.parametrize("overlap", ["off", "on"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_a_bad_prompt_beside_decodes_fails_alone_with_or_without_overlap(overlap, page_size, caplog):
    """The model raises on every step holding a bad prompt. Admitted beside running decodes, the
    mixed step fails; its decodes run again alone and pass, so the prompt alone gets the 500 and
    its neighbours finish exactly. With overlap the mixed step was launched (on the placeholders
    of the step before it) when it raised: it failed every request in it."""
    worker = EchoWorker(64, page_size, 4)
    sched = Scheduler(ServerArgs(max_running_requests=4, debug_accounting=True, overlap_schedule=overlap), worker)
    real, mixed = worker.forward, []
    bad_token = 15

    def faulty(b):
        if bad_token in b.input_ids.tolist():
            mixed.append(b.num_decode)
            raise RuntimeError("injected")
        return real(b)

    worker.forward = faulty
    prompts = {"r0": [3, 4, 5, 6], "r1": [7, 8, 9]}
    # "bad" comes when both decode (one step in flight with overlap)
    tokens, finishes = _drive(sched, prompts, 12, late=(3, "bad", [11, bad_token, 12], 8))
    assert mixed and mixed[0] == 2, "the bad prompt was admitted beside both decodes"
    [failed] = finishes["bad"]
    assert failed["status"] == 500 and "running the model" in failed["message"], failed
    assert failed["message"].split("error id ")[1].rstrip(")") in caplog.text
    for rid, prompt in prompts.items():
        assert [f["type"] for f in finishes[rid]] == ["length"], (rid, finishes[rid])
        assert tokens[rid] == reference(prompt, 12, True), rid
    sched.check_accounting()
    assert sched.kv.cache.locked_pages == 0
    assert sched.kv.allocator.num_free_pages + sched.kv.cache.evictable_pages == sched.kv.num_pages
    assert not worker.broken
    sched.shutdown()


def test_building_a_batch_makes_no_copy_that_waits_for_the_device(monkeypatch):
    """Overlap builds a batch while the step before it runs, so building must not synchronize the
    device. On CUDA a tensor made from host values straight on the device (``torch.tensor(...,
    device=...)``) or a blocking ``.to(device)`` copies from pageable memory and waits for the
    running step; every such copy goes through runtime/worker/staging.py (pinned, non-blocking).
    Here, on a CPU, every way of making that copy is watched while batches with every sampling
    feature (penalties, bias, seeds, min tokens, top-k/p, min-p, prompt logprobs) are built."""
    calls: list[str] = []
    real_tensor, real_as_tensor, real_to = torch.tensor, torch.as_tensor, torch.Tensor.to

    def watched_tensor(*args, **kwargs):
        if kwargs.get("device") is not None:
            calls.append(f"torch.tensor(..., device={kwargs['device']})")
        return real_tensor(*args, **kwargs)

    def watched_as_tensor(*args, **kwargs):
        if kwargs.get("device") is not None:
            calls.append(f"torch.as_tensor(..., device={kwargs['device']})")
        return real_as_tensor(*args, **kwargs)

    def watched_to(self, *args, **kwargs):
        target = kwargs.get("device", args[0] if args and not isinstance(args[0], torch.dtype) else None)
        if target is not None and not isinstance(target, torch.Tensor) and not kwargs.get("non_blocking"):
            calls.append(f"Tensor.to({target}) blocking")
        return real_to(self, *args, **kwargs)

    class LogprobWorker(EchoWorker):  # logprobs of the right shapes, for the requests that ask
        def forward(self, b):
            out = super().forward(b)
            n, rows = len(out.next_token_ids), len(b.prompt_rows) if b.prompt_rows is not None else 0
            return WorkerOutput(out.next_token_ids, [0.0] * n, [[0.0, 0.0]] * n, [[1, 2]] * n,
                                [0.0] * rows, [[0.0, 0.0]] * rows, [[1, 2]] * rows)

    sched = Scheduler(ServerArgs(max_running_requests=4, debug_accounting=True), LogprobWorker(64, 4, 4))
    real_build, built = sched._build, []

    def build(batch):
        with monkeypatch.context() as m:
            m.setattr(torch, "tensor", watched_tensor)
            m.setattr(torch, "as_tensor", watched_as_tensor)
            m.setattr(torch.Tensor, "to", watched_to)
            wb = real_build(batch)
        built.append(batch.sampling)
        return wb

    sched._build = build
    features = [dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=3),
                dict(temperature=0.8, frequency_penalty=0.5, presence_penalty=0.2, repetition_penalty=1.2),
                dict(temperature=0, logit_bias={3: 1.0, 7: -2.0}, min_new_tokens=4),
                dict(temperature=0)]
    for i, f in enumerate(features):
        sched.add_request(TokenizedRequest(f"r{i}", [3 + i, 4, 5, 6, 7], SamplingParams(max_new_tokens=6, **f),
                                           return_logprob=True, logprob_start_len=1 if i == 3 else -1,
                                           top_logprobs_num=2))
    finishes = {}
    while sched.has_work:
        finishes.update((o.rid, o.finish_reason["type"]) for o in sched.step() if o.finish_reason)
    assert finishes == {f"r{i}": "length" for i in range(4)}, finishes
    assert built and not calls, calls
    last = built[0]  # every feature was in the batches watched
    assert all(t is not None for t in (last.seeded_rows, last.logit_bias, last.min_tokens_block,
                                       last.repetition_penalties, last.frequency_penalties)), last




def _clean(sched: Scheduler) -> None:
    sched.check_accounting()
    kv = sched.kv
    assert kv.cache.locked_pages == 0
    assert kv.allocator.num_free_pages + kv.cache.evictable_pages == kv.num_pages


@pytest.mark.parametrize("where", ["kv.admit", "kv.match_len", "guide.accepts"])
def test_a_fault_while_scheduling_fails_that_request_alone(where, caplog):
    """Our code raising while scheduling one request (admitting it, matching its prefix, or its
    constraint judging its drafts) fails that request with a 500; the others finish exactly. (The
    exception left `step`, and the scheduler process with it.)"""
    args = ServerArgs(max_running_requests=4, debug_accounting=True, disable_jump_forward=True,
                      speculative="ngram" if where == "guide.accepts" else "off")
    sched = Scheduler(args, EchoWorker(64, 2, 4))
    bad = [21, 22, 21, 22, 21, 22, 21, 22]
    requests = {"good": [3, 4, 5, 6, 7], "bad": bad, "other": [9, 10, 11]}

    def raising_for_bad(real):
        def call(req, *args):
            if req.prompt_ids == bad:
                raise RuntimeError("injected")
            return real(req, *args)
        return call

    if where == "guide.accepts":
        from radixlm.runtime.constrained.backend import Matcher
        from radixlm.runtime.constrained.jump_forward import Forced

        class Guide(Matcher):  # a constraint that allows everything, whose accepts alone raises
            max_rollback = 8

            def fill_mask(self, row):
                pass

            def advance(self, token):
                pass

            def accepts(self, tokens):
                raise RuntimeError("injected")

            def can_end(self):
                return True

            def rollback(self, n):
                pass

            def forced(self):
                return Forced(b"", False)

        real_add = sched.add_request

        def add(tr):
            real_add(tr)
            if tr.input_ids == bad:
                sched._live[tr.rid].guide = Guide()

        sched.add_request = add
        sched.speculator._lookup = lambda req, k: [1] * k  # a draft for everyone: the constraint judges it
    else:
        owner, name = sched.kv, where.split(".")[1]
        setattr(owner, name, raising_for_bad(getattr(owner, name)))
    tokens, finishes = _drive(sched, requests)
    [failed] = finishes["bad"]
    assert failed["type"] == "abort" and failed["status"] == 500, failed
    assert failed["message"].split("error id ")[1].rstrip(")") in caplog.text
    for rid in ("good", "other"):
        assert [f["type"] for f in finishes[rid]] == ["length"] and tokens[rid] == reference(requests[rid], 8, True)
    _clean(sched)
    sched.shutdown()


def test_a_tier_file_that_fails_its_checks_and_cannot_be_deleted_is_a_miss(tmp_path, monkeypatch):
    """The issue's example: a damaged block in a folder where it cannot be deleted. Reading it is
    a miss (the request prefills), nothing more (the PermissionError left `step`)."""
    import os

    def run(prompt):
        with mock.patch.object(scheduler_module, "BLOCK_TOKENS", 4):
            sched = Scheduler(ServerArgs(max_running_requests=2, debug_accounting=True, kv_tier_path=str(tmp_path)),
                              EchoWorker(64, 2, 2))
        tokens, finishes = _drive(sched, {"r": prompt})
        _clean(sched)
        sched.shutdown()
        return sched, tokens["r"], finishes["r"]

    prompt = list(range(3, 20))
    run(prompt)  # saved at shutdown
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".kv")]
    assert files
    for path in files:
        with open(path, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            f.write(b"\xff")  # the payload's digest fails
    monkeypatch.setattr(os, "remove", lambda path: (_ for _ in ()).throw(PermissionError(13, "read-only", path)))
    sched, tokens, finishes = run(prompt)
    assert [f["type"] for f in finishes] == ["length"] and tokens == reference(prompt, 8, True)
    assert sched.kv.tier.store.stats.corrupt_skipped >= 1 and sched.kv.tier.store.stats.tokens_loaded == 0
