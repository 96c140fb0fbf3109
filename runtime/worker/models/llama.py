"""The Llama-family decoder: Llama 2/3, SmolLM, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm per
head), Granite (multipliers on the embeddings, the residual branches, the attention scale and the
logits), OLMo 2 (norms after each sublayer instead of before, q/k norm over the whole
projection), SmolLM3 (some layers without rotary) and Gemma 2/3 (norms before and after each
sublayer that scale by 1 + w, a GELU-gated MLP, scaled embeddings, sliding-window layers beside
global ones, Gemma 3's own rotary base on its sliding layers, Gemma 2's soft-capped scores and
logits), and the mixtures of experts built on these layers (Qwen3-MoE, Mixtral: moe.py). Each
variation is a field of ModelConfig, off by default, so a plain Llama runs exactly the ops it
always ran. Phi-3/Phi-4 are Llama layers with LongRoPE (layers.RotaryEmbedding), Phi-4's partial
rotary, and checkpoints that fuse q/k/v and gate/up as these layers do (`_target`).

Attention reads and writes the paged KV pool through the attention backend that
the ForwardBatch carries, so the model itself is stateless between steps.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from radixlm.runtime.families import FAMILIES
from radixlm.runtime.worker.forward_batch import ForwardBatch
from radixlm.runtime.worker.layers import (
    MergedColumnLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    _param,
    activation,
    gathers,
    materialize,
)
from radixlm.runtime.model_config import ModelConfig
from radixlm.runtime.worker.loader import Weight
from radixlm.runtime.worker.moe import SparseMoE
from radixlm.runtime.worker.parallel import TPContext


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, tp: TPContext) -> None:
        super().__init__()
        if cfg.num_heads % tp.size:
            raise ValueError(f"num_attention_heads={cfg.num_heads} is not divisible by tensor-parallel size {tp.size}")
        if cfg.qk_norm == "projection" and tp.size > 1:
            raise ValueError(f"{cfg.architecture} normalizes q and k over all heads at once, which tensor parallelism "
                             "splits across ranks: serve it with --tp-size 1")
        self.layer_id = layer_id
        self.num_heads = cfg.num_heads // tp.size
        self.num_kv_heads, first_kv = tp.kv_heads(cfg.num_kv_heads)
        self.head_dim = d = cfg.head_dim
        self.scale = cfg.attention_multiplier if cfg.attention_multiplier is not None else cfg.head_dim**-0.5
        self.use_rope = cfg.rope_layers is None or cfg.rope_layers[layer_id]
        self.whole_heads = cfg.rotary_dim == cfg.head_dim  # what the fused rotary kernel rotates
        self.window = cfg.window(layer_id)  # None: a global layer
        self.softcap = cfg.attn_softcap
        q_size = cfg.num_heads * d
        kv = (self.num_kv_heads * d, first_kv * d)
        self.qkv_proj = MergedColumnLinear(cfg.hidden_size, [*MergedColumnLinear.even(tp, [q_size]), kv, kv],
                                           cfg.attention_bias, [q_size, cfg.num_kv_heads * d, cfg.num_kv_heads * d])
        self.o_proj = RowParallelLinear(q_size, cfg.hidden_size, tp, cfg.output_bias)
        # gpt-oss's sinks: one logit per query head (this rank's heads)
        self.sinks = _param((self.num_heads,), self._load_sinks) if cfg.attention_sinks else None
        self.tp_rank = tp.rank
        self.rotary = rotary
        self.qk_norm = cfg.qk_norm
        norm_dims = {"head": (d, d), "projection": (q_size, cfg.num_kv_heads * d)}.get(cfg.qk_norm)
        self.q_norm = RMSNorm(norm_dims[0], cfg.rms_norm_eps) if norm_dims else None
        self.k_norm = RMSNorm(norm_dims[1], cfg.rms_norm_eps) if norm_dims else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, fb: ForwardBatch) -> torch.Tensor:
        q_len, kv_len = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj(x)
        if fb.attn_backend.fuses_rotary and self.q_norm is None and self.use_rope and self.whole_heads:
            # rotary, the K/V store and attention in two calls
            out = fb.attn_backend.forward_qkv(qkv, self.rotary.cos2, self.rotary.sin2, self.num_heads,
                                              self.num_kv_heads, self.layer_id, self.scale, fb, self.window,
                                              self.softcap, self.sinks)
            return self.o_proj(out)
        v = qkv[:, q_len + kv_len:].view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is None and self.use_rope:  # q and k side by side: one rotation for both
            qk = qkv[:, : q_len + kv_len].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k = self.rotary.rotate(qk, *rope).split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q, k = qkv[:, :q_len], qkv[:, q_len : q_len + kv_len]
            if self.qk_norm == "projection":  # over every head at once, then split into heads
                q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
            q, k = q.reshape(-1, self.num_heads, self.head_dim), k.reshape(-1, self.num_kv_heads, self.head_dim)
            if self.qk_norm == "head":
                q, k = self.q_norm(q), self.k_norm(k)
            if self.use_rope:
                q, k = self.rotary.rotate(q, *rope), self.rotary.rotate(k, *rope)
        out = fb.attn_backend.forward(q, k, v, self.layer_id, self.scale, fb, self.window, self.softcap, self.sinks)
        return self.o_proj(out.reshape(-1, q_len))

    def _load_sinks(self, param: nn.Parameter, loaded: Weight, shard: int = 0) -> None:
        param.data.copy_(loaded.full()[self.tp_rank * self.num_heads : (self.tp_rank + 1) * self.num_heads])


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnLinear(cfg.hidden_size, MergedColumnLinear.even(tp, [cfg.intermediate_size] * 2),
                                               False, [cfg.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp)
        self.act = activation(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, tp: TPContext) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, rotary, tp)
        self.mlp = SparseMoE(cfg, tp) if cfg.sparse(layer_id) else MLP(cfg, tp)
        self.post_norm = cfg.post_norm
        self.sandwich_norm = cfg.sandwich_norm
        self.residual_multiplier = cfg.residual_multiplier
        if cfg.sandwich_norm:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        elif cfg.post_norm:
            self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        else:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor] | None,
                fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(this layer's output h, the residual stream before it is added): the next norm adds
        them, so each residual add rides on a norm. The first layer gets the embeddings as h
        and no residual. Post-norm layers (OLMo 2) add their own residuals and return None."""
        if self.sandwich_norm:  # Gemma: each sublayer's output normalized too, before its add
            if residual is None:
                residual, h = h, self.input_layernorm(h)
            else:
                h = self.input_layernorm(h, residual)
            h = self.pre_feedforward_layernorm(self.post_attention_layernorm(self.self_attn(h, rope, fb)), residual)
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        if self.post_norm:
            h = h + self.post_attention_layernorm(self.self_attn(h, rope, fb))
            return h + self.post_feedforward_layernorm(self.mlp(h)), None
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h = self.input_layernorm(h, residual)
        h = self.self_attn(h, rope, fb)
        if self.residual_multiplier != 1:  # Granite: each branch scaled before its add
            h = h * self.residual_multiplier
        h = self.post_attention_layernorm(h, residual)
        h = self.mlp(h)
        return (h * self.residual_multiplier if self.residual_multiplier != 1 else h), residual


# Mixtral's checkpoint names for its experts -> Qwen3-MoE's, which ours are
_MIXTRAL_NAMES = {"block_sparse_moe.": "mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}
# checkpoint name fragment -> (our fused parameter fragment, block index within it)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext) -> None:
        super().__init__()
        self.cfg = cfg
        rotary = RotaryEmbedding(cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.rotary = rotary
        # Gemma 3's sliding layers rotate on their own base, unscaled
        self.local_rotary = (RotaryEmbedding(cfg.rotary_dim, cfg.max_position_embeddings, cfg.local_rope_theta, None)
                             if cfg.local_rope_theta is not None else None)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, self.local_rotary if self.local_rotary and cfg.window(i) else rotary, tp)
            for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Final hidden states of every token in the batch, [tokens, hidden]."""
        h, residual = self.embed_tokens(fb.input_ids), None
        if self.cfg.embedding_multiplier != 1:
            h = h * self.cfg.embedding_multiplier
        # a backend that fuses rotary reads the full tables itself (q/k-norm models still rotate here)
        fused = fb.attn_backend.fuses_rotary and not self.cfg.qk_norm and self.cfg.rotary_dim == self.cfg.head_dim
        rope = None if fused else self.rotary.tables(fb.positions)
        local = None if fused or self.local_rotary is None else self.local_rotary.tables(fb.positions)
        for layer in self.layers:
            h, residual = layer(h, residual, local if layer.self_attn.rotary is self.local_rotary else rope, fb)
        return self.norm(h, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.logits(hidden).float()
        if self.cfg.logits_scaling != 1:
            logits = logits / self.cfg.logits_scaling
        if self.cfg.final_softcap is not None:  # Gemma 2
            logits = torch.tanh(logits / self.cfg.final_softcap) * self.cfg.final_softcap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        params = dict(self.named_parameters())
        seen: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            target, shard = self._target(name)
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            owner, attr = target.rsplit(".", 1)
            module = self.get_submodule(owner)
            param = params[target] if gathers(module, attr) else materialize(module, attr)
            if shard is None:  # the checkpoint fuses the blocks (Phi-3): each block from its own rows
                start = 0
                for shard, size in enumerate(self.get_submodule(target.rsplit(".", 1)[0]).checkpoint_sizes):
                    param.weight_loader(param, tensor.rows_from(start).to(param.dtype), shard)
                    start += size
            else:
                param.weight_loader(param, tensor.to(param.dtype), shard)
            seen.add(target)
        missing = sorted(set(params) - seen)
        if missing:
            raise ValueError(f"checkpoint lacks tensors for: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if self.cfg.norm_weight_offset:  # Gemma's norms scale by 1 + w: added once here (in fp32, as HF adds it)
            for m in self.modules():
                if isinstance(m, RMSNorm):
                    m.weight.data += self.cfg.norm_weight_offset

    @staticmethod
    def _target(name: str) -> tuple[str, int | None]:
        """(our parameter, the block of it the tensor fills; None: every block, the checkpoint
        having fused them as we do)."""
        if ".qkv_proj." in name or ".gate_up_proj." in name:
            return name, None
        if ".mlp.router." in name:  # gpt-oss's router
            name = name.replace(".mlp.router.", ".mlp.gate.")
        if "block_sparse_moe." in name:
            for old, new in _MIXTRAL_NAMES.items():
                name = name.replace(old, new)
        for frag, (fused, shard) in _FUSED.items():
            if f".{frag}." in name:
                return name.replace(frag, fused), shard
        return name, 0


# every family of the table (families.py) is served by this one class
ARCHITECTURES = {family.hf_name: LlamaForCausalLM for family in FAMILIES}
