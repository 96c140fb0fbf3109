"""Greedy tokens equal Hugging Face transformers on the same weights, for every supported family."""

from __future__ import annotations

import pytest
import torch

from oracle import LOGPROB_TOL, assert_matches, hf_logprobs
from radixlm.runtime.local_engine import LocalEngine
from conftest import NEW_TOKENS
from helpers import assert_drained

GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0}


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_tiny_models_match_hf(tiny, overlap):
    engine = tiny.engine(overlap_schedule=overlap)
    results = engine.generate(input_ids=tiny.prompts, sampling_params=GREEDY, return_logprob=overlap == "off",
                              logprob_start_len=0)
    for i, (res, ref) in enumerate(zip(results, tiny.refs)):
        assert_matches(res["output_ids"], ref, f"{tiny.kind} prompt {i}")
    assert (engine.scheduler.overlapped_steps > 0) == (overlap == "on")
    if overlap == "off":
        _assert_logprobs_are_hfs(tiny, results)
    assert_drained(engine)


def _assert_logprobs_are_hfs(tiny, results) -> None:
    """The distributions, not only their argmax (Granite's logits scaling leaves the argmax be):
    every prompt and output token's logprob of the first three requests, teacher-forced in HF."""
    for prompt, res in zip(tiny.prompts[:3], results):
        ref = hf_logprobs(tiny.hf, prompt + res["output_ids"])
        got = [lp for lp, _, _ in res["meta_info"]["input_token_logprobs"][1:]]
        got += [lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]]
        want = ref[:-1].gather(1, torch.tensor(prompt[1:] + res["output_ids"])[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(got), want, atol=LOGPROB_TOL, rtol=0), (tiny.kind, got, want)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_tiny_models_match_hf_on_a_shared_prefix_batch(tiny, overlap):
    engine = tiny.engine(page_size=16, overlap_schedule=overlap)
    results = engine.generate(input_ids=tiny.shared_prompts, sampling_params=GREEDY)
    assert sum(r["meta_info"]["cached_tokens"] for r in results) >= 7 * 64
    for i, (res, ref) in enumerate(zip(results, tiny.shared_refs)):
        assert_matches(res["output_ids"], ref, f"{tiny.kind} shared-prefix prompt {i}")
    assert_drained(engine)


def test_smollm2_matches_hf(smol):
    results = smol.engine.generate(input_ids=smol.prompts, sampling_params=GREEDY)
    flips = [assert_matches(r["output_ids"], ref, f"smollm2 prompt {i}")
             for i, (r, ref) in enumerate(zip(results, smol.refs))]
    assert sum(f > 0 for f in flips) <= 1, f"near-tie flips in more than one of 8 prompts is suspicious: {flips}"
    assert_drained(smol.engine)


def test_smollm2_answers_sensibly(smol):
    text = smol.engine.generate(smol.engine.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
                                {"max_new_tokens": 16, "temperature": 0})["text"]
    assert "Paris" in text


@pytest.mark.parametrize("page_size", [1, 16])
def test_tiny_models_match_hf_on_the_native_attention(tiny, page_size):
    """The native backend (rotary fused with the K/V store, decode attention over the pool in
    place; Qwen3's q/k norms take its unfused path) on fp32 weights, so HF is the oracle."""
    engine = tiny.engine(attention_backend="native", page_size=page_size)
    assert type(engine.worker.attn_backend).__name__ == "NativeAttention"
    results = engine.generate(input_ids=tiny.prompts + tiny.shared_prompts, sampling_params=GREEDY)
    for i, (res, ref) in enumerate(zip(results, tiny.refs + tiny.shared_refs)):
        assert_matches(res["output_ids"], ref, f"{tiny.kind} prompt {i}, native attention, page size {page_size}")
    assert_drained(engine)


def test_tiny_models_from_gguf_match_hf(tiny, tmp_path):
    """The same weights written as llama.cpp lays out a GGUF (tests/gguf_files.py: its names, its
    metadata keys, its q/k permutation): served from the file, the same greedy tokens as HF on the
    checkpoint. The tiny Llama's llama3 rotary scaling is a rope_freqs tensor there (each
    frequency's divisor, as llama.cpp's converter writes Llama 3.1's)."""
    from gguf_files import write_gguf

    engine = LocalEngine(write_gguf(tiny.path, str(tmp_path / f"{tiny.kind}.gguf")), skip_tokenizer_init=True,
                         max_total_tokens=8192, quantization="none")
    try:
        # llama.cpp writes a Mistral as a Llama
        assert engine.worker.config.architecture == type(tiny.hf).__name__.replace("Mistral", "Llama")
        results = engine.generate(input_ids=tiny.prompts, sampling_params=GREEDY, return_logprob=True,
                                  logprob_start_len=0)
        for i, (res, ref) in enumerate(zip(results, tiny.refs)):
            assert_matches(res["output_ids"], ref, f"{tiny.kind} from GGUF, prompt {i}")
        _assert_logprobs_are_hfs(tiny, results)
        assert_drained(engine)
    finally:
        engine.shutdown()
