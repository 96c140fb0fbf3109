"""The family table (runtime/families.py) against independent statements of the same facts:
transformers' and gguf's own names, llama.cpp's tensor names (gguf's name map), and each tiny
family's HF checkpoint written as llama.cpp lays out a GGUF (tests/gguf_files.py): the two
configs read from them must agree wherever the family's flags decide a field."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import NamedTuple

import gguf
import pytest
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from conftest import TINY_CONFIGS, make_tiny_checkpoint
from gguf_files import PERMUTED, write_gguf
from radixlm.runtime import model_config
from radixlm.runtime.families import FAMILIES, GGUF_ARCHITECTURES, SUPPORTED_ARCHITECTURES, Family, gguf_family
from radixlm.runtime.model_config import ModelConfig, UnsupportedModelError, gguf_reader, load_config, resolve_model
from radixlm.runtime.worker import loader
from radixlm.runtime.worker.models import llama


def _hf_name(kind: str) -> str:
    """The HF architecture of a tiny config of tests/conftest.py, by transformers' own map."""
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[getattr(transformers, TINY_CONFIGS[kind][0]).model_type]


def test_the_served_lists_are_the_tables():
    names = [f.hf_name for f in FAMILIES]
    assert len(set(names)) == len(names)
    assert list(SUPPORTED_ARCHITECTURES) == names and model_config.SUPPORTED_ARCHITECTURES is SUPPORTED_ARCHITECTURES
    assert set(llama.ARCHITECTURES) == set(names)
    assert set(GGUF_ARCHITECTURES) == {f.gguf_name for f in FAMILIES} - {None}
    assert loader.PERMUTED_ARCHITECTURES == tuple(f.hf_name for f in FAMILIES if f.gguf_permuted_qk)
    assert loader._GGUF_FAMILY_NAMES == {f.hf_name: f.gguf_tensor_names for f in FAMILIES if f.gguf_tensor_names}


def test_every_family_has_a_tiny_model():
    """tests/conftest.py's tiny configs (HF parity, GGUF parity, the check below) cover the table."""
    assert {_hf_name(kind) for kind in TINY_CONFIGS} == set(SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.hf_name)
def test_names_are_transformers_and_llama_cpps(family: Family):
    assert family.hf_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
    if family.gguf_name is not None:
        assert family.gguf_name in gguf.MODEL_ARCH_NAMES.values()
        # the GGUF name maps back to this family (a llama with experts is a Mixtral)
        assert gguf_family(family.gguf_name, experts=4 if family.moe else 0) is family


def test_an_unknown_gguf_architecture_names_the_supported_ones():
    meta = {"general.architecture": "falcon"}
    with pytest.raises(UnsupportedModelError, match="'falcon' is not supported; supported: llama, qwen2"):
        ModelConfig.from_gguf(meta, set())


def test_permuted_families_are_those_llama_cpp_permutes():
    """gguf_files.PERMUTED (the GGUF writer's own list, read from llama.cpp's converter)."""
    assert {f.gguf_name for f in FAMILIES if f.gguf_permuted_qk and f.gguf_name} == PERMUTED
    assert not [f for f in FAMILIES if f.gguf_name in PERMUTED and not f.gguf_permuted_qk]


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.gguf_name], ids=lambda f: f.hf_name)
def test_gguf_tensor_names_are_llama_cpps(family: Family):
    """Every tensor llama.cpp defines for the family that the loader reads maps to the HF name
    that gguf's own name map writes under that GGUF name (a Gemma's ffn_norm is its
    pre_feedforward_layernorm, a Llama's its post_attention_layernorm)."""
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == family.gguf_name)
    names = gguf.get_tensor_name_map(arch, 1)
    read = 0
    for kind in gguf.MODEL_TENSORS[arch]:
        name = gguf.TENSOR_NAMES[kind].format(bid=0)
        for suffix in (".weight", ".bias"):
            hf = loader.gguf_to_hf_name(name + suffix, family.hf_name)
            if hf is not None:
                assert names.get_name(hf.removesuffix(suffix)) == name, (name + suffix, hf)
                read += 1
    assert read >= 12  # the norms, q/k/v/o and the MLP's (or router's) at least


class TinyPair(NamedTuple):
    """A tiny family's HF checkpoint and the GGUF llama.cpp would write of it."""

    hf_path: str
    gguf_path: str


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """kind -> its TinyPair, written on first use."""
    made = {}

    def make(kind: str) -> TinyPair:
        if kind not in made:
            path = str(tmp_path_factory.mktemp("families") / kind)
            make_tiny_checkpoint(kind, path)
            made[kind] = TinyPair(path, write_gguf(path, path + ".gguf"))
        return made[kind]

    return make


def _same(a, b) -> bool:
    """Equal, floats to float32's precision (a GGUF stores its scalars as float32), dicts on the
    keys both have (HF's rotary dicts carry keys of their own, e.g. its theta)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return all(_same(a[k], b[k]) for k in a.keys() & b.keys())
    return a == b


# HF's names for a router where ours (and the loader's GGUF names) are Qwen's `mlp.gate`
_HF_ROUTERS = {".block_sparse_moe.gate.": ".mlp.gate.", ".mlp.router.": ".mlp.gate."}


def _checkpoint_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """The tiny checkpoint's tensors' shapes by name (routers under our name)."""
    from safetensors import safe_open

    shapes = {}
    with safe_open(f"{path}/model.safetensors", framework="np") as f:
        for name in f.keys():
            shape = tuple(f.get_slice(name).get_shape())
            for hf, ours in _HF_ROUTERS.items():
                name = name.replace(hf, ours)
            shapes[name] = shape
    return shapes


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
def test_hf_and_gguf_configs_agree(kind, tiny_pair):
    """Each family's tiny config, built by transformers' own config class (its defaults, tiny
    sizes), read from the HF checkpoint and from the GGUF llama.cpp would write of it: every
    field the same. The HF config says most things by its keys, the GGUF by the table's flags
    and llama.cpp's fixed choices, so a wrong flag shows as a difference."""
    hf, from_gguf = (dataclasses.asdict(load_config(resolve_model(path))) for path in tiny_pair(kind))
    # a GGUF's Gemma norms hold 1 + w (no offset to add); llama.cpp writes a Mistral as a llama
    assert (hf.pop("norm_weight_offset"), from_gguf.pop("norm_weight_offset")) == (
        (1.0, 0.0) if hf["sandwich_norm"] else (0.0, 0.0))
    if hf["architecture"] == "MistralForCausalLM":
        from_gguf["architecture"] = "MistralForCausalLM"
    # a llama3 rotary is a rope_freqs tensor of divisors there (test_parity serves it against HF)
    if hf["rope_scaling"] and hf["rope_scaling"]["rope_type"] == "llama3":
        assert from_gguf.pop("rope_scaling")["rope_type"] == "factors"
        hf.pop("rope_scaling")
    differ = {k: (v, from_gguf[k]) for k, v in hf.items() if not _same(v, from_gguf[k])}
    assert not differ, f"{kind}: HF config vs GGUF: {differ}"


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
def test_the_keys_a_family_flag_opens_are_read(kind, tiny_pair):
    """Each key of the family's own config.json that a flag opens (soft caps, Granite's
    multipliers, Gemma's attention scale and local base, experts and their keys, the rotary-free
    layers) reaches the config: a flag left off would drop it silently."""
    path = tiny_pair(kind).hf_path
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    ours = load_config(resolve_model(path))
    read = {"attn_logit_softcapping": ours.attn_softcap, "final_logit_softcapping": ours.final_softcap,
            "embedding_multiplier": ours.embedding_multiplier, "residual_multiplier": ours.residual_multiplier,
            "attention_multiplier": ours.attention_multiplier, "logits_scaling": ours.logits_scaling,
            "query_pre_attn_scalar": ours.attention_multiplier and ours.attention_multiplier ** -2,
            "num_experts": ours.num_experts, "num_local_experts": ours.num_experts,
            "norm_topk_prob": ours.norm_topk_prob, "shared_expert_intermediate_size": ours.shared_expert_size,
            "no_rope_layers": [int(r) for r in ours.rope_layers or [True] * ours.num_layers]}
    rope = cfg.get("rope_parameters") or {}
    if "sliding_attention" in rope:
        read["rope_parameters"], cfg["rope_parameters"] = ours.local_rope_theta, rope["sliding_attention"]["rope_theta"]
    keys = [k for k in read if cfg.get(k) is not None]
    assert {k: read[k] for k in keys} == pytest.approx({k: cfg[k] for k in keys}, rel=1e-9)


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
def test_the_norm_flags_are_the_checkpoints(kind, tiny_pair):
    """Where a family's norms sit and what its q/k norms cover, as the HF checkpoint's own
    tensors say (both readers take these from the table alone)."""
    family = model_config.hf_family(_hf_name(kind))
    config = load_config(resolve_model(tiny_pair(kind).hf_path))
    layer = {name.removeprefix("model.layers.0."): shape for name, shape in
             _checkpoint_shapes(tiny_pair(kind).hf_path).items() if name.startswith("model.layers.0.")}
    q_norm = layer.get("self_attn.q_norm.weight")
    assert family.qk_norm == {None: "", (config.head_dim,): "head",
                              (config.num_heads * config.head_dim,): "projection"}[q_norm]
    if "input_layernorm.weight" not in layer:
        norms = "post"
    else:
        norms = "sandwich" if "post_feedforward_layernorm.weight" in layer else "pre"
    assert family.norms == norms


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
def test_gguf_layer_tensors_land_on_the_checkpoints(kind, tiny_pair):
    """Each layer tensor of the GGUF that the loader names (`gguf_to_hf_name`, the family's
    `gguf_tensor_names` over a Llama's) is a tensor of the HF checkpoint of the same shape, and
    no two land on one (a family's file meaning another tensor by a Llama's name shows here)."""
    pair = tiny_pair(kind)
    family = model_config.hf_family(_hf_name(kind))
    shapes = _checkpoint_shapes(pair.hf_path)
    landed = {}
    for t in gguf_reader(pair.gguf_path).tensors:
        hf = loader.gguf_to_hf_name(t.name, family.hf_name)
        if hf is None or not t.name.startswith("blk."):
            continue
        assert hf not in landed, f"{t.name} and {landed.get(hf)} both read as {hf}"
        landed[hf] = t.name
        assert hf in shapes, f"{t.name} reads as {hf}, which the checkpoint lacks"
        assert tuple(int(d) for d in reversed(t.shape)) == shapes[hf], t.name
    assert len(landed) >= 2 * 6  # each layer: two norms, attention in and out, the MLP in and out (or a router)


def test_the_sliding_rules_are_transformers_defaults():
    """Where a HF config has no `layer_types` (transformers 4 wrote none), the family's rule
    (`Family.sliding`) slides the layers transformers' config class would name."""
    shape = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=7, sliding_window=8)
    checked = []
    for kind, (cls, _) in TINY_CONFIGS.items():
        family = model_config.hf_family(_hf_name(kind))
        if family.sliding not in ("pattern", "max_window_layers"):
            continue
        extra = dict(use_sliding_window=True, max_window_layers=3) if family.sliding == "max_window_layers" else {}
        config = getattr(transformers, cls)(**shape, **extra)
        cfg = {**config.to_dict(), "architectures": [family.hf_name]}
        cfg.pop("layer_types")
        ours = ModelConfig.from_hf(cfg)
        assert [ours.window(i) is not None for i in range(7)] == [t == "sliding_attention" for t in config.layer_types]
        checked.append(family.hf_name)
    assert set(checked) == {"Qwen2ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM"}
