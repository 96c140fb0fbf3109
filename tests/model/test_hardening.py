"""The scheduler under faults and at its limits, in process: shared constraint outcomes, faults
while building a batch, jump-forward next to EOS and stop tokens, and a request that fills the
pool alone."""

from __future__ import annotations

import time

import pytest

from conftest import TINY_VOCAB
from helpers import assert_drained
from oracle import assert_matches, hf_greedy
from radixlm.runtime.messages import TokenizedRequest
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.native import BadRequest

GREEDY = dict(max_new_tokens=12, temperature=0)


def _collect(got: dict, outputs) -> None:
    """Add one step's outputs to every request's tokens and final reason, by id."""
    for out in outputs:
        assert "finish" not in got.get(out.rid, {}), f"{out.rid} answered after its end"
        entry = got.setdefault(out.rid, {"ids": []})
        del entry["ids"][len(entry["ids"]) - out.replaced:]
        entry["ids"].extend(out.new_token_ids)
        if out.finish_reason:
            entry["finish"] = out.finish_reason


def _run(sched, got: dict | None = None, limit: int = 400) -> dict:
    """Step until no work is left; returns `got` with every request's tokens and final reason."""
    got = {} if got is None else got
    for _ in range(limit):
        _collect(got, sched.step())
        if not sched.has_work:
            return got
        sched.wait_for_constraints(timeout=1.0)
    raise AssertionError(f"still busy after {limit} steps: {sched.num_requests} requests")


# ---- constraint outcomes are shared by their waiters ----------------------------------------------------------


@pytest.mark.parametrize("constraint,message", [
    ({"regex": "(unclosed"}, "regex"),
    ({"json_schema": '{"$ref": "#/$defs/nowhere"}'}, "JSON schema: Invalid reference"),
    ({"regex": "(a|b)*a(a|b){40}"}, "took more than 2s"),
])
def test_every_request_waiting_on_a_failed_compile_gets_its_400(smol, constraint, message):
    """Before: the first waiter took the failure and the second's poll raised KeyError inside the
    scheduler, which killed it."""
    engine = smol.engine_with(constraint_timeout=2.0, grammar_backend="outlines")  # whose automata explode
    sched = engine.scheduler
    params = SamplingParams(max_new_tokens=4, **constraint)
    for rid in ("x0", "x1", "x2"):
        sched.add_request(TokenizedRequest(rid, smol.prompts[0], params))
    got = _run(sched)
    for rid in ("x0", "x1", "x2"):
        finish = got[rid]["finish"]
        assert finish["type"] == "abort" and finish["status"] == 400, finish
        assert message in finish["message"], finish
    assert sched.grammar.num_compiling == 0
    started = time.monotonic()  # the failure is kept: the same constraint is refused at once
    sched.add_request(TokenizedRequest("again", smol.prompts[0], params))
    assert _run(sched)["again"]["finish"]["status"] == 400
    assert time.monotonic() - started < 1.0
    ok = engine.generate(input_ids=smol.prompts[1], sampling_params=GREEDY)
    assert_matches(ok["output_ids"], smol.refs[1].truncated(12), "a plain request after the failures")
    assert_drained(engine)
    engine.shutdown()


def test_an_aborted_requests_compile_leaves_no_wait_behind(smol):
    """Before: the aborted request's finished compile stayed in the compiler's table, so waiting
    for 'any compile to end' returned at once from then on and the scheduler spun a core while
    another request waited on its constraint."""
    # outlines: its automaton explodes; the slow compile outlasts the 1 s watched below
    engine = smol.engine_with(constraint_timeout=5.0, grammar_backend="outlines")
    sched = engine.scheduler
    sched.add_request(TokenizedRequest("quick", smol.prompts[0], SamplingParams(max_new_tokens=2, regex="[0-9]{3}")))
    sched.abort("quick")
    sched.add_request(TokenizedRequest("slow", smol.prompts[0],
                                       SamplingParams(max_new_tokens=2, regex="(a|b)*a(a|b){40}")))
    deadline = time.monotonic() + 10
    while sched.grammar.num_compiling > 1 and time.monotonic() < deadline:
        time.sleep(0.05)  # the aborted request's compile ends; the other one runs to its time limit
    assert sched.grammar.num_compiling == 1
    steps, started = 0, time.monotonic()
    while time.monotonic() - started < 1.0:
        assert sched.step() == []
        sched.wait_for_constraints(timeout=0.25)
        steps += 1
    assert steps <= 8, f"{steps} steps in 1 s while the only request waits on its compile: a busy loop"
    got = _run(sched)
    assert got["slow"]["finish"]["status"] == 400 and "more than 5s" in got["slow"]["finish"]["message"]
    assert_drained(engine)
    engine.shutdown()


# ---- faults while building a batch -----------------------------------------------------------------------------


def _fault_at(monkeypatch, engine, where: str, bad_token: int) -> None:
    """Make one part of batch building raise whenever a request whose prompt holds `bad_token`
    is in the batch."""
    import radixlm.runtime.scheduler.batch as batch_module
    import radixlm.runtime.scheduler.scheduler as scheduler_module

    sched = engine.scheduler
    sampling, building = scheduler_module.sampling_batch, []

    def remembering(reqs, *args):
        building[:] = reqs
        return sampling(reqs, *args)

    def faulty(real):
        def call(*args, **kwargs):
            if any(bad_token in r.prompt_ids for r in building):
                raise RuntimeError("injected fault")
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(scheduler_module, "sampling_batch", remembering)
    if where == "page allocation":  # raises once the step's pages were taken: they must come back
        step_slots = sched.kv.step_slots

        def faulty_step_slots(*args):
            slots = step_slots(*args)
            if any(bad_token in r.prompt_ids for r in building):
                raise RuntimeError("injected fault")
            return slots

        monkeypatch.setattr(sched.kv, "step_slots", faulty_step_slots)
    elif where == "sampling batch":
        monkeypatch.setattr(batch_module.SamplingBatch, "build", staticmethod(faulty(batch_module.SamplingBatch.build)))
    else:
        monkeypatch.setattr(batch_module, "grammar_bitmask", faulty(batch_module.grammar_bitmask))


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("where", ["sampling batch", "bitmask", "page allocation"])
def test_a_fault_while_building_a_batch_fails_that_batch_alone(tiny_llama, monkeypatch, caplog, where, page_size):
    """Before: the exception left `step` and took the scheduler (and the server) down."""
    engine = tiny_llama.engine(page_size=page_size, max_running_requests=2)
    sched = engine.scheduler
    a, b, c = tiny_llama.prompts[0], tiny_llama.prompts[1], tiny_llama.prompts[2]
    marker = next(t for t in range(3, TINY_VOCAB) if t not in a + b + c)
    _fault_at(monkeypatch, engine, where, marker)
    sched.add_request(TokenizedRequest("a", a, SamplingParams(**GREEDY)))
    got: dict = {}
    _collect(got, sched.step())
    _collect(got, sched.step())  # a is decoding
    sched.add_request(TokenizedRequest("bad", b + [marker], SamplingParams(**GREEDY)))
    sched.add_request(TokenizedRequest("good", c, SamplingParams(**GREEDY)))  # waits: two may run
    _run(sched, got)
    fail = got["bad"]["finish"]
    assert fail["type"] == "abort" and fail["status"] == 500 and "building the batch" in fail["message"], fail
    error_id = fail["message"].split("error id ")[1].rstrip(")")
    assert error_id in caplog.text and "injected fault" in caplog.text  # the traceback is logged under the id
    # a's decode rode in the failed batch; run again alone, it passed, so the prompt was at fault
    assert got["a"]["finish"]["type"] == "length"
    assert_matches(got["a"]["ids"], tiny_llama.refs[0].truncated(12), "a, decoding past the fault")
    assert got["good"]["finish"]["type"] == "length"
    assert_matches(got["good"]["ids"], tiny_llama.refs[2].truncated(12), "good, admitted after the fault")
    assert_drained(engine)
    monkeypatch.undo()
    for prompt, ref in ((a, tiny_llama.refs[0]), (b, tiny_llama.refs[1])):  # no poisoned page: retries decode exactly
        retry = engine.generate(input_ids=prompt, sampling_params=GREEDY)
        assert_matches(retry["output_ids"], ref.truncated(12), "retried")
    assert_drained(engine)


def test_a_device_that_fails_its_probe_ends_the_scheduler(tiny_llama):
    """A fault the device does not survive is not a 500 to serve on: step raises DeviceLost."""
    from radixlm.runtime.scheduler.scheduler import DeviceLost

    engine = tiny_llama.engine()
    worker = engine.worker

    def broken(batch):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    worker.forward = broken
    worker.usable_after_fault = lambda: False
    sched = engine.scheduler
    sched.add_request(TokenizedRequest("a", tiny_llama.prompts[0], SamplingParams(**GREEDY)))
    with pytest.raises(DeviceLost, match="illegal memory access"):
        sched.step()
    (out,) = sched.fail_all("the device is gone")
    assert out.rid == "a" and out.finish_reason == {"type": "abort", "message": "the device is gone", "status": 500}
    assert not sched._live


def test_the_probe_passes_a_healthy_cpu_and_fails_tensor_parallel_ranks(tiny_llama):
    from radixlm.runtime.worker.parallel import TPContext

    worker = tiny_llama.engine().worker
    assert worker.usable_after_fault()
    worker.tp = TPContext(rank=0, size=2)  # after a fault the ranks may be inside different collectives
    assert not worker.usable_after_fault()


# ---- jump-forward next to EOS and stop tokens ------------------------------------------------------------------


def _force_tokens(engine, choose) -> None:
    """Replace the sampled token of the (single) running request by `choose(output_ids)` when it
    returns one: a stand-in for a sampler that happened to draw it."""
    forward, sched = engine.worker.forward, engine.scheduler

    def steered(batch):
        out = forward(batch).settle()  # (its sampled tokens read: they come back pending)
        (req,) = sched._live.values()
        if out.next_token_ids:
            token = choose(req.output_ids)
            if token is not None:
                out.next_token_ids[0] = token
        return out

    engine.worker.forward = steered


def test_an_eos_kept_under_ignore_eos_does_not_shift_the_jump(smol):
    """The guide never takes an EOS that ignore_eos keeps in the output; a jump after one must not
    re-encode it. Before: the window spanned the EOS, the guide rolled back one state too many and
    the re-encoded text did not parse (decoded token by token, or a 500)."""
    engine = smol.engine_with()
    tok, eos = engine.tokenizer, engine.worker.config.eos_token_ids[0]
    # "The": the forced "n the ..." continues its pre-token, so the re-encoding starts before it
    the = tok.encode("The", add_special_tokens=False)
    assert len(the) == 1
    plan = {"eos": False, "then": False}

    def choose(out):
        text = tok.decode([t for t in out if t != eos])
        if not plan["eos"] and text.endswith("follow."):
            plan["eos"] = True
            return eos
        if plan["eos"] and not plan["then"] and out and out[-1] == eos:
            plan["then"] = True
            return the[0]
        return None

    _force_tokens(engine, choose)
    res = engine.generate(input_ids=smol.prompts[0], sampling_params={
        "regex": r"(Then the forced words follow\.)+", "ignore_eos": True, "temperature": 0, "max_new_tokens": 30})
    assert plan == {"eos": True, "then": True}, "the steering never happened"
    ids = res["output_ids"]
    first = ids.index(eos)
    after = [t for t in ids[first:] if t != eos]
    assert tok.decode(ids[:first]) == "Then the forced words follow."
    assert tok.decode(after).startswith("Then the forced words follow."), tok.decode(ids, skip_special_tokens=False)
    assert res["meta_info"]["finish_reason"]["type"] == "length"
    assert engine.scheduler.jumped_tokens > 0
    assert_drained(engine)


def test_a_stop_token_inside_jumped_text_ends_the_request_there(smol):
    engine = smol.engine
    tok = engine.tokenizer
    answer = tok.encode(" answer", add_special_tokens=False)
    assert len(answer) == 1
    res = engine.generate(input_ids=smol.prompts[0], sampling_params={
        "regex": r"The answer is (yes|no)\.", "temperature": 0, "max_new_tokens": 20, "stop_token_ids": answer})
    assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": answer[0]}
    assert res["output_ids"][-1] == answer[0] and res["output_ids"].count(answer[0]) == 1
    assert tok.decode(res["output_ids"]) == "The answer"
    assert_drained(engine)


# ---- a request alone at the pool's limit -----------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_lone_request_that_fills_the_pool_ends_with_length(tiny_llama, page_size):
    """Admitted alone without its decode reservation, it may reach the end of the pool: that is
    the pool's length limit, not an abort."""
    pool = 64
    engine = tiny_llama.engine(max_total_tokens=pool, page_size=page_size)
    prompt = tiny_llama.prompts[0][:40]
    res = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 200, "temperature": 0,
                                                             "ignore_eos": True})
    finish = res["meta_info"]["finish_reason"]
    assert finish["type"] == "length", finish
    n = len(res["output_ids"])
    assert n == pool - len(prompt) + 1, (n, len(prompt))  # every slot used; the last token needs none
    (ref,) = hf_greedy(tiny_llama.hf, [prompt], n)
    assert_matches(res["output_ids"], ref, "the lone request")
    assert_drained(engine)


def test_a_prompt_larger_than_the_pool_is_refused_up_front(tiny_llama):
    engine = tiny_llama.engine(max_total_tokens=32)
    with pytest.raises(BadRequest, match="max-total-tokens"):
        engine.generate(input_ids=tiny_llama.prompts[8], sampling_params={"max_new_tokens": 4})
    ok = engine.generate(input_ids=tiny_llama.prompts[2][:8], sampling_params={"max_new_tokens": 4})
    assert ok["meta_info"]["finish_reason"]["type"] == "length"
    assert_drained(engine)
