"""--deterministic: a request's tokens and logprobs are bitwise the same whatever it shares a step
with, however its prompt is chunked, in whatever order requests arrive, whatever the prefix cache
holds, and after a retraction re-prefills its output. Compared with ==, never a tolerance.

The reference is each request alone on a fresh engine. Every variant below changes what the
worker computes for a token: other rows in its GEMMs, its prompt split into other chunks (so
its keys come from other steps), its prefix read from the cache (computed by another request,
possibly as decode tokens), its output recomputed as a prompt after a retraction.
"""

from __future__ import annotations

import pytest
import torch

from conftest import NEW_TOKENS
from helpers import assert_drained
from oracle import LOGPROB_TOL, assert_matches, hf_logprobs
from radixlm.runtime.messages import TokenizedRequest
from radixlm.runtime.sampling_params import SamplingParams

NEW = 10


def _params(i: int) -> dict:
    if i % 3 == 2:  # sampled under a seed: the same noise wherever the row sits
        return {"max_new_tokens": NEW, "temperature": 0.9, "top_k": 20, "seed": 100 + i, "ignore_eos": True}
    return {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}


def _prompts(tiny_llama) -> list[list[int]]:
    # different lengths (across the 16-row GEMM tiles and 64-key blocks), two sharing a long prefix
    p = tiny_llama.prompts
    return [p[0], p[1] + p[2] + p[3], p[4][:3], p[5] * 4, (p[5] * 4)[:70] + p[6], p[7] + p[8]]


def _key(result: dict) -> tuple:
    meta = result["meta_info"]
    return result["output_ids"], meta["output_token_logprobs"], meta.get("input_token_logprobs")


def _run(engine, prompts, prompt_logprobs: bool = False, order: list[int] | None = None) -> list[tuple]:
    """Tokens and output logprobs (and prompt logprobs, which bypass the prefix cache) of every
    request, submitted in `order`, returned in the prompts' order."""
    order = order or list(range(len(prompts)))
    results = engine.generate(input_ids=[prompts[i] for i in order], sampling_params=[_params(i) for i in order],
                              return_logprob=True, logprob_start_len=0 if prompt_logprobs else -1)
    assert_drained(engine)
    by_index = dict(zip(order, results))
    return [_key(by_index[i]) if prompt_logprobs else _key(by_index[i])[:2] for i in range(len(prompts))]


def _outputs(alone: list[tuple]) -> list[tuple]:
    return [a[:2] for a in alone]


@pytest.fixture(scope="module")
def alone(tiny_llama) -> list[tuple]:
    """Each request by itself, on a fresh engine with an empty cache, with its prompt logprobs."""
    engine = tiny_llama.engine(deterministic=True)
    out = []
    for i, prompt in enumerate(_prompts(tiny_llama)):
        engine.flush_cache()
        result = engine.generate(input_ids=prompt, sampling_params=_params(i), return_logprob=True,
                                 logprob_start_len=0)
        out.append(_key(result))
    return out


@pytest.mark.parametrize("chunk", [2048, 7, 64])
def test_one_batch_any_chunk_size_is_bitwise_the_same_as_alone(tiny_llama, alone, chunk):
    engine = tiny_llama.engine(deterministic=True, chunked_prefill_size=chunk)
    assert _run(engine, _prompts(tiny_llama), prompt_logprobs=True) == alone


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_arrival_order_and_a_warm_cache_change_nothing(tiny_llama, alone, overlap):
    engine = tiny_llama.engine(deterministic=True, chunked_prefill_size=16, overlap_schedule=overlap)
    prompts = _prompts(tiny_llama)
    warm = _run(engine, prompts, order=[5, 4, 3, 2, 1, 0])  # reversed; the cache now holds every prompt
    assert warm == _outputs(alone)
    sched = engine.scheduler
    outs: dict[str, list] = {}
    for step, i in enumerate([3, 0, 5, 1, 4, 2]):  # one arrival per step, into a running batch
        sched.add_request(TokenizedRequest(f"r{i}", prompts[i], SamplingParams.from_dict(_params(i)),
                                           return_logprob=True))
        for out in sched.step():
            outs.setdefault(out.rid, []).append(out)
    while sched.has_work:
        for out in sched.step():
            outs.setdefault(out.rid, []).append(out)
    for i, want in enumerate(alone):
        got = outs[f"r{i}"]
        assert [t for o in got for t in o.new_token_ids] == want[0], i
        assert [lp for o in got for lp in o.output_logprobs] == [lp for lp, *_ in want[1]], i
        assert got[-1].cached_tokens > 0, "the prompt was cached by the first run"
    assert (sched.overlapped_steps > 0) == (overlap == "on")
    assert_drained(engine)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_retraction_recomputes_outputs_bitwise(tiny_llama, alone, overlap):
    # four prompts (288 tokens) fill a 300-token pool; their outputs do not fit: some are retracted
    # and re-prefill their output tokens as prompt
    engine = tiny_llama.engine(deterministic=True, max_total_tokens=300, init_new_token_ratio=0.0,
                               min_new_token_ratio=0.0, overlap_schedule=overlap)
    picked = [0, 1, 2, 5]
    prompts = _prompts(tiny_llama)
    assert sum(len(prompts[i]) for i in picked) == 288
    results = engine.generate(input_ids=[prompts[i] for i in picked], sampling_params=[_params(i) for i in picked],
                              return_logprob=True)
    assert engine.scheduler.num_retractions > 0, "the pool was meant to force retractions"
    assert [_key(r)[:2] for r in results] == [_outputs(alone)[i] for i in picked]
    assert_drained(engine)


def test_smollm2_deterministic_is_batch_invariant_and_matches_transformers(smol):
    """At SmolLM2's real shapes (9 query / 3 KV heads, 576 wide): the same bitwise invariance,
    and the greedy tokens are still transformers' fp32 ones (flips only at certified near-ties)."""
    engine = smol.engine_with(deterministic=True)
    prompts = smol.prompts[:4]
    greedy = {"max_new_tokens": NEW_TOKENS, "temperature": 0}
    alone = []
    for prompt in prompts:
        engine.flush_cache()
        alone.append(_key(engine.generate(input_ids=prompt, sampling_params=greedy, return_logprob=True))[:2])
    chunked = smol.engine_with(deterministic=True, chunked_prefill_size=24)
    together = chunked.generate(input_ids=prompts, sampling_params=[greedy] * len(prompts), return_logprob=True)
    assert [_key(r)[:2] for r in together] == alone
    for (ids, _), ref in zip(alone, smol.refs):
        assert_matches(ids, ref, "deterministic")
    assert_drained(engine)
    assert_drained(chunked)


@pytest.mark.parametrize("tiny", ["qwen2", "qwen3", "granite", "olmo2", "smollm3", "gemma2", "gemma3", "gpt_oss", "qwen3_moe"],
                         indirect=True)
def test_every_family_batched_and_chunked_is_bitwise_alone(tiny):
    """Each family's variations (biases, q/k norms, post-norms, multipliers, layers without
    rotary, sliding windows, soft caps, sinks and experts) keep the guarantee: one batch with 16-token chunks, against each request alone. (The
    Llama layer, which Mistral's is, has the tests above.) Qwen3-MoE's router once ran outside the
    batch-invariant matmuls: a batch picked other experts than a request alone."""
    prompts = _prompts(tiny)
    engine = tiny.engine(deterministic=True)
    alone_runs = []
    for i, prompt in enumerate(prompts):
        engine.flush_cache()
        alone_runs.append(_key(engine.generate(input_ids=prompt, sampling_params=_params(i), return_logprob=True,
                                               logprob_start_len=0)))
    batched = tiny.engine(deterministic=True, chunked_prefill_size=16)
    assert _run(batched, prompts, prompt_logprobs=True) == alone_runs
    # and what they all agree on is the model's: the first request's logprobs against HF's
    ids, outputs, inputs = alone_runs[0]
    ref = hf_logprobs(tiny.hf, prompts[0] + ids)
    want = ref[:-1].gather(1, torch.tensor(prompts[0][1:] + ids)[:, None]).squeeze(1)
    got = torch.tensor([lp for lp, _, _ in inputs[1:]] + [lp for lp, _, _ in outputs])
    assert torch.allclose(got, want, atol=LOGPROB_TOL, rtol=0), (tiny.kind, got, want)
