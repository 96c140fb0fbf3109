"""Multi-LoRA: PEFT adapters served beside the base model, rows of different adapters (and of
none) in one step.

An adapter (PEFT's `adapter_config.json` and `adapter_model.safetensors`) adds `scale * B (A x)`
to each projection it targets. Our projections fuse q/k/v and gate/up, so at load each of an
adapter's fused projections becomes one low-rank pair: A stacks the blocks' A's ([sum of ranks,
in]), B puts each block's B in the block's output rows and its own columns ([out, sum of ranks]),
the block's scale (alpha / r, or alpha / sqrt(r) under rsLoRA) folded in.

In a step, a projection's delta for every row is two matmuls whatever the mix: x through the A's
of the adapters the step uses, stacked ([T, sum of their ranks]); each row keeps only its own
adapter's columns (a mask, zero for a base-model row); that through the stacked B's. The stacks
are made once per set of adapters and kept (a step's set is usually the last one's). A step with
no adapter row costs nothing here.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from radixlm.runtime.worker import gemm

# PEFT's module names -> (our fused projection, its block)
_SITES = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1), "v_proj": ("self_attn.qkv_proj", 2),
          "o_proj": ("self_attn.o_proj", 0), "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
          "down_proj": ("mlp.down_proj", 0)}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
WEIGHTS_FILE = "adapter_model.safetensors"
_LFS_POINTER = b"version https://git-lfs.github.com/spec/"  # what a clone without git-lfs has in its place


class LoraError(ValueError):
    """An adapter that cannot be served with this model (the message names why)."""


_serial = itertools.count()


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int  # the largest of its modules'
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # site -> (A [R, in], B [out, R])
    uid: int = field(default_factory=lambda: next(_serial))  # this reading of it (the stacks' key)
    last_used: int = 0  # when a step last used it: ModelWorker's LRU order (--max-loaded-loras)


def sites(model: nn.Module) -> dict[str, nn.Module]:
    """Our projections an adapter can target, by site name ("layers.3.self_attn.qkv_proj"); each
    module learns its name (`lora_site`), which `apply` looks up."""
    out = {}
    for name, module in model.named_modules():
        if name.endswith(("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")):
            module.lora_site = name
            out[name] = module
    return out


def load_adapter(name: str, path: str, model: nn.Module, max_rank: int) -> LoraAdapter:
    """Read a PEFT LoRA adapter and lay it out for `model`'s projections; LoraError names what
    cannot be served (files that are not an adapter's, another model's shapes, a rank above
    `max_rank`, DoRA, biases, modules outside attention and the MLP)."""
    config = _read_config(name, path)
    tensors = _read_tensors(name, path)
    targets = sites(model)
    alpha_of = _alphas(name, config)
    rslora = bool(config.get("use_rslora"))
    found: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    modules: dict[tuple[str, int], str] = {}  # (site, block) -> the module's name in the HF model (PEFT's)
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(3) not in _SITES:
            raise LoraError(f"adapter {name!r} has a tensor this server cannot apply: {key}")
        site, block = _SITES[m.group(3)]
        site = f"layers.{m.group(1)}.{site}"
        if site not in targets:
            raise LoraError(f"adapter {name!r} targets {site}, which this model does not have")
        found.setdefault((site, block), {})[m.group(4)] = tensor.float()
        modules[site, block] = f"model.layers.{m.group(1)}.{m.group(2)}.{m.group(3)}"
    adapter = LoraAdapter(name, path, 0)
    by_site: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for (site, block), pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            raise LoraError(f"adapter {name!r}: {site} has lora_A or lora_B alone")
        a, b = pair["A"], pair["B"]
        if a.ndim != 2 or b.ndim != 2:
            raise LoraError(f"adapter {name!r}: {modules[site, block]}'s lora_A and lora_B must be matrices, "
                            f"not of shapes {tuple(a.shape)} and {tuple(b.shape)}")
        r = a.shape[0]
        if r < 1:
            raise LoraError(f"adapter {name!r}: {modules[site, block]} has rank 0")
        if r > max_rank:
            raise LoraError(f"adapter {name!r} has rank {r}, above --max-lora-rank {max_rank}")
        scale = alpha_of(modules[site, block]) / (math.sqrt(r) if rslora else r)
        by_site.setdefault(site, []).append((block, a, b * scale))
        adapter.rank = max(adapter.rank, r)
    for site, blocks in by_site.items():
        module = targets[site]
        out_features, in_features = module.weight.shape[0], module.weight.shape[1]
        sizes = [size for size, _ in module.blocks] if hasattr(module, "blocks") else [out_features]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        total = sum(a.shape[0] for _, a, _ in blocks)
        A = torch.zeros(total, in_features)
        B = torch.zeros(out_features, total)
        col = 0
        for block, a, b in blocks:
            r = a.shape[0]
            if a.shape[1] != in_features or b.shape != (sizes[block], r):
                raise LoraError(f"adapter {name!r} does not fit this model: {site} block {block} is "
                                f"{tuple(b.shape)} x {tuple(a.shape)}, the model's {sizes[block]} x {in_features}")
            A[col : col + r] = a
            B[starts[block] : starts[block] + sizes[block], col : col + r] = b
            col += r
        adapter.pairs[site] = (A, B)
    if not adapter.pairs:
        raise LoraError(f"adapter {name!r} has no LoRA tensors")
    return adapter


def _read_config(name: str, path: str) -> dict[str, Any]:
    """The adapter's `adapter_config.json`, checked for what this server cannot serve."""
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_path) or not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        raise LoraError(f"{path!r} is not a PEFT adapter (adapter_config.json and {WEIGHTS_FILE})")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:  # (a JSONDecodeError and a UnicodeDecodeError are ValueErrors)
        raise LoraError(f"adapter {name!r}: adapter_config.json is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise LoraError(f"adapter {name!r}: adapter_config.json holds a {type(config).__name__}, not an object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"adapter {name!r} is a {config.get('peft_type')} adapter, not LoRA")
    for key, bad in (("use_dora", True), ("fan_in_fan_out", True), ("lora_bias", True)):
        if config.get(key) == bad:
            raise LoraError(f"adapter {name!r}: {key} is not supported")
    if config.get("bias", "none") != "none" or config.get("modules_to_save"):
        raise LoraError(f"adapter {name!r} trains biases or whole modules (bias, modules_to_save): not supported")
    return config


def _read_tensors(name: str, path: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights_path = os.path.join(path, WEIGHTS_FILE)
    try:
        return load_file(weights_path)
    except (OSError, SafetensorError) as e:
        hint = (": it is a git-LFS pointer, not the weights (fetch them with `git lfs pull`)"
                if _is_lfs_pointer(weights_path) else "")
        raise LoraError(f"adapter {name!r}: {WEIGHTS_FILE} cannot be read ({e}){hint}") from None


def _is_lfs_pointer(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(_LFS_POINTER)) == _LFS_POINTER
    except OSError:
        return False


def _alphas(name: str, config: dict[str, Any]) -> Callable[[str], float]:
    """Each module's alpha as PEFT finds it (peft's `get_pattern_key`): the value of the first
    `alpha_pattern` key that matches the module's name (e.g. "model.layers.3.self_attn.q_proj")
    whole or as its dotted tail, else `lora_alpha`."""
    patterns = config.get("alpha_pattern") or {}
    if not isinstance(patterns, dict):
        raise LoraError(f"adapter {name!r}: alpha_pattern must be an object (a module pattern -> its alpha)")
    try:
        default = float(config.get("lora_alpha", 8))
        alphas = [(key, float(value)) for key, value in patterns.items()]
    except (TypeError, ValueError) as e:
        raise LoraError(f"adapter {name!r}: lora_alpha and alpha_pattern's values must be numbers ({e})") from None
    compiled = []
    for key, value in alphas:
        try:
            compiled.append((re.compile(rf"(.*\.)?({key})$"), value))
        except re.error as e:
            raise LoraError(f"adapter {name!r}: alpha_pattern key {key!r} is not a regular expression ({e})") from None

    def alpha_of(module: str) -> float:
        return next((value for pattern, value in compiled if pattern.match(module)), default)

    return alpha_of


class LoraStep:
    """One step's adapters: the row -> adapter map and the stacked pairs of each site."""

    def __init__(self, adapters: list[LoraAdapter], rows: torch.Tensor, cache: dict) -> None:
        """`adapters`: those the step uses; `rows` [T]: each token's index among them (-1: none);
        `cache`: the stacked pairs of the last set of adapters, by site (kept while the set is)."""
        self.adapters, self.rows, self._cache = adapters, rows, cache
        uids = tuple(a.uid for a in adapters)
        if cache.get("set") != uids:  # one set's stacks at a time: memory bounded whatever the mixes
            cache.clear()
            cache["set"] = uids

    def delta(self, site: str, x: torch.Tensor) -> torch.Tensor | None:
        if gemm.current_mode().invariant:
            return self._delta_invariant(site, x)
        key = site
        stacked = self._cache.get(key)
        if stacked is None:
            pairs = [a.pairs.get(site) for a in self.adapters]
            if all(p is None for p in pairs):
                self._cache[key] = stacked = (None, None, None)
            else:
                rank = [0 if p is None else p[0].shape[0] for p in pairs]
                out_features = next(p[1].shape[0] for p in pairs if p is not None)
                in_features = next(p[0].shape[1] for p in pairs if p is not None)
                A = torch.cat([p[0] if p is not None else torch.zeros(0, in_features) for p in pairs]).to(x.device)
                B = torch.cat([p[1] if p is not None else torch.zeros(out_features, 0) for p in pairs], 1).to(x.device)
                owner = torch.repeat_interleave(torch.arange(len(pairs)), torch.tensor(rank)).to(x.device)
                self._cache[key] = stacked = (A, B.contiguous(), owner)
        A, B, owner = stacked
        if A is None:
            return None
        mask = (self.rows[:, None] == owner[None, :]).to(x.dtype)  # each row's own adapter's columns
        shrunk = gemm.linear(x, A) * mask
        return gemm.linear(shrunk, B)

    def _delta_invariant(self, site: str, x: torch.Tensor) -> torch.Tensor | None:
        """--deterministic: each adapter's pair on its own (batch-invariant matmuls of its own
        shapes), so a row's sums never depend on which other adapters share its step; the other
        adapters add exact zeros to it."""
        out = None
        for i, adapter in enumerate(self.adapters):
            pair = adapter.pairs.get(site)
            if pair is None:
                continue
            keep = (self.rows == i).to(x.dtype)[:, None]
            part = gemm.linear(gemm.linear(x, pair[0]) * keep, pair[1])
            out = part if out is None else out + part
        return out


_step: ContextVar[LoraStep | None] = ContextVar("lora_step", default=None)


@contextmanager
def step(adapters: list[LoraAdapter], rows: torch.Tensor | None, cache: dict) -> Iterator[None]:
    """Within this block the projections add each row's adapter (`apply`); nothing when `rows`
    is None (no row of the step has one)."""
    token = _step.set(None if rows is None else LoraStep(adapters, rows, cache))
    try:
        yield
    finally:
        _step.reset(token)


def apply(module: nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out` (the projection of x) plus each row's adapter's delta, where a step has adapters."""
    current = _step.get()
    site = getattr(module, "lora_site", None)
    if current is None or site is None:
        return out
    delta = current.delta(site, x)
    return out if delta is None else out + delta
