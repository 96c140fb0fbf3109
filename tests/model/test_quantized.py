"""Quantized serving on SmolLM2's GGUF (Q4_1 layers, a Q8_0 table): what is served, its quality
against HF fp32 on the same file (teacher-forced, benchmarks/quality.py's measure), and the
runtime's invariants (KV accounting, --deterministic) on the quantized kernels."""

from __future__ import annotations

import os
import sys

import pytest

from helpers import assert_drained
from radixlm.kernels.cpu import build
from radixlm.runtime.local_engine import LocalEngine

sys.path.append(os.path.join(os.path.dirname(__file__), "..", ".."))  # after site-packages (kernels/)
from benchmarks.quality import hf_reference, make_text, score  # noqa: E402


@pytest.fixture(scope="module")
def served(smol):
    engine = LocalEngine(smol.path, tokenizer=smol.engine.tokenizer, max_total_tokens=4096)  # defaults: auto
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def text(smol):
    ids = make_text(384, smol.engine.tokenizer)
    return ids, hf_reference(smol.hf, ids)


def test_auto_serves_the_files_own_codes(served, smol):
    info = served.worker.weights_info()
    assert info["served_quantization"] == "int4"
    assert info["weight_formats"]["layers"] == "int4 g32: the file's Q4_1 codes"
    assert info["weight_formats"]["embedding and LM head"] == "int8 g32: the file's Q8_0 codes"
    # the best path this CPU runs: the library asks cpuid; /proc/cpuinfo is the independent view
    flags = set(build.cpu_flags())
    best = ("avx512" if {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags
            else "avx2" if {"avx2", "fma", "f16c"} <= flags else "portable")
    assert info["cpu_kernels"] == best and info["cpu_kernels_failure"] is None, (info["cpu_kernels"], flags)
    dense = smol.engine.worker.weights_info()
    assert dense["served_quantization"] == "none" and dense["cpu_kernels"] == "none"
    assert dense["weight_formats"]["layers"] == "dense float32 (dequantized from Q4_1)"
    v, k = 49152, 576  # the table: int8 codes and the file's fp16 scales, nothing else
    assert served.worker.model.embed_tokens.weight.nbytes == v * k + v * k // 32 * 2
    down = served.worker.model.layers[0].mlp.down_proj.weight  # [576, 1536]: half a byte a weight, fp16 d and m
    assert down.nbytes == 576 * 1536 // 2 + 576 * 1536 // 32 * 4  # Q4_1's own 20 bytes per 32 weights


def test_quality_against_hf_fp32(served, text):
    """On 384 tokens of the script's text: the full run (2,048 tokens) is benchmarks/quality.py's table."""
    ids, ref = text
    s = score(served, ids, ref)
    assert s["agreement"] >= 0.98, s
    assert s["flips"] - s["near_tie_flips"] <= 1, s  # a flip where HF itself has a clear favourite is a bug
    assert s["mean_abs_dlogprob"] < 0.04 and s["max_abs_dlogprob"] < 0.5, s
    assert abs(s["perplexity"] - 13.914) < 0.15, s  # HF fp32's on this text
    assert_drained(served)


def test_chat_and_batches_on_the_quantized_kernels(served):
    prompt = served.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = served.generate(prompt, {"max_new_tokens": 16, "temperature": 0})
    assert "Paris" in out["text"]
    # the same prompt in a batch of 12 and alone
    many = served.generate([prompt] + [f"Count to {i}:" for i in range(11)], {"max_new_tokens": 16, "temperature": 0})
    assert "Paris" in many[0]["text"]
    assert_drained(served)


def _greedy_with_and_without_the_decoder(engine, prompts, new_tokens):
    """The same batch run with decode steps in one native call, then op by op, from a flushed cache."""
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    decoder = engine.worker.native_decoder
    assert decoder is not None
    runs = []
    try:
        for on in (True, False):
            engine.worker.native_decoder = decoder if on else None
            engine.scheduler.flush_cache()
            steps = decoder.steps
            runs.append(engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True))
            assert (decoder.steps > steps) == on
            assert_drained(engine)
    finally:
        engine.worker.native_decoder = decoder
    return runs


def test_the_native_decoder_is_the_ops_bit_for_bit(served):
    """A decode step in one native call (runtime/worker/native_decoder.py) gives the same bits as
    the model's forward op by op: tokens and logprobs, in batches of 6 and 12 rows and in steps
    that do not fit it (prefill)."""
    tok = served.tokenizer
    prompts = [tok.encode(f"Story {i}: once upon a time" + " and then" * (3 * i), add_special_tokens=False)
               for i in range(12)]
    for batch in (prompts[:6], prompts):
        fused, ops = _greedy_with_and_without_the_decoder(served, batch, 12)
        for a, b in zip(fused, ops):
            assert a["output_ids"] == b["output_ids"]
            assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "granite", "olmo2", "smollm3", "mistral"])
def test_the_native_decoder_runs_tiny_families(kind, tmp_path):
    """Tied and untied tables, llama3 rotary scaling, Qwen2's qkv bias, a Mistral's window (every
    layer's, 12 keys, far shorter than the prompts): int8 codes through the decoder equal the same
    codes op by op. Qwen3's q/k norms, Granite's multipliers, OLMo 2's post-norms and SmolLM3's
    layers without rotary are not the decoder's: their steps run op by op."""
    from conftest import make_tiny_checkpoint
    from oracle import random_prompts

    make_tiny_checkpoint(kind, str(tmp_path), **({"sliding_window": 12} if kind == "mistral" else {}))
    if kind == "qwen2":  # HF starts biases at zero: give them values, so that a bias left out shows
        import torch
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(5))
        hf.save_pretrained(str(tmp_path))
    engine = LocalEngine(str(tmp_path), skip_tokenizer_init=True, max_total_tokens=4096, quantization="int8")
    try:
        if kind in ("qwen3", "granite", "olmo2", "smollm3"):
            assert engine.worker.native_decoder is None and not engine.worker.config.plain
            return
        if kind == "mistral":
            assert engine.worker.config.window(0) == 12 and engine.worker.native_decoder is not None
        fused, ops = _greedy_with_and_without_the_decoder(engine, random_prompts(512, 5, seed=3), 16)
        for a, b in zip(fused, ops):
            assert a["output_ids"] == b["output_ids"]
            assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
    finally:
        engine.shutdown()


def test_deterministic_on_quantized_weights(smol):
    engine = LocalEngine(smol.path, tokenizer=smol.engine.tokenizer, max_total_tokens=4096, deterministic=True)
    try:
        tok = engine.tokenizer
        prompts = [tok.encode(f"Story {i}: once upon a time" + " and then" * (3 * i), add_special_tokens=False)
                   for i in range(6)]
        params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        assert type(engine.worker.attn_backend).__name__ == "NativeAttention"  # the native kernels, invariant
        alone = [engine.generate(input_ids=p, sampling_params=params, return_logprob=True) for p in prompts]
        engine.scheduler.flush_cache()
        together = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        for a, b in zip(alone, together):
            assert a["output_ids"] == b["output_ids"]
            assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
        assert_drained(engine)
        # prompts prefilled 5 tokens a step, decoding beside them: the same bits again
        chunked = LocalEngine(smol.path, model=engine.worker.model, tokenizer=smol.engine.tokenizer,
                              max_total_tokens=4096, deterministic=True, chunked_prefill_size=5)
        try:
            again = chunked.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
            for a, b in zip(alone, again):
                assert a["output_ids"] == b["output_ids"]
                assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
            assert_drained(chunked)
        finally:
            chunked.shutdown()
    finally:
        engine.shutdown()


def test_tensor_parallel_ranks_serve_their_slices_of_the_codes(served):
    """TP=3 (SmolLM2 has 9 heads) quantizes each rank's rows (q/k/v, gate/up) and columns (o, down: the file's blocks
    sliced on their edges): its prompt logprobs agree with one rank's on the same codes."""
    from radixlm.runtime.engine import Engine

    ids = served.tokenizer.encode("The capital of France is Paris. The capital of Italy is", add_special_tokens=False)
    kwargs = dict(input_ids=ids, sampling_params={"max_new_tokens": 4, "temperature": 0}, return_logprob=True,
                  logprob_start_len=0)
    single = served.generate(**kwargs)
    with Engine(skip_tokenizer_init=True, tp_size=3, num_threads=1, max_total_tokens=4096) as engine:
        assert engine.server_info()["served_quantization"] == "int4"
        split = engine.generate(**kwargs)
    a = [lp for lp, *_ in single["meta_info"]["input_token_logprobs"][1:]]
    b = [lp for lp, *_ in split["meta_info"]["input_token_logprobs"][1:]]
    # partial sums of three ranks, each on its own activations' 16-bit blocks. A rank serving the
    # wrong slice of a matrix is off by whole nats.
    assert max(abs(x - y) for x, y in zip(a, b)) < 0.3
    assert single["output_ids"][0] == split["output_ids"][0]


def test_a_shared_model_keeps_its_quantization(served, smol):
    with pytest.raises(ValueError, match="served as --quantization auto"):
        LocalEngine(smol.path, model=served.worker.model, tokenizer=smol.engine.tokenizer, quantization="none")


@pytest.fixture(scope="module")
def tiny_hf_int4(tiny_llama):
    """The oracle for int4: HF fp32 with every layer matrix replaced by its 4-bit values (groups of
    32, each group's min and max: what the int4 path serves, dequantized in fp32)."""
    import copy

    import torch

    from radixlm.runtime.worker.quant import Blocks

    hf = copy.deepcopy(tiny_llama.hf)
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and name.split(".")[-1].endswith("proj"):
                module.weight.copy_(Blocks.int4_from(module.weight, 32).dequantize())
    return hf


@pytest.mark.parametrize("method,dtype", [("int8", "float32"), ("int4", "float32"), ("int4", "bfloat16")])
def test_any_checkpoint_quantizes(tiny_llama, tiny_hf_int4, method, dtype):
    """A dense HF checkpoint under --quantization int8 / int4 (requantized here), with fp32 or bf16
    activations between the matmuls: served as asked, its prompt logprobs near HF fp32's on the
    same values (int8: HF's own weights, within int8's rounding; int4: HF on the 4-bit values)."""
    import torch

    from oracle import hf_logprobs

    engine = LocalEngine(tiny_llama.path, skip_tokenizer_init=True, max_total_tokens=4096, quantization=method,
                         dtype=dtype)
    try:
        info = engine.worker.weights_info()
        assert info["served_quantization"] == method
        assert info["weight_formats"]["layers"].startswith(f"{method} ")
        prompt = tiny_llama.prompts[1]
        out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0},
                              return_logprob=True, logprob_start_len=0)
        ours = torch.tensor([lp for lp, *_ in out["meta_info"]["input_token_logprobs"][1:]])
        hf = tiny_llama.hf if method == "int8" else tiny_hf_int4
        with torch.inference_mode():
            ref = hf_logprobs(hf, prompt)[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
        # int8's rounding per group; for int4 the table's int8 groups and the activations' int8 blocks
        # (and bf16 between the matmuls); int4 against the wrong oracle (HF's own weights): 0.2
        bound = {"float32": 0.03, "bfloat16": 0.1}[dtype]
        assert (ours - ref).abs().mean() < bound, (ours - ref).abs().mean()
        assert_drained(engine)
    finally:
        engine.shutdown()


def test_without_native_kernels_auto_serves_dense_and_int4_says_why(smol, monkeypatch, caplog):
    """Where the native kernels cannot be built (no compiler, say), auto serves the file dense,
    saying so at start (a warning) and in /get_server_info (`cpu_kernels_failure`: the cause), and
    --quantization int4 is refused naming the cause; --quantization none never needs them."""
    import logging

    import torch

    from radixlm.kernels import cpu

    def no_build(isa: int = -1) -> str:
        raise cpu.NativeBuildError("the native CPU kernels need a C++ compiler ('c++' is not on PATH)")

    monkeypatch.setattr(cpu, "isa_name", no_build)
    with caplog.at_level(logging.WARNING):
        engine = LocalEngine(smol.path, tokenizer=smol.engine.tokenizer, max_total_tokens=2048)
    try:
        info = engine.worker.weights_info()
        assert info["served_quantization"] == "none" and info["cpu_kernels"] == "none"
        assert "'c++' is not on PATH" in info["cpu_kernels_failure"]
        assert any("the weights are served dense" in r.message and "'c++' is not on PATH" in r.message
                   for r in caplog.records)
        assert info["weight_formats"] == {"layers": "dense float32 (dequantized from Q4_1)",
                                          "embedding and LM head": "dense float32 (dequantized from Q8_0)"}
        assert all(isinstance(p, torch.nn.Parameter) for p in (engine.worker.model.lm_head.weight,
                                                               engine.worker.model.layers[0].mlp.down_proj.weight))
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="needs radixlm's native CPU kernels, which could not be built here \\(the "
                                         "native CPU kernels need a C\\+\\+ compiler"):
        LocalEngine(smol.path, tokenizer=smol.engine.tokenizer, max_total_tokens=2048, quantization="int4")
