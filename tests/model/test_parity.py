"""Greedy tokens equal Hugging Face transformers on the same weights, for every supported family."""

from __future__ import annotations

import threading

import pytest
import torch

from oracle import LOGPROB_TOL, assert_matches, hf_logprobs
from radixlm.runtime.local_engine import LocalEngine
from conftest import NEW_TOKENS
from helpers import assert_drained

GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0}


def test_tiny_models_match_hf(tiny):
    engine = tiny.engine(overlap_schedule="off")
    results = engine.generate(input_ids=tiny.prompts, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
    for i, (res, ref) in enumerate(zip(results, tiny.refs)):
        assert_matches(res["output_ids"], ref, f"{tiny.kind} prompt {i}")
    assert engine.scheduler.overlapped_steps == 0
    _assert_logprobs_are_hfs(tiny, results)
    assert_drained(engine)


# Overlap scheduling is the scheduler's, the same whatever the layers: three families whose steps
# differ (plain Llama layers, q/k norms, sliding windows beside global layers)
@pytest.mark.parametrize("tiny", ["llama", "qwen3", "gemma3"], indirect=True)
def test_tiny_models_match_hf_overlapped(tiny):
    """Also: the step thread never waits for a step's sampled tokens (on CUDA that wait would leave
    the GPU idle until the next launch): each output it returns still has them on their way, and
    the scheduler settles them, logprobs too."""
    for prompts, refs, pages in ((tiny.prompts, tiny.refs, 0), (tiny.shared_prompts, tiny.shared_refs, 16)):
        engine = tiny.engine(overlap_schedule="on", page_size=pages)
        forward, unread = engine.worker.forward, []

        def recording(batch):
            out = forward(batch)
            unread.append(out.pending is not None and threading.current_thread().name.startswith("radixlm-step"))
            return out

        engine.worker.forward = recording
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
        for i, (res, ref) in enumerate(zip(results, refs)):
            assert_matches(res["output_ids"], ref, f"{tiny.kind} prompt {i}, overlapped, page size {pages}")
            logprobs = [lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]]
            assert len(logprobs) == len(res["output_ids"]) and all(lp <= 0 for lp in logprobs), logprobs
        assert engine.scheduler.overlapped_steps > 0
        assert unread and all(unread), unread
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


def test_tiny_models_match_hf_on_a_shared_prefix_batch(tiny):
    engine = tiny.engine(page_size=16, overlap_schedule="off")
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


def test_phi3_long_rope_past_its_original_context(tmp_path):
    """A Phi-3 whose context (1,024) passes its original one (64) is served on LongRoPE's long
    factors, its tables scaled by the attention factor, as HF takes them for a sequence longer
    than the original context: a 160-token sequence's prompt logprobs are HF's, from the HF
    directory and from the GGUF file (its rope_factors_long / _short tensors and keys)."""
    import transformers

    from conftest import make_tiny_checkpoint
    from gguf_files import write_gguf
    from oracle import random_prompts

    path = str(tmp_path / "phi3")
    make_tiny_checkpoint("phi3", path, original_max_position_embeddings=64)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    sequence = random_prompts(hf.config.vocab_size, 1, seed=3, min_len=160, max_len=160)[0]
    want = hf_logprobs(hf, sequence)[:-1].gather(1, torch.tensor(sequence[1:])[:, None]).squeeze(1)
    for source in (path, write_gguf(path, str(tmp_path / "phi3.gguf"))):
        engine = LocalEngine(source, skip_tokenizer_init=True, max_total_tokens=4096, quantization="none")
        try:
            out = engine.generate(input_ids=sequence, sampling_params={"max_new_tokens": 1, "temperature": 0},
                                  return_logprob=True, logprob_start_len=0)
            got = torch.tensor([lp for lp, *_ in out["meta_info"]["input_token_logprobs"][1:]])
            assert torch.allclose(got, want, atol=LOGPROB_TOL, rtol=0), (source, (got - want).abs().max())
            assert_drained(engine)
        finally:
            engine.shutdown()
