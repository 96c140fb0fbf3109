"""A HF checkpoint written as a GGUF file the way llama.cpp's converter lays one out: its tensor
names (the gguf package's own name map), its metadata keys, the q/k row permutation it
applies to the families built on its Llama converter, and the 1 it adds to Gemma's norm weights. The weights stay float32, so HF on the
checkpoint is the oracle for a model served from the file.
"""

from __future__ import annotations

import json
import math
import os
import re

import gguf
import numpy as np
from safetensors.numpy import load_file

# HF model_type -> llama.cpp architecture
ARCHES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "granite": "granite",
          "olmo2": "olmo2", "smollm3": "smollm3", "gemma2": "gemma2", "gemma3_text": "gemma3", "mixtral": "llama",
          "qwen3_moe": "qwen3moe", "phi3": "phi3", "qwen2_moe": "qwen2moe", "gpt_oss": "gpt-oss"}
# one expert's matrix, as HF names it (Qwen3-MoE's names, Mixtral's): llama.cpp stacks each kind
# of every expert of a layer in one [experts, rows, columns] tensor
EXPERT = re.compile(r"(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)\.weight")
# llama.cpp's Gemma layer patterns (one global layer in every this many) and Gemma 3's local rotary
# base: fixed there, no key says so
GEMMA_GLOBAL_EVERY = {"gemma2": 2, "gemma3": 6}
# architectures whose q/k rows llama.cpp's converter permutes (its LlamaModel and the classes on it)
PERMUTED = {"llama", "granite", "smollm3"}
# gpt-oss's experts as HF stacks them, for x @ W: [experts, in, out], gate and up interleaved along out
GPT_OSS_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?")


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Each head's two rotary halves interleaved, as llama.cpp's converter writes q and k."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_divisors(hf_dir: str, head_dim: int, theta: float) -> np.ndarray:
    """Each rotary frequency's divisor under the checkpoint's llama3 scaling, from transformers'
    own frequencies (the oracle's): unscaled over scaled."""
    import torch
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](transformers.AutoConfig.from_pretrained(hf_dir), torch.device("cpu"))
    plain = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    return (plain / scaled.float()).numpy().astype(np.float32)


def write_gguf(hf_dir: str, path: str, experts_as: str | None = None) -> str:
    """Write the checkpoint in `hf_dir` to `path` as an F32 GGUF; returns `path`. `experts_as`: a
    GGML type (e.g. "MXFP4", gpt-oss's) to quantize the experts' matrices to, with gguf's own
    quantizer."""

    def matrix(name: str, t: np.ndarray) -> None:  # an expert stack, quantized where asked
        if experts_as is None:
            w.add_tensor(name, t)
        else:
            qtype = gguf.GGMLQuantizationType[experts_as]
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(t), qtype), raw_dtype=qtype)

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    arch = ARCHES[cfg["model_type"]]
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if "full_attention" in rope:  # Gemma 3's, per layer type
        local = rope["sliding_attention"]
        if local.get("rope_type", "default") != "default" or float(local.get("rope_theta", 0)) != 10000.0:
            raise ValueError("llama.cpp's Gemma 3 rotates its sliding layers on base 10000, unscaled, and no other")
        rope = rope["full_attention"]
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3", "linear", "longrope", "yarn"):
        raise ValueError(f"rotary scaling {kind!r} is not written here")
    if arch == "smollm3":  # llama.cpp's SmolLM3 has no key for it: rotary is left out of every 4th layer
        if cfg["no_rope_layers"] != [int((i + 1) % 4 != 0) for i in range(layers)]:
            raise ValueError("llama.cpp's SmolLM3 leaves rotary out of every 4th layer and no other")
    if arch in GEMMA_GLOBAL_EVERY:
        every = GEMMA_GLOBAL_EVERY[arch]
        if cfg["layer_types"] != ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)]:
            raise ValueError(f"llama.cpp's {arch} has a global layer in every {every} and no other pattern")
        if cfg["query_pre_attn_scalar"] != head_dim:
            raise ValueError("llama.cpp scales a small Gemma's attention by head_dim ** -0.5 and no other")
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    if arch == "granite":
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
    if arch in GEMMA_GLOBAL_EVERY:
        w.add_sliding_window(cfg["sliding_window"])
        if cfg.get("attn_logit_softcapping") is not None:
            w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        if cfg.get("final_logit_softcapping") is not None:
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        if arch in ("llama", "qwen3moe") and not cfg.get("norm_topk_prob", True):
            raise ValueError("llama.cpp renormalizes the top experts' weights of these families")
        if arch == "qwen2moe" and cfg.get("norm_topk_prob"):
            raise ValueError("llama.cpp's Qwen2-MoE does not renormalize the top experts' weights")
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if "moe_intermediate_size" in cfg:
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    rotary = int(head_dim * rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if rotary != head_dim:
        w.add_rope_dimension_count(rotary)
    if kind == "longrope":  # as llama.cpp's Phi-3 converter: both factor sets, the attention factor, the original context
        original = cfg["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / original
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
        w.add_rope_scaling_attn_factors(1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(original)))
        w.add_rope_scaling_orig_ctx_len(original)
    if arch == "gpt-oss":  # llama.cpp's: layers alternate sliding and global, its clamped SwiGLU fixed
        if cfg["layer_types"] != ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]:
            raise ValueError("llama.cpp's gpt-oss alternates sliding and global layers and no other pattern")
        if cfg["swiglu_limit"] != 7.0 or cfg["swiglu_alpha"] != 1.702:
            raise ValueError("llama.cpp's gpt-oss clamps at 7 with alpha 1.702, no key says otherwise")
        w.add_sliding_window(cfg["sliding_window"])
    if kind == "yarn":  # llama.cpp rounds the ramp's ends outwards (HF's truncate)
        if not rope.get("truncate", True):
            raise ValueError("llama.cpp's YaRN rounds its ramp's ends: a checkpoint with truncate=False reads otherwise")
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    if kind == "llama3":  # as llama.cpp's converter: each frequency's divisor in a rope_freqs tensor
        w.add_tensor("rope_freqs.weight", _llama3_divisors(hf_dir, head_dim, float(rope.get("rope_theta", 10000.0))))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper().replace("-", "_")], layers)
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    stacks: dict[str, list[tuple[int, np.ndarray]]] = {}
    for name in [n for n in tensors if EXPERT.fullmatch(n)]:
        m = EXPERT.fullmatch(name)
        stacks.setdefault(f"{m.group(1)}.{m.group(3)}", []).append((int(m.group(2)), tensors.pop(name)))
    for base, parts in stacks.items():
        matrix(f"{names.get_name(base)}.weight", np.stack([t.astype(np.float32) for _, t in sorted(parts)]))
    for name in [n for n in tensors if GPT_OSS_EXPERTS.fullmatch(n)]:  # split and transposed, as llama.cpp's converter
        prefix, proj, bias = GPT_OSS_EXPERTS.fullmatch(name).groups()
        t = tensors.pop(name).astype(np.float32)
        suffix = "bias" if bias else "weight"
        if proj == "down_proj":
            name = f"{names.get_name(prefix + '.down_proj')}.{suffix}"
            w.add_tensor(name, t) if bias else matrix(name, t.transpose(0, 2, 1).copy())
            continue
        for half, kind_ in ((t[..., 0::2], "gate"), (t[..., 1::2], "up")):
            name = f"{names.get_name(prefix + '.' + kind_ + '_proj')}.{suffix}"
            w.add_tensor(name, np.ascontiguousarray(half)) if bias else matrix(name, half.transpose(0, 2, 1))
    for name, t in sorted(tensors.items()):
        base, suffix = name.rsplit(".", 1)
        if suffix == "sinks":  # gpt-oss's, a tensor of its own name
            base, suffix = name, "weight"
        target = names.get_name(base)
        if target is None:
            raise KeyError(f"no GGUF name for {name}")
        t = t.astype(np.float32)
        if arch in PERMUTED and base.endswith(("q_proj", "k_proj")):
            t = _permute(t, heads if base.endswith("q_proj") else kv_heads)
        if arch in GEMMA_GLOBAL_EVERY and name.endswith("norm.weight"):  # the file keeps 1 + w, as llama.cpp's does
            t = t + np.float32(1)
        w.add_tensor(f"{target}.{suffix}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
