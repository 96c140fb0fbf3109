"""Engine behaviour beyond greedy parity: prefix reuse, logprobs, sampling, stops, aborts, errors."""

from __future__ import annotations

import json
import os

import pytest

from conftest import TINY_VOCAB
from helpers import assert_drained
from oracle import LOGPROB_TOL, assert_matches, hf_logprobs
from radixlm.runtime.messages import TokenizedRequest
from radixlm.runtime.sampling_params import SamplingParams, SamplingParamsError
from radixlm.runtime.native import BadRequest


def _count_fed_tokens(engine) -> list[int]:
    """Record how many tokens each forward pass computes."""
    fed: list[int] = []
    forward = engine.worker.forward

    def counting(batch):
        fed.append(batch.input_ids.numel())
        return forward(batch)

    engine.worker.forward = counting
    return fed


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefix_reuse_computes_only_the_rest(smol, page_size):
    engine = smol.engine_with(page_size=page_size)
    tok = engine.tokenizer
    doc = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(40))
    shared = tok.encode(doc, add_special_tokens=False)
    assert len(shared) >= 200
    first = shared + tok.encode(" Question: what is 3 squared?", add_special_tokens=False)
    second = shared + tok.encode(" Question: what is 7 squared?", add_special_tokens=False)
    params = {"max_new_tokens": 4, "temperature": 0}
    engine.generate(input_ids=first, sampling_params=params)
    fed = _count_fed_tokens(engine)
    res = engine.generate(input_ids=second, sampling_params=params)
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    expected_hit = common // page_size * page_size
    cached = res["meta_info"]["cached_tokens"]
    assert cached >= expected_hit >= 200
    assert fed[0] == len(second) - cached, "the prefill must compute only the uncached tokens"
    assert all(n == 1 for n in fed[1:]), "then one token per decode step"
    assert_drained(engine)


def test_prompt_and_output_logprobs_match_hf(tiny_llama):
    engine = tiny_llama.engine()
    prompt = tiny_llama.prompts[3]
    res = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 8, "temperature": 0},
                          return_logprob=True, logprob_start_len=0, top_logprobs_num=3)
    meta = res["meta_info"]
    ref = hf_logprobs(tiny_llama.hf, prompt + res["output_ids"])
    inputs = meta["input_token_logprobs"]
    assert len(inputs) == len(prompt) and inputs[0][0] is None
    for pos in range(1, len(prompt)):
        lp, tok, _ = inputs[pos]
        assert tok == prompt[pos]
        assert lp == pytest.approx(ref[pos - 1, tok].item(), abs=LOGPROB_TOL)
    outputs = meta["output_token_logprobs"]
    for i, (lp, tok, _) in enumerate(outputs):
        assert lp == pytest.approx(ref[len(prompt) - 1 + i, tok].item(), abs=LOGPROB_TOL)
    top = meta["output_top_logprobs"][0]
    ref_top = ref[len(prompt) - 1].topk(3)
    assert [t for _, t, _ in top] == ref_top.indices.tolist()
    assert_drained(engine)


def test_a_one_token_prompt_has_its_one_null_prompt_logprob(tiny_llama):
    engine = tiny_llama.engine()
    token = tiny_llama.prompts[3][0]
    res = engine.generate(input_ids=[token], sampling_params={"max_new_tokens": 2, "temperature": 0},
                          return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    assert res["meta_info"]["input_token_logprobs"] == [[None, token, None]]
    assert res["meta_info"]["input_top_logprobs"] == [None] and len(res["meta_info"]["output_token_logprobs"]) == 2
    assert_drained(engine)


def test_prompt_logprobs_from_a_start_survive_chunking_and_cache(tiny_llama):
    engine = tiny_llama.engine(chunked_prefill_size=8)
    prompt = tiny_llama.prompts[7]  # shares a 40-token prefix with other prompts
    engine.generate(input_ids=tiny_llama.prompts[8], sampling_params={"max_new_tokens": 1})  # cache the prefix
    start = 5
    res = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0},
                          return_logprob=True, logprob_start_len=start)
    ref = hf_logprobs(tiny_llama.hf, prompt)
    got = res["meta_info"]["input_token_logprobs"]
    assert res["output_ids"] == [] and res["meta_info"]["finish_reason"]["type"] == "length"
    assert [t for _, t, _ in got] == prompt[start:]
    for k, (lp, tok, _) in enumerate(got):
        assert lp == pytest.approx(ref[start + k - 1, tok].item(), abs=LOGPROB_TOL)
    assert_drained(engine)


def test_seeded_sampling_reproducible_across_batches(tiny_llama):
    engine = tiny_llama.engine()
    p = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.9, "seed": 42}
    alone = engine.generate(input_ids=tiny_llama.prompts[0], sampling_params=p)["output_ids"]
    others = [dict(p, seed=s) for s in range(5)]
    batch = engine.generate(input_ids=tiny_llama.prompts[1:6] + [tiny_llama.prompts[0]], sampling_params=others + [p])
    assert batch[-1]["output_ids"] == alone
    assert len({tuple(r["output_ids"]) for r in batch}) > 1, "different seeds should differ"
    assert_drained(engine)


def test_top_k_one_equals_greedy(tiny_llama):
    engine = tiny_llama.engine()
    greedy = engine.generate(input_ids=tiny_llama.prompts[:4], sampling_params={"max_new_tokens": 12, "temperature": 0})
    topk = engine.generate(input_ids=tiny_llama.prompts[:4],
                           sampling_params={"max_new_tokens": 12, "temperature": 0.8, "top_k": 1})
    assert [r["output_ids"] for r in greedy] == [r["output_ids"] for r in topk]


def test_stop_token_and_min_new_tokens(tiny_llama):
    engine = tiny_llama.engine()
    base = engine.generate(input_ids=tiny_llama.prompts[2], sampling_params={"max_new_tokens": 12, "temperature": 0})
    ids = base["output_ids"]
    stop_tok = ids[5]
    first = ids.index(stop_tok)
    res = engine.generate(input_ids=tiny_llama.prompts[2],
                          sampling_params={"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [stop_tok]})
    assert res["output_ids"] == ids[: first + 1]
    assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    forced = engine.generate(input_ids=tiny_llama.prompts[2], sampling_params={
        "max_new_tokens": 12, "temperature": 0, "stop_token_ids": [stop_tok], "min_new_tokens": first + 2})
    assert len(forced["output_ids"]) >= first + 2 and stop_tok not in forced["output_ids"][: first + 2]
    assert_drained(engine)


def test_stop_string_trims_text(smol):
    engine = smol.engine
    prompt = engine.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    full = engine.generate(prompt, {"max_new_tokens": 16, "temperature": 0})
    assert "Paris" in full["text"]
    res = engine.generate(prompt, {"max_new_tokens": 16, "temperature": 0, "stop": ["Paris"]})
    assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": "Paris"}
    assert res["text"] == full["text"][: full["text"].index("Paris")]
    assert_drained(engine)


def test_no_stop_trim_keeps_the_stop_string(smol):
    engine = smol.engine
    prompt = engine.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    full = engine.generate(prompt, {"max_new_tokens": 16, "temperature": 0})["text"]
    res = engine.generate(prompt, {"max_new_tokens": 16, "temperature": 0, "stop": "Paris", "no_stop_trim": True})
    assert res["text"] == full[: full.index("Paris") + len("Paris")]
    assert_drained(engine)


@pytest.mark.parametrize("pattern", [r"\bParis\b", r"[.!]"])
def test_stop_regex_ends_at_the_token_completing_the_first_match(smol, pattern):
    """As in SGLang: the match stays in the text, and the finish reason names the pattern."""
    import re

    engine = smol.engine
    prompt = engine.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    full = engine.generate(prompt, {"max_new_tokens": 24, "temperature": 0})
    ids = full["output_ids"]
    decode = engine.tokenizer.decode
    k = next(k for k in range(1, len(ids) + 1) if re.search(pattern, decode(ids[:k], skip_special_tokens=False)))
    res = engine.generate(prompt, {"max_new_tokens": 24, "temperature": 0, "stop_regex": [pattern]})
    assert res["output_ids"] == ids[:k] and res["text"] == decode(ids[:k], skip_special_tokens=True)
    assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert_drained(engine)


def test_abort_releases_kv(tiny_llama):
    engine = tiny_llama.engine()
    sched = engine.scheduler
    for i, p in enumerate(tiny_llama.prompts[:3]):
        sched.add_request(TokenizedRequest(f"a{i}", p, SamplingParams(max_new_tokens=30, temperature=0)))
    sched.step()
    sched.step()
    out = sched.abort("a1")
    assert out is not None and out.finish_reason["type"] == "abort"
    assert sched.abort("nope") is None and sched.abort("a1") is None
    assert {r.rid for r in sched.running} == {"a0", "a2"}  # the others run on
    while sched.has_work:
        sched.step()
    assert_drained(engine)


def test_bad_requests_raise_clear_errors(tiny_llama):
    engine = tiny_llama.engine()
    with pytest.raises(SamplingParamsError, match="max_tokens"):
        engine.generate(input_ids=[5, 6], sampling_params={"max_tokens": 3})
    with pytest.raises(SamplingParamsError, match="top_p"):
        engine.generate(input_ids=[5, 6], sampling_params={"top_p": 1.5})
    with pytest.raises(BadRequest, match="empty"):
        engine.generate(input_ids=[], sampling_params={})
    with pytest.raises(BadRequest, match="context length"):
        engine.generate(input_ids=[5] * 5000)
    with pytest.raises(BadRequest, match=str(TINY_VOCAB)):
        engine.generate(input_ids=[5, TINY_VOCAB + 3])
    with pytest.raises(ValueError, match="input_ids"):
        engine.generate("text but no tokenizer")
    assert_drained(engine)


def test_bad_model_paths(tmp_path):
    from radixlm.runtime.local_engine import LocalEngine
    from radixlm.runtime.model_config import UnsupportedModelError

    with pytest.raises(FileNotFoundError, match="does not exist"):
        LocalEngine(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        LocalEngine(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10,
                                                      "hidden_size": 8, "intermediate_size": 8,
                                                      "num_hidden_layers": 1, "num_attention_heads": 2}))
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        LocalEngine(str(tmp_path), skip_tokenizer_init=True)
    assert os.path.exists(tmp_path / "config.json")


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_batch_sharing_a_prefix_prefills_it_once(tiny_llama, policy):
    engine = tiny_llama.engine(schedule_policy=policy, page_size=4)
    prefix = (tiny_llama.prompts[9] + tiny_llama.prompts[3])[:100]
    assert len(prefix) == 100
    prompts = [prefix + [7 + i, 9 + i] for i in range(6)]
    fed = _count_fed_tokens(engine)
    results = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 3, "temperature": 0})
    cached = sorted(r["meta_info"]["cached_tokens"] for r in results)
    assert cached[0] == 0 and all(c == 100 for c in cached[1:]), cached
    assert sum(fed) == 100 + 6 * 2 + 6 * 2, "the prefix is computed once, then 2 tokens per request and 2 decodes"
    alone = [engine.generate(input_ids=p, sampling_params={"max_new_tokens": 3, "temperature": 0})["output_ids"]
             for p in prompts]
    assert alone == [r["output_ids"] for r in results]
    assert_drained(engine)


def test_max_running_requests_caps_the_batch(tiny_llama):
    engine = tiny_llama.engine(max_running_requests=2)
    sched = engine.scheduler
    for i, p in enumerate(tiny_llama.prompts[:6]):
        sched.add_request(TokenizedRequest(f"m{i}", p, SamplingParams(max_new_tokens=8, temperature=0)))
    outputs: dict[str, list[int]] = {}
    peak = 0
    while sched.has_work:
        for out in sched.step():
            outputs.setdefault(out.rid, []).extend(out.new_token_ids)
        peak = max(peak, len(sched.running) + (sched.chunked is not None))
    assert peak == 2
    for i, ref in enumerate(tiny_llama.refs[:6]):
        assert_matches(outputs[f"m{i}"], ref.truncated(8), f"max-running prompt {i}")
    assert_drained(engine)


def _step_until_done(sched, arrivals: dict[int, list[TokenizedRequest]], limit: int = 60) -> dict:
    """Step the scheduler, adding `arrivals[step]` before that step; every request's tokens by id
    and its finish reason under "<id>.finish"."""
    finished: dict = {}
    for step in range(limit):
        for tr in arrivals.get(step, []):
            sched.add_request(tr)
        for out in sched.step():
            finished.setdefault(out.rid, []).extend(out.new_token_ids)
            if out.finish_reason:
                finished[out.rid + ".finish"] = out.finish_reason
        if not sched.has_work:
            break
    return finished


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_running_request_that_faults_fails_alone_and_the_prompts_beside_it_run_after(tiny_llama, page_size, caplog):
    """The other way round: the mixed pass faults because of its decode row. The decodes alone
    fault again, so they fail; the prompt that rode with them steps back and runs next step."""
    engine = tiny_llama.engine(page_size=page_size)
    sched, forward, calls = engine.scheduler, engine.worker.forward, []

    def flaky(batch):
        calls.append(batch.input_ids.numel())
        if sched._live.get("a") is not None and sched._live["a"].row in batch.req_rows.tolist() and len(calls) >= 3:
            raise RuntimeError("injected fault")
        return forward(batch)

    engine.worker.forward = flaky
    greedy = dict(max_new_tokens=12, temperature=0)
    a, b = tiny_llama.prompts[0], tiny_llama.prompts[1]
    sched.add_request(TokenizedRequest("a", a, SamplingParams(**greedy)))
    finished = _step_until_done(sched, {2: [TokenizedRequest("b", b, SamplingParams(**greedy))]})
    assert calls[2:5] == [1 + len(b), 1, len(b)], "mixed pass, a's decode alone, then b's prefill alone"
    assert finished["a.finish"]["status"] == 500 and "error id" in finished["a.finish"]["message"]
    assert finished["b.finish"]["type"] == "length"
    assert_matches(finished["b"], tiny_llama.refs[1].truncated(12), "b, after stepping back")
    assert_drained(engine)


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_forward_that_raises_fails_its_batch_and_the_rest_carry_on(tiny_llama, page_size, caplog):
    engine = tiny_llama.engine(page_size=page_size, max_running_requests=2)
    sched, forward, calls = engine.scheduler, engine.worker.forward, []

    def flaky(batch):
        calls.append(batch.input_ids.numel())
        if len(calls) == 3:
            raise RuntimeError("injected fault")
        return forward(batch)

    engine.worker.forward = flaky
    greedy = dict(max_new_tokens=12, temperature=0)
    a, b, c = tiny_llama.prompts[0], tiny_llama.prompts[1], tiny_llama.prompts[2]
    sched.add_request(TokenizedRequest("a", a, SamplingParams(**greedy)))
    # a is decoding; b's prefill rides with a's token in the failing pass; c waits (two may run)
    finished = _step_until_done(sched, {2: [TokenizedRequest("b", b, SamplingParams(**greedy)),
                                            TokenizedRequest("c", c, SamplingParams(**greedy))]})
    assert calls[2] == 1 + len(b), "the third pass is a's decode and b's prefill"
    assert calls[3] == 1, "then a's decode alone, to tell whose fault it was"
    fail = finished["b.finish"]
    assert fail["type"] == "abort" and fail["status"] == 500 and "error id" in fail["message"]
    error_id = fail["message"].split("error id ")[1].rstrip(")")
    assert error_id in caplog.text and "injected fault" in caplog.text  # the traceback is logged under the id
    assert finished["a.finish"]["type"] == "length"
    assert_matches(finished["a"], tiny_llama.refs[0].truncated(12), "a, decoding past the failure")
    assert finished["c.finish"]["type"] == "length"
    assert_matches(finished["c"], tiny_llama.refs[2].truncated(12), "c, admitted after the failure")
    assert_drained(engine)
    retry = engine.generate(input_ids=b, sampling_params=greedy)  # the engine serves on, from a clean cache
    assert_matches(retry["output_ids"], tiny_llama.refs[1].truncated(12), "b, retried")
    assert_drained(engine)
