"""The model families the runtime serves, each described once: its names (Hugging Face's
`architectures` entry, llama.cpp's `general.architecture`) and how its layers differ from a
Llama's, as data. `ModelConfig.from_hf` / `from_gguf` read these flags; the loader reads the
GGUF facts (q/k rows permuted, tensor names); `models/llama.py` serves every family here.

A leaf, as model_config.py is: no torch, nothing else of the runtime.

To add a family: one `Family(...)` in `FAMILIES` naming what differs from a Llama (each field's
default is the Llama's), a tiny config of it in tests/conftest.py's TINY_CONFIGS (its HF parity,
and tests/unit/test_families.py's HF-against-GGUF check), and its GGUF layout in
tests/gguf_files.py where llama.cpp writes one. A difference no field here says is code: give it
a field and read the field in model_config.py, never a test of the family's name there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# Norms around each sublayer: "pre" one before each (Llama), "post" one after each and none before
# (OLMo 2), "sandwich" one before and one after each (Gemma)
Norms = Literal["pre", "post", "sandwich"]
# RMSNorm over q and k before rotary: "" none, "head" over each head, "projection" over all of q's
# and all of k's heads at once
QKNorm = Literal["", "head", "projection"]
# Which layers slide over the config's `sliding_window` (a HF config's `layer_types` decides where
# it has them):
#   "off": none, unless a HF config's `use_sliding_window` says every one; a GGUF's window is
#          not read (llama.cpp does not slide these families)
#   "all": every layer, unless a HF config's `use_sliding_window` says none; a GGUF's too
#   "max_window_layers": HF's Qwen2 rule, the layers from `max_window_layers` on where
#          `use_sliding_window`; a GGUF's window is not read
#   "pattern": all but one layer in every `global_every` (HF's `sliding_window_pattern` may say
#          another step; llama.cpp's is fixed), where the config has a window
Sliding = Literal["off", "all", "max_window_layers", "pattern"]
# A mixture of experts' router: "softmax_topk" the top k of its softmax (Qwen, Mixtral),
# "topk_softmax" a softmax over the top k logits (gpt-oss)
Router = Literal["softmax_topk", "topk_softmax"]


@dataclass(frozen=True)
class Family:
    """One architecture: its names and each way it differs from a Llama (every default is the
    Llama's). Where a HF config has a key for a value, the config's value wins and the field is
    the value where it has none; a GGUF has fewer keys, so llama.cpp's fixed choices are fields
    here too (named `gguf_...` where they apply only there)."""

    hf_name: str  # HF config.json's `architectures` entry
    # llama.cpp's `general.architecture`; None where llama.cpp writes the family as another (a
    # Mistral is a llama there, served as LlamaForCausalLM)
    gguf_name: str | None = None
    # llama.cpp's converter interleaves each q/k head's two rotary halves (its LlamaModel and the
    # converters built on it): the loader undoes it
    gguf_permuted_qk: bool = False
    # GGUF layer tensor names that mean another HF tensor in this family than in a Llama (the
    # loader's `_GGUF_LAYER_NAMES` has the Llama's): GGUF suffix -> HF suffix
    gguf_tensor_names: dict[str, str] = field(default_factory=dict, hash=False)
    qkv_bias: bool = False  # biases on q/k/v where the config has no `attention_bias` key
    # a bias on the attention's output projection too (the config's `attention_bias`, default on)
    output_bias: bool = False
    attention_sinks: bool = False  # a learned logit per query head joins each softmax (no value)
    qk_norm: QKNorm = ""
    norms: Norms = "pre"
    # HF's norms scale by (offset + w); llama.cpp's files store offset + w already
    norm_weight_offset: float = 0.0
    hidden_act: str = "silu"  # the MLP's activation where the file names none (a GGUF never does)
    tied_embeddings: bool = False  # whether the LM head is the embedding where the config does not say
    scaled_embeddings: bool = False  # the embeddings times sqrt(hidden_size)
    # Granite's four multipliers read (HF: embedding_multiplier, residual_multiplier,
    # attention_multiplier, logits_scaling; GGUF: embedding_scale, residual_scale,
    # attention.scale, logit_scale); another family's config carrying such a key is not scaled
    multipliers: bool = False
    # attention scaled by query_pre_attn_scalar ** -0.5 (HF's key, default head_dim); a GGUF has no
    # key: llama.cpp scales by head_dim ** -0.5, or (hidden / heads) ** -0.5 in the model of
    # `gguf_27b_layers` layers (Gemma's 27B, told by its layer count)
    query_pre_attn_scalar: bool = False
    gguf_27b_layers: int = 0
    # scores and logits soft-capped (cap * tanh(x / cap)) where the config says; None: no caps read.
    # A GGUF without the keys gets llama.cpp's (attention's, the final logits') from here
    softcaps: tuple[float | None, float | None] | None = None
    sliding: Sliding = "off"
    global_every: int = 0  # "pattern": one global layer in every this many
    # the sliding layers rotate on their own unscaled base: HF's rope_local_base_freq (or its
    # per-layer-type rope_parameters), this where the config does not say, and in a GGUF
    local_rope_theta: float | None = None
    # rotary left out of every this many layers (0: none): HF's config lists the layers in
    # `no_rope_layers`; llama.cpp has no key and fixes the step
    no_rope_every: int = 0
    moe: bool = False  # the MLPs are mixtures of experts (another family's expert keys are not read)
    router: Router = "softmax_topk"
    # the top experts' weights renormalized to sum to 1: llama.cpp's fixed choice, and a HF
    # config's where it does not say
    norm_topk_prob: bool = True
    # Qwen's MoEs: the config's norm_topk_prob, decoder_sparse_step and mlp_only_layers (its dense
    # layers) are read; HF's other MoEs have no such keys (every layer sparse, top k renormalized)
    moe_keys: bool = False
    # one more expert that every token goes through, gated (HF's shared_expert_intermediate_size wide)
    shared_expert: bool = False
    moe_bias: bool = False  # biases on the router and every expert's projections

    def __post_init__(self) -> None:
        if (self.sliding == "pattern") != (self.global_every > 0):
            raise ValueError(f"{self.hf_name}: a sliding pattern needs global_every, and only it")
        if (self.moe_keys or self.shared_expert) and not self.moe:
            raise ValueError(f"{self.hf_name}: moe_keys and shared_expert are a mixture of experts' flags")
        if self.gguf_27b_layers and not self.query_pre_attn_scalar:
            raise ValueError(f"{self.hf_name}: gguf_27b_layers is the query_pre_attn_scalar rule's")

    @property
    def post_norm(self) -> bool:
        return self.norms == "post"

    @property
    def sandwich_norm(self) -> bool:
        return self.norms == "sandwich"


_GEMMA = dict(norms="sandwich", norm_weight_offset=1.0, hidden_act="gelu_tanh", tied_embeddings=True,
              scaled_embeddings=True, query_pre_attn_scalar=True, sliding="pattern")
# Gemma's norm before the MLP: in a layer that also normalizes each sublayer's output, GGUF's
# ffn_norm (a Llama's post_attention_layernorm) is HF's pre_feedforward_layernorm
_GEMMA_NAMES = {"ffn_norm.weight": "pre_feedforward_layernorm.weight"}

# The order is the error messages' (and a GGUF name's first family wins: see `gguf_family`)
FAMILIES: tuple[Family, ...] = (
    Family("LlamaForCausalLM", "llama", gguf_permuted_qk=True),
    Family("MistralForCausalLM", None, gguf_permuted_qk=True, sliding="all"),
    Family("Qwen2ForCausalLM", "qwen2", qkv_bias=True, sliding="max_window_layers"),
    Family("Qwen3ForCausalLM", "qwen3", qk_norm="head"),
    Family("GraniteForCausalLM", "granite", gguf_permuted_qk=True, multipliers=True),
    Family("Olmo2ForCausalLM", "olmo2", qk_norm="projection", norms="post"),
    Family("SmolLM3ForCausalLM", "smollm3", gguf_permuted_qk=True, no_rope_every=4),
    Family("Gemma2ForCausalLM", "gemma2", **_GEMMA, gguf_tensor_names=_GEMMA_NAMES, global_every=2,
           gguf_27b_layers=46, softcaps=(50.0, 30.0)),
    # Gemma 3: uncapped unless the file says (llama.cpp's converter writes a final cap only, where HF's has one)
    Family("Gemma3ForCausalLM", "gemma3", **_GEMMA, gguf_tensor_names=_GEMMA_NAMES, global_every=6,
           gguf_27b_layers=62, softcaps=(None, None), qk_norm="head", local_rope_theta=10000.0),
    Family("Qwen3MoeForCausalLM", "qwen3moe", qk_norm="head", moe=True, moe_keys=True),
    # llama.cpp writes a Mixtral as a llama with experts
    Family("MixtralForCausalLM", "llama", gguf_permuted_qk=True, moe=True),
    # Phi-3's checkpoint fuses gate and up in one tensor (as ours), and so does its GGUF's ffn_up
    Family("Phi3ForCausalLM", "phi3", sliding="all", gguf_tensor_names={"ffn_up.weight": "mlp.gate_up_proj.weight"}),
    # Qwen2-MoE's top experts' weights are not renormalized (HF's default; llama.cpp never does)
    Family("Qwen2MoeForCausalLM", "qwen2moe", qkv_bias=True, moe=True, moe_keys=True, norm_topk_prob=False,
           shared_expert=True),
    # gpt-oss's clamped SwiGLU: ModelConfig's swiglu_alpha / swiglu_limit (no HF name: its config says silu)
    Family("GptOssForCausalLM", "gpt-oss", output_bias=True, attention_sinks=True, hidden_act="swiglu_clamped",
           sliding="pattern", global_every=2, moe=True, router="topk_softmax", moe_bias=True),
)

BY_HF_NAME: dict[str, Family] = {f.hf_name: f for f in FAMILIES}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(BY_HF_NAME)
GGUF_ARCHITECTURES: tuple[str, ...] = tuple(dict.fromkeys(f.gguf_name for f in FAMILIES if f.gguf_name))


def gguf_family(gguf_name: str, experts: int) -> Family | None:
    """The family a GGUF of llama.cpp's architecture `gguf_name` is (None: none we serve). Where
    several families share the name (a llama, and a Mixtral: a llama with experts), the one
    whose MLPs are experts or not as the file's are; else the first."""
    found = [f for f in FAMILIES if f.gguf_name == gguf_name]
    return next((f for f in found if f.moe == (experts > 0)), found[0] if found else None)
