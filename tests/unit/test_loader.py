"""Model discovery, config parsing and GGUF tensor naming."""

from __future__ import annotations

import math

import numpy as np
import pytest

from radixlm.runtime.model_config import default_model_path, resolve_model
from radixlm.runtime.worker.loader import _unpermute_rows, gguf_to_hf_name
from radixlm.runtime.model_config import ModelConfig, UnsupportedModelError


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # what llama.cpp's converter does to q/k rows: interleave the two rotary halves of each head
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("heads,head_dim,cols", [(4, 8, 5), (3, 64, 1), (2, 4, 3)])
def test_unpermute_inverts_llama_cpp_permutation(heads, head_dim, cols):
    w = np.random.default_rng(0).standard_normal((heads * head_dim, cols)).astype(np.float32)
    permuted = _llama_cpp_permute(w, heads)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(_unpermute_rows(permuted, heads), w)


def test_gguf_names_map_to_hf():
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert gguf_to_hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert gguf_to_hf_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("rope_freqs.weight") is None


def test_default_model_is_found():
    src = resolve_model(None)
    assert src.is_gguf and src.path == default_model_path()


def _hf_config(**kw):
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "eos_token_id": [2, 3]}
    cfg.update(kw)
    return cfg


def test_config_from_hf_reads_family_flags():
    llama = ModelConfig.from_hf(_hf_config())
    assert (llama.head_dim, llama.num_kv_heads, llama.eos_token_ids, llama.qk_norm) == (16, 2, [2, 3], "")
    assert llama.plain
    qwen2 = ModelConfig.from_hf(_hf_config(architectures=["Qwen2ForCausalLM"]))
    assert qwen2.attention_bias and not qwen2.qk_norm and qwen2.plain
    qwen3 = ModelConfig.from_hf(_hf_config(architectures=["Qwen3ForCausalLM"], head_dim=32))
    assert qwen3.qk_norm == "head" and qwen3.head_dim == 32 and not qwen3.plain
    granite = ModelConfig.from_hf(_hf_config(architectures=["GraniteForCausalLM"], embedding_multiplier=12.0,
                                             residual_multiplier=0.22, attention_multiplier=0.0078125,
                                             logits_scaling=8.0))
    assert (granite.embedding_multiplier, granite.residual_multiplier, granite.attention_multiplier,
            granite.logits_scaling) == (12.0, 0.22, 0.0078125, 8.0) and not granite.plain
    assert not granite.qk_norm and not granite.post_norm and granite.rope_layers is None
    olmo2 = ModelConfig.from_hf(_hf_config(architectures=["Olmo2ForCausalLM"]))
    assert olmo2.qk_norm == "projection" and olmo2.post_norm and olmo2.embedding_multiplier == 1
    smollm3 = ModelConfig.from_hf(_hf_config(architectures=["SmolLM3ForCausalLM"], no_rope_layers=[1, 0]))
    assert smollm3.rope_layers == [True, False] and not smollm3.plain  # 1: the layer uses rotary
    assert ModelConfig.from_hf(_hf_config(architectures=["SmolLM3ForCausalLM"], no_rope_layers=[1, 1])).plain
    # the multipliers are Granite's: another family's config carrying such a key is not scaled
    assert ModelConfig.from_hf(_hf_config(embedding_multiplier=12.0)).embedding_multiplier == 1.0
    with pytest.raises(UnsupportedModelError, match="mlp_bias"):
        ModelConfig.from_hf(_hf_config(architectures=["GraniteForCausalLM"], mlp_bias=True))
    with pytest.raises(UnsupportedModelError, match="rotary for 3 layers of 2"):
        ModelConfig.from_hf(_hf_config(architectures=["SmolLM3ForCausalLM"], no_rope_layers=[1, 0, 1]))
    mistral = ModelConfig.from_hf(_hf_config(architectures=["MistralForCausalLM"], sliding_window=64,
                                             max_position_embeddings=4096))
    # every layer slides: the whole context is served, each layer over its window
    assert (mistral.context_length, mistral.window(0), mistral.window(1), mistral.sliding_layers) == (4096, 64, 64, None)
    assert mistral.plain  # one window for all: the native decoder runs it
    qwen2 = ModelConfig.from_hf(_hf_config(architectures=["Qwen2ForCausalLM"], sliding_window=64, use_sliding_window=True,
                                           max_window_layers=1))
    assert qwen2.sliding_layers == [False, True] and not qwen2.plain  # HF's rule: layers from max_window_layers on
    assert ModelConfig.from_hf(_hf_config(architectures=["Qwen2ForCausalLM"], sliding_window=64)).window(1) is None


def test_config_from_hf_reads_gemma():
    gemma2 = ModelConfig.from_hf(_hf_config(architectures=["Gemma2ForCausalLM"], num_hidden_layers=4, head_dim=32,
                                            query_pre_attn_scalar=144, sliding_window=16, attn_logit_softcapping=50.0,
                                            final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh"))
    assert [gemma2.window(i) for i in range(4)] == [16, None, 16, None]  # from its fixed pattern: no layer_types
    assert (gemma2.attn_softcap, gemma2.final_softcap, gemma2.hidden_act, gemma2.norm_weight_offset) == (50.0, 30.0,
                                                                                                     "gelu_tanh", 1.0)
    assert gemma2.attention_multiplier == 144 ** -0.5 and gemma2.embedding_multiplier == 8.0  # sqrt(hidden 64)
    assert gemma2.sandwich_norm and gemma2.tie_word_embeddings and gemma2.local_rope_theta is None and not gemma2.plain
    # Gemma 3 as transformers 4 wrote it: its local base apart, the pattern as a number
    gemma3 = ModelConfig.from_hf(_hf_config(architectures=["Gemma3ForCausalLM"], num_hidden_layers=7, sliding_window=32,
                                            rope_theta=1e6, rope_local_base_freq=5000.0, sliding_window_pattern=3,
                                            rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert [gemma3.window(i) for i in range(7)] == [32, 32, None, 32, 32, None, 32]
    assert (gemma3.rope_theta, gemma3.local_rope_theta, gemma3.rope_scaling["factor"]) == (1e6, 5000.0, 8.0)
    assert gemma3.qk_norm == "head" and gemma3.attn_softcap is None
    # ... and as transformers 5 writes it: per layer type
    gemma3 = ModelConfig.from_hf(_hf_config(architectures=["Gemma3ForCausalLM"], sliding_window=32,
                                            layer_types=["full_attention", "sliding_attention"], rope_parameters={
                                                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                "full_attention": {"rope_type": "default", "rope_theta": 1e6}}))
    assert [gemma3.window(i) for i in range(2)] == [None, 32] and (gemma3.rope_theta, gemma3.local_rope_theta) == (1e6, 1e4)
    with pytest.raises(UnsupportedModelError, match="activation 'relu'"):
        ModelConfig.from_hf(_hf_config(hidden_act="relu"))


def test_config_from_hf_reads_gpt_oss_and_qwen2_moe():
    """gpt-oss-20b's config.json as released (transformers 4's rope_scaling: YaRN, its ramp unrounded)."""
    gpt_oss = ModelConfig.from_hf(_hf_config(
        architectures=["GptOssForCausalLM"], num_hidden_layers=4, head_dim=64, attention_bias=True, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 2, num_local_experts=32, num_experts_per_tok=4,
        rope_theta=150000, swiglu_limit=7.0, max_position_embeddings=131072, rope_scaling={
            "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
            "rope_type": "yarn", "truncate": False}))
    assert [gpt_oss.window(i) for i in range(4)] == [128, None, 128, None]
    assert gpt_oss.attention_sinks and gpt_oss.output_bias and gpt_oss.attention_bias and not gpt_oss.plain
    assert (gpt_oss.num_experts, gpt_oss.experts_per_token, gpt_oss.moe_router, gpt_oss.moe_bias) == (32, 4,
                                                                                                    "topk_softmax", True)
    assert gpt_oss.hidden_act == "swiglu_clamped" and (gpt_oss.swiglu_alpha, gpt_oss.swiglu_limit) == (1.702, 7.0)
    yarn = gpt_oss.rope_scaling
    assert (yarn["rope_type"], yarn["factor"], yarn["truncate"]) == ("yarn", 32.0, False)
    assert abs(yarn["attention_factor"] - (0.1 * math.log(32) + 1)) < 1e-12
    qwen2_moe = ModelConfig.from_hf(_hf_config(architectures=["Qwen2MoeForCausalLM"], num_hidden_layers=4,
                                               num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                               shared_expert_intermediate_size=96, decoder_sparse_step=2))
    assert qwen2_moe.attention_bias and not qwen2_moe.output_bias and not qwen2_moe.norm_topk_prob  # HF's defaults
    assert qwen2_moe.shared_expert_size == 96 and qwen2_moe.moe_layers == [False, True, False, True]


def test_rope_parameters_of_transformers_v5_are_read():
    cfg = ModelConfig.from_hf(_hf_config(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 64}))
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling["rope_type"] == "llama3"


def test_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(UnsupportedModelError, match="Qwen3ForCausalLM"):
        ModelConfig.from_hf(_hf_config(architectures=["FalconForCausalLM"]))


def test_gguf_slices_equal_the_slices_of_the_whole_tensor():
    """A tensor-parallel rank dequantizes only its rows or columns of a GGUF tensor: what it reads
    equals the same part of the whole tensor, dequantized and un-permuted in one go."""
    from gguf.quants import dequantize

    from radixlm.runtime.model_config import gguf_reader, load_config
    from radixlm.runtime.worker.loader import _iter_gguf

    src = resolve_model(None)
    config = load_config(src)
    raw = {gguf_to_hf_name(t.name): t for t in gguf_reader(src.path).tensors}
    seen = set()
    for name, lazy in _iter_gguf(src.path, config):
        kind = (name.split(".")[-2], len(lazy.shape))
        if kind in seen:
            continue  # one of each: the layers repeat
        seen.add(kind)
        t = raw[name]
        whole = dequantize(t.data, t.tensor_type).reshape(lazy.shape)
        if name.endswith("q_proj.weight"):
            whole = _unpermute_rows(whole, config.num_heads)
        elif name.endswith("k_proj.weight"):
            whole = _unpermute_rows(whole, config.num_kv_heads)
        np.testing.assert_array_equal(lazy[:].numpy(), whole, err_msg=name)
        n = lazy.shape[0]
        for start, stop in ((0, n // 2), (n // 2, n), (5, n // 3 + 7), (n - 3, n + 10)):  # n + 10: a padded vocabulary share
            np.testing.assert_array_equal(lazy[start:stop].numpy(), whole[start:stop], err_msg=f"{name} rows")
        if len(lazy.shape) == 2:
            m = lazy.shape[1]
            for start, stop in ((0, m // 2), (m // 2, m), (7, m - 33)):
                np.testing.assert_array_equal(lazy[:, start:stop].numpy(), whole[:, start:stop], err_msg=f"{name} cols")
    assert {"q_proj", "k_proj", "down_proj", "embed_tokens"} <= {k for k, _ in seen}


@pytest.mark.parametrize("shape", [(96,), (6, 96)])
@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_1"])
def test_gguf_tensor_slices_of_any_type_and_rank(shape, qtype):
    """Quantized 1-D tensors pack their blocks across rows: a row slice must not index the bytes."""
    from types import SimpleNamespace

    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from radixlm.runtime.worker.loader import GGUFTensor

    kind = GGMLQuantizationType[qtype]
    values = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    data = quantize(values, kind) if kind not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) \
        else values.astype(np.float16 if qtype == "F16" else np.float32)
    whole = dequantize(data, kind).reshape(shape)
    lazy = GGUFTensor(SimpleNamespace(data=data, tensor_type=kind, shape=list(reversed(shape))))
    np.testing.assert_array_equal(lazy[:].numpy(), whole)
    np.testing.assert_array_equal(lazy[1:5].numpy(), whole[1:5])
    if len(shape) == 2:
        np.testing.assert_array_equal(lazy[:, 5:70].numpy(), whole[:, 5:70])
        np.testing.assert_array_equal(lazy[2:4, 32:64].numpy(), whole[2:4, 32:64])


def test_the_fast_gguf_reader_reads_what_ggufs_own_reads():
    """model_config's reader (gguf's, over a plain view with a leaner low-level read) against gguf's
    own on the embedded file: every field's parts and every tensor's name, type, shape and bytes."""
    import numpy as np
    from gguf import GGUFReader

    from radixlm.runtime.model_config import gguf_reader, resolve_model

    path = resolve_model(None).path
    ours, theirs = gguf_reader(path), GGUFReader(path)
    assert type(ours) is not GGUFReader and isinstance(ours, GGUFReader)
    assert list(ours.fields) == list(theirs.fields) and ours.data_offset == theirs.data_offset
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert mine.types == field.types and mine.data == field.data, key
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(mine.parts, field.parts)), key
    assert ours.fields["tokenizer.ggml.tokens"].contents()[:50] == theirs.fields["tokenizer.ggml.tokens"].contents()[:50]
    assert [(t.name, t.tensor_type, list(t.shape)) for t in ours.tensors] == \
        [(t.name, t.tensor_type, list(t.shape)) for t in theirs.tensors]
    assert all(np.array_equal(np.asarray(a.data), np.asarray(b.data)) for a, b in zip(ours.tensors, theirs.tensors))


def test_the_fast_gguf_reader_reads_no_array_item_it_is_not_asked_for(monkeypatch):
    """Parsing the embedded file reads each field's head and each tensor's header, not the ~150k
    items of the tokenizer's arrays (~300k reads, seconds at every start), which only a tokenizer
    conversion asks for."""
    from radixlm.runtime.model_config import _fast_reader, load_config, resolve_model

    reader_class, reads = _fast_reader(), []
    read = reader_class._get
    monkeypatch.setattr(reader_class, "_get", lambda self, *a, **k: (reads.append(a), read(self, *a, **k))[1])
    ours = reader_class(resolve_model(None).path)
    assert len(reads) < 5_000, len(reads)  # fields and tensors: a few per each
    assert len(ours.fields["tokenizer.ggml.tokens"].data) == load_config(resolve_model(None)).vocab_size == 49152


def test_gpt_oss_mxfp4_experts_read_as_hf_dequantizes_them(tmp_path):
    """gpt-oss's checkpoints keep each kind of expert matrix stacked in OpenAI's MXFP4 (`_blocks`,
    `_scales`), gate and up interleaved: each expert's matrices read back as transformers' own
    converter dequantizes them (de-interleaved, gate first, as [out, in]), and as the file's own
    blocks, laid out for the kernels with nothing rounded."""
    import torch
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from radixlm.kernels import cpu
    from radixlm.runtime.worker.loader import _iter_safetensors

    gen = torch.Generator().manual_seed(0)
    experts, hidden, inner = 3, 64, 32
    tensors = {}
    for proj, out, cols in (("gate_up_proj", 2 * inner, hidden), ("down_proj", hidden, inner)):
        tensors[f"model.layers.0.mlp.experts.{proj}_blocks"] = torch.randint(0, 256, (experts, out, cols // 32, 16),
                                                                             generator=gen, dtype=torch.uint8)
        tensors[f"model.layers.0.mlp.experts.{proj}_scales"] = torch.randint(118, 130, (experts, out, cols // 32),
                                                                             generator=gen, dtype=torch.uint8)
        tensors[f"model.layers.0.mlp.experts.{proj}_bias"] = torch.randn(experts, out, generator=gen)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    got = dict(_iter_safetensors(str(tmp_path)))
    for proj in ("gate_up_proj", "down_proj"):
        blocks, scales = (tensors[f"model.layers.0.mlp.experts.{proj}_{k}"] for k in ("blocks", "scales"))
        want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [experts, in, out]
        bias = tensors[f"model.layers.0.mlp.experts.{proj}_bias"]
        for e in range(experts):
            w, b = want[e].t(), bias[e]
            if proj == "gate_up_proj":
                w, b = torch.cat((w[0::2], w[1::2])), torch.cat((b[0::2], b[1::2]))
            weight = got[f"model.layers.0.mlp.experts.{e}.{proj}.weight"]
            assert weight.format == "MXFP4" and weight.shape == tuple(w.shape)
            assert torch.equal(weight.full(), w)
            part = weight.file_part(slice(None), slice(None))
            served = cpu.pack([part], w.shape[1])
            assert torch.equal(cpu.dequantize_rows(served, torch.arange(w.shape[0])), w)
            assert torch.equal(weight.rows(5, 7), w[5:12])
            assert torch.equal(got[f"model.layers.0.mlp.experts.{e}.{proj}.bias"].full(), b)
