"""Mixtures of experts (Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss): routing and outputs against HF's
own block on the same weights, and the experts served quantized on the native kernels (gpt-oss's
MXFP4 from their codes). (Whole models against HF greedy, from HF directories and from GGUF, are
the tiny-family tests in test_parity.py.)"""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_checkpoint
from helpers import assert_drained
from radixlm.runtime.local_engine import LocalEngine
from radixlm.runtime.model_config import ModelSource, load_config
from radixlm.runtime.worker.loader import iter_weights
from radixlm.runtime.worker.models.llama import LlamaForCausalLM
from radixlm.runtime.worker.moe import SparseMoE
from radixlm.runtime.worker.parallel import SINGLE, TPContext


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss"])
def tiny_moe(request, tmp_path_factory):
    import transformers

    path = str(tmp_path_factory.mktemp(request.param))
    make_tiny_checkpoint(request.param, path)
    return path, transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _ours_from_hf(path: str, hf) -> tuple[SparseMoE, torch.nn.Module]:
    """Our block for layer 0, loaded from the checkpoint by our loader (HF keeps each kind of matrix
    of every expert in one tensor: gpt-oss's laid out for x @ W, gate and up interleaved), and HF's."""
    src = ModelSource(path)
    cfg = load_config(src)
    model = LlamaForCausalLM(cfg, SINGLE)
    model.load_weights(iter_weights(src, cfg))
    return model.layers[0].mlp, hf.model.layers[0].mlp


def _hf_route(block, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _, weights, chosen = (block.router if hasattr(block, "router") else block.gate)(x)
    return weights, chosen


def _hf_block(block, x: torch.Tensor) -> torch.Tensor:
    out = block(x[None])
    return (out[0] if isinstance(out, tuple) else out)[0]  # gpt-oss's block also returns its router's scores


def test_routing_and_outputs_are_hfs(tiny_moe):
    """Each token's experts and weights as HF's router picks them, and the block's output, on a
    batch whose tokens hit every expert and on one whose tokens all hit the same two."""
    path, hf = tiny_moe
    ours, block = _ours_from_hf(path, hf)
    x = torch.randn(64, hf.config.hidden_size, generator=torch.Generator().manual_seed(0))
    same = x[:1].expand(16, -1).contiguous()
    with torch.inference_mode():
        for batch, hit in ((x, 4), (same, 2)):
            weights, chosen = ours.route(batch)
            hf_weights, hf_chosen = _hf_route(block, batch)
            assert torch.equal(chosen, hf_chosen)
            assert torch.allclose(weights, hf_weights, rtol=0, atol=1e-7)
            assert torch.unique(chosen).numel() == hit
            want = _hf_block(block, batch)
            assert torch.allclose(ours(batch), want, rtol=1e-5, atol=1e-6), (ours(batch) - want).abs().max()
        # a token's output does not depend on the others in its batch (for the oracle above:
        # identical tokens give identical rows)
        out = ours(same)
        assert torch.equal(out, out[:1].expand_as(out))


def test_experts_are_not_split_across_ranks(tiny_moe):
    path, _ = tiny_moe
    with pytest.raises(ValueError, match="--tp-size 1"):
        SparseMoE(load_config(ModelSource(path)), TPContext(rank=0, size=2))


def test_quantized_experts_run_on_the_native_kernels(tiny_moe):
    """--quantization int4 serves every expert's matrices from 4-bit codes on the native kernels:
    prompt logprobs near HF fp32 on the same 4-bit values (each expert matrix replaced by its
    groups' dequantized codes, as test_quantized's oracle for dense layers)."""
    import copy

    from oracle import hf_logprobs, random_prompts
    from radixlm.runtime.worker.quant import Blocks, QuantizedMatrix

    path, hf = tiny_moe
    hf4 = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in hf4.named_parameters():
            if hf.config.model_type == "gpt_oss" and name.endswith(("_proj")):  # [experts, in, out]
                for e in range(p.shape[0]):
                    p[e].copy_(Blocks.int4_from(p[e].t(), 32).dequantize().t())
            elif ".experts." in name and not name.endswith("bias") or name.endswith("proj.weight"):
                rows = p.view(-1, p.shape[-1])
                rows.copy_(Blocks.int4_from(rows, 32).dequantize())
    engine = LocalEngine(path, skip_tokenizer_init=True, max_total_tokens=4096, quantization="int4")
    try:
        experts = [proj.weight for e in engine.worker.model.modules() if type(e).__name__ == "Expert"
                   for proj in (e.gate_up_proj, e.down_proj)]
        assert experts and all(isinstance(w, QuantizedMatrix) for w in experts)
        prompt = random_prompts(hf.config.vocab_size, 2, seed=5, min_len=40)[1]
        out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0},
                              return_logprob=True, logprob_start_len=0)
        ours = torch.tensor([lp for lp, *_ in out["meta_info"]["input_token_logprobs"][1:]])
        with torch.inference_mode():
            ref = hf_logprobs(hf4, prompt)[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
        # the table's int8 groups and the activations' int8 blocks; HF's own fp32 weights are 0.1+ away
        assert (ours - ref).abs().mean() < 0.03, (ours - ref).abs().mean()
        assert_drained(engine)
    finally:
        engine.shutdown()


def test_mxfp4_experts_are_served_from_their_codes(tmp_path):
    """gpt-oss's experts as its GGUF files keep them, MXFP4 (quantized here by gguf's own
    quantizer): served by default from those blocks at their own size (E2M1 values times 2 are
    integers: exact codes with power-of-two scales), prompt logprobs near HF fp32 on the values
    gguf's own dequantizer reads from the file."""
    import copy

    import gguf
    import numpy as np
    import transformers

    from gguf_files import write_gguf
    from oracle import hf_logprobs, random_prompts
    from radixlm.runtime.worker.quant import QuantizedMatrix

    path = str(tmp_path / "hf")
    make_tiny_checkpoint("gpt_oss", path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    mx = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in mx.named_parameters():
            if name.endswith("_proj"):  # each expert's [in, out] matrix, quantized along its input
                for e in range(p.shape[0]):
                    rows = p[e].t().contiguous().numpy()
                    back = gguf.quants.dequantize(gguf.quants.quantize(rows, gguf.GGMLQuantizationType.MXFP4),
                                                  gguf.GGMLQuantizationType.MXFP4)
                    p[e].copy_(torch.from_numpy(np.asarray(back, dtype=np.float32)).t())
    file = write_gguf(path, str(tmp_path / "gpt-oss.gguf"), experts_as="MXFP4")
    engine = LocalEngine(file, skip_tokenizer_init=True, max_total_tokens=4096)
    try:
        experts = [proj.weight for e in engine.worker.model.modules() if type(e).__name__ == "Expert"
                   for proj in (e.gate_up_proj, e.down_proj)]
        assert experts and all(isinstance(w, QuantizedMatrix) and w.tiled.kinds() == ["f4"] for w in experts)
        prompt = random_prompts(hf.config.vocab_size, 2, seed=5, min_len=40)[1]
        out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0},
                              return_logprob=True, logprob_start_len=0)
        ours = torch.tensor([lp for lp, *_ in out["meta_info"]["input_token_logprobs"][1:]])
        with torch.inference_mode():
            ref = hf_logprobs(mx, prompt)[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
            fp32 = hf_logprobs(hf, prompt)[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
        # the activations' 16-bit blocks are all that differs; MXFP4's own rounding is far larger
        assert (ours - ref).abs().mean() < 0.002, (ours - ref).abs().mean()  # measured 5e-5 (AVX2); fp32: 0.19
        assert (ours - fp32).abs().mean() > 3 * (ours - ref).abs().mean()
        assert_drained(engine)
    finally:
        engine.shutdown()
