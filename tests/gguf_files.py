"""A HF checkpoint written as a GGUF file the way llama.cpp's converter lays one out: its tensor
names (the gguf package's own name map), its metadata keys, and the q/k row permutation it
applies to the families built on its Llama converter. The weights stay float32, so HF on the
checkpoint is the oracle for a model served from the file.
"""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
from safetensors.numpy import load_file

# HF model_type -> llama.cpp architecture
ARCHES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "granite": "granite",
          "olmo2": "olmo2", "smollm3": "smollm3"}
# architectures whose q/k rows llama.cpp's converter permutes (its LlamaModel and the classes on it)
PERMUTED = {"llama", "granite", "smollm3"}


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


def write_gguf(hf_dir: str, path: str) -> str:
    """Write the checkpoint in `hf_dir` to `path` as an F32 GGUF; returns `path`."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    arch = ARCHES[cfg["model_type"]]
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise ValueError(f"rotary scaling {kind!r} is not written here")
    if arch == "smollm3":  # llama.cpp's SmolLM3 has no key for it: rotary is left out of every 4th layer
        if cfg["no_rope_layers"] != [int((i + 1) % 4 != 0) for i in range(layers)]:
            raise ValueError("llama.cpp's SmolLM3 leaves rotary out of every 4th layer and no other")
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
    if kind == "llama3":  # as llama.cpp's converter: each frequency's divisor in a rope_freqs tensor
        w.add_tensor("rope_freqs.weight", _llama3_divisors(hf_dir, head_dim, float(rope.get("rope_theta", 10000.0))))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], layers)
    for name, t in sorted(load_file(os.path.join(hf_dir, "model.safetensors")).items()):
        base, suffix = name.rsplit(".", 1)
        target = names.get_name(base)
        if target is None:
            raise KeyError(f"no GGUF name for {name}")
        t = t.astype(np.float32)
        if arch in PERMUTED and base.endswith(("q_proj", "k_proj")):
            t = _permute(t, heads if base.endswith("q_proj") else kv_heads)
        w.add_tensor(f"{target}.{suffix}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
