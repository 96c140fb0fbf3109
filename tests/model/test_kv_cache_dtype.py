"""--kv-cache-dtype end to end: each KV type served through each attention backend against HF fp32
within its measured tolerance, the default's choice, --deterministic bitwise on each type, and
the refusals named.

Tolerances are per type, about 2.5x the largest error measured (tiny Llama, 12 prompts and 32
greedy tokens, the torch, native and Triton backends; benchmarks/README.md has the long-text table): |logprob - HF's|
at most TOLERANCE[type], and a greedy token may differ from HF's only where HF's top two are
that close (a near-tie for arithmetic that rounds the keys and values to the type).
"""

from __future__ import annotations

import pytest
import torch

from conftest import NEW_TOKENS
from helpers import assert_drained
from oracle import assert_matches, hf_logprobs

GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0}
# measured on the tiny Llama: fp16 1.2e-3, bf16 8.6e-3, int8 2.8e-2 (head_dim 16: coarse int8 rows)
TOLERANCE = {"fp16": 3e-3, "bf16": 2e-2, "int8": 6e-2}


def _assert_near_hf(tiny, results, prompts, refs, tolerance: float, context: str) -> None:
    for i, (res, ref) in enumerate(zip(results, refs)):
        assert_matches(res["output_ids"], ref, f"{context} prompt {i}", near_tie=tolerance)
    for prompt, res in zip(prompts[:3], results):  # the distributions: prompt and output logprobs, teacher-forced
        ref = hf_logprobs(tiny.hf, prompt + res["output_ids"])
        got = [lp for lp, _, _ in res["meta_info"]["input_token_logprobs"][1:]]
        got += [lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]]
        want = ref[:-1].gather(1, torch.tensor(prompt[1:] + res["output_ids"])[:, None]).squeeze(1)
        err = (torch.tensor(got) - want).abs().max().item()
        assert err <= tolerance, (context, err)


@pytest.mark.parametrize("backend,kv", [("torch", "fp16"), ("torch", "bf16"), ("torch", "int8"), ("native", "fp16"),
                                        ("native", "int8")])
def test_each_kv_type_is_hfs_within_its_rounding(tiny_llama, backend, kv):
    """The pool in the type (its bytes per token halved, or int8's codes and scales), written and
    read by the backend: HF's greedy tokens and logprobs within the type's tolerance; prompts that
    share a 64-token prefix on pages of 16 (the cascade's shared-prefix pass, the native sets)."""
    engine = tiny_llama.engine(kv_cache_dtype=kv, attention_backend=backend, overlap_schedule="off")
    kv_info = engine.worker.kv_info()
    assert kv_info == {"kv_cache_dtype": kv, "kv_bytes_per_token": 2 * 2 * 2 * (16 + 4 if kv == "int8" else 16) * (
        1 if kv == "int8" else 2)}  # 2 layers x K, V x 2 KV heads x a row of 16
    prompts = tiny_llama.prompts[::2]  # short and long, alone and on the second half's common prefix
    results = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
    _assert_near_hf(tiny_llama, results, prompts, tiny_llama.refs[::2], TOLERANCE[kv], f"{backend} {kv}")
    assert_drained(engine)
    paged = tiny_llama.engine(kv_cache_dtype=kv, attention_backend=backend, page_size=16)
    shared = paged.generate(input_ids=tiny_llama.shared_prompts[:4], sampling_params=GREEDY)
    assert sum(r["meta_info"]["cached_tokens"] for r in shared) >= 3 * 64
    for i, (res, ref) in enumerate(zip(shared, tiny_llama.shared_refs)):
        assert_matches(res["output_ids"], ref, f"{backend} {kv} shared prompt {i}", near_tie=TOLERANCE[kv])
    assert_drained(paged)


def test_the_triton_kernels_read_an_int8_pool(tiny_llama):
    """The Triton backend (its interpreter on a CPU: a few prompts, 12 tokens) stores int8 rows with
    their scales and its decode and extend kernels read them: HF's tokens within int8's tolerance."""
    engine = tiny_llama.engine(kv_cache_dtype="int8", attention_backend="triton", page_size=16, chunked_prefill_size=24)
    results = engine.generate(input_ids=tiny_llama.shared_prompts[:3], sampling_params={**GREEDY, "max_new_tokens": 12})
    assert sum(r["meta_info"]["cached_tokens"] for r in results) >= 64  # extends over a cached prefix ran
    for i, (res, ref) in enumerate(zip(results, tiny_llama.shared_refs)):
        assert_matches(res["output_ids"], ref.truncated(12), f"triton int8 prompt {i}", near_tie=TOLERANCE["int8"])
    assert_drained(engine)


@pytest.mark.parametrize("backend,kv", [("torch", "fp16"), ("torch", "int8"), ("native", "bf16"), ("native", "int8")])
def test_deterministic_is_bitwise_on_each_kv_type(tiny_llama, backend, kv):
    """--deterministic on a KV type (the invariant torch backend, or the native kernels' exact
    paths): one batch in 7-token chunks gives each request's tokens and logprobs, prompt logprobs
    included, bitwise as the request alone does."""
    prompts = [p[:40] for p in tiny_llama.prompts[:6]]  # different lengths, across the 64-key blocks' edges
    prompts[5] = (tiny_llama.prompts[5] * 4)[:70]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    engine = tiny_llama.engine(deterministic=True, kv_cache_dtype=kv, attention_backend=backend)
    alone = []
    for prompt in prompts:
        engine.flush_cache()
        r = engine.generate(input_ids=prompt, sampling_params=params, return_logprob=True, logprob_start_len=0)
        alone.append((r["output_ids"], r["meta_info"]["output_token_logprobs"], r["meta_info"]["input_token_logprobs"]))
    batched = tiny_llama.engine(deterministic=True, kv_cache_dtype=kv, attention_backend=backend, chunked_prefill_size=7)
    together = batched.generate(input_ids=prompts, sampling_params=[params] * len(prompts), return_logprob=True,
                                logprob_start_len=0)
    got = [(r["output_ids"], r["meta_info"]["output_token_logprobs"], r["meta_info"]["input_token_logprobs"])
           for r in together]
    assert got == alone
    assert_drained(batched)


def test_the_default_follows_the_weights_and_the_refusals_are_named(tiny_llama, tmp_path):
    """auto: fp32 where the weights are served exactly in fp32 (a dense checkpoint: HF's arithmetic);
    16 bits where they are on the codes: fp16 where the CPU has F16C. fp8 needs a GPU, int8 a head
    dimension divisible by 4."""
    from conftest import make_tiny_checkpoint
    from radixlm.kernels.cpu.build import cpu_flags
    from radixlm.runtime.local_engine import LocalEngine

    assert tiny_llama.engine().worker.kv_info()["kv_cache_dtype"] == "fp32"
    codes = LocalEngine(tiny_llama.path, skip_tokenizer_init=True, quantization="int8", max_total_tokens=256)
    assert codes.worker.kv_info()["kv_cache_dtype"] == ("fp16" if "f16c" in cpu_flags() else "bf16")
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8_e4m3 runs on GPUs only"):
        tiny_llama.engine(kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp32"):
        tiny_llama.engine(kv_cache_dtype="e5m2")
    make_tiny_checkpoint("llama", str(tmp_path), hidden_size=40)  # 4 heads of 10 dimensions
    with pytest.raises(ValueError, match="int8 .+ needs a head dimension divisible by 4, not 10"):
        LocalEngine(str(tmp_path), skip_tokenizer_init=True, kv_cache_dtype="int8", max_total_tokens=256)
