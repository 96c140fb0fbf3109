"""Building blocks of the decoder, written tensor-parallel: at tp size 1 they are plain layers.

Every parameter is made empty, on the meta device (no memory), and carries a
`weight_loader(param, loaded, shard)` that reads this rank's slice of a checkpoint tensor (a
loader.Weight: only those rows or columns are read) into it, so the model's loader needs no
knowledge of the parallel layout; the model's `load_weights` gives a parameter its storage
(`materialize`) just before its first read.

The matrices (`quant_role` "linear" or "table") may be served quantized
(runtime/worker/quant.py): marked with a `serving` before loading, they gather their parts as
loader.Pieces (nothing read yet) and, once they have them all, become a QuantizedMatrix laid out
straight from the file's blocks, or a dense parameter read part by part where they stay dense;
`linear` and the embedding dispatch on the weight's kind.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.worker import lora, quant
from radixlm.runtime.worker.gemm import linear
from radixlm.runtime.worker.loader import Piece, Weight
from radixlm.runtime.worker.parallel import TPContext
from radixlm.runtime.worker.quant import QuantizedMatrix


def _param(shape: Sequence[int], loader: Callable[..., None]) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


def materialize(module: nn.Module, name: str, device: torch.device | str = "cpu") -> nn.Parameter:
    """`module`'s parameter `name` with storage (float32, uninitialized) in place of its empty
    meta one, its loader kept; a parameter that has storage is returned as it is."""
    param = getattr(module, name)
    if not param.is_meta:
        return param
    real = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=False)
    real.weight_loader = param.weight_loader  # type: ignore[attr-defined]
    setattr(module, name, real)
    return real


def materialize_all(model: nn.Module, device: torch.device | str) -> None:
    """Storage for every parameter still empty (weights made in place rather than loaded)."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                materialize(module, name, device)


class _Gathered:
    """A matrix module's weight as its checkpoint parts arrive (quantized serving: `serving` set):
    the parts are kept unread until the last one comes, then the matrix is served from them at
    once (`_settle`), so the file's blocks are laid out with no dense copy in between."""

    serving: quant.Serving | None = None

    def _gather(self, index: int, piece: Piece, expected: int) -> None:
        pieces = self.__dict__.setdefault("_pieces", {})
        pieces[index] = piece
        if len(pieces) == expected:
            del self._pieces
            self._settle([pieces[i] for i in sorted(pieces)])

    def _settle(self, pieces: list[Piece]) -> None:
        """Serve the matrix the pieces make (rows in order): on the codes, or dense."""
        self.file_formats = {p.format for p in pieces}
        served = quant.serve(pieces, self.serving, tuple(self.weight.shape)) if self.serving else None
        if served is not None:
            quant.replace_weight(self, served)
        else:
            param = materialize(self, "weight")
            at = 0
            for p in pieces:
                block = p.dense()
                param.data[at : at + block.shape[0]].copy_(block)
                at += block.shape[0]
        for p in pieces:
            p.weight.release()


def gathers(module: nn.Module, name: str) -> bool:
    """Whether `module.name` is a matrix that gathers its parts (and so needs no storage first)."""
    return isinstance(module, _Gathered) and name == "weight"


class MergedColumnLinear(_Gathered, nn.Module):
    """y = x W^T for several column blocks fused into one matmul (q/k/v, gate/up).

    Each block is (rows this rank holds, the first of them in the checkpoint's block): an even
    share per rank, or a replicated KV head. `shard` in the loader names the block.
    """

    quant_role = "linear"

    def __init__(self, in_features: int, blocks: Sequence[tuple[int, int]], bias: bool,
                 checkpoint_sizes: Sequence[int] | None = None) -> None:
        """`checkpoint_sizes`: each block's rows in a checkpoint that fuses them (Phi-3's
        qkv_proj, gate_up_proj); None where this rank holds every row of every block."""
        super().__init__()
        self.blocks = list(blocks)
        self.checkpoint_sizes = list(checkpoint_sizes or (size for size, _ in self.blocks))
        out = sum(size for size, _ in self.blocks)
        self.weight = _param((out, in_features), self._load)
        self.bias = _param((out,), self._load) if bias else None

    @staticmethod
    def even(tp: TPContext, sizes: Sequence[int]) -> list[tuple[int, int]]:
        """Blocks split evenly across ranks."""
        return [(end - start, start) for start, end in map(tp.shard, sizes)]

    def _load(self, param: nn.Parameter, loaded: Weight, shard: int = 0) -> None:
        size, first = self.blocks[shard]
        if param is self.bias:
            at = sum(s for s, _ in self.blocks[:shard])
            param.data[at : at + size].copy_(loaded.rows(first, size))
        else:
            self._gather(shard, Piece(loaded, slice(first, first + size)), len(self.blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return lora.apply(self, x, linear(x, self.weight, self.bias))


class RowParallelLinear(_Gathered, nn.Module):
    """y = x W^T with W's input dimension split across ranks; partial sums are all-reduced."""

    quant_role = "linear"

    def __init__(self, in_features: int, out_features: int, tp: TPContext, bias: bool = False) -> None:
        """`bias`: added once, to the reduced sum (every rank holds all of it)."""
        super().__init__()
        self.tp = tp
        self.weight = _param((out_features, in_features // tp.size), self._load)
        self.bias = _param((out_features,), _copy_loader) if bias else None

    def _load(self, param: nn.Parameter, loaded: Weight, shard: int = 0) -> None:
        start, end = self.tp.shard(loaded.shape[1])
        self._gather(0, Piece(loaded, slice(None), slice(start, end)), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(linear(x, self.weight))
        return lora.apply(self, x, out if self.bias is None else out.add_(self.bias))


class VocabParallelEmbedding(_Gathered, nn.Module):
    """Embedding table split by vocabulary rows; also serves as the (tied) LM head."""

    quant_role = "table"

    def __init__(self, vocab_size: int, dim: int, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.per_rank = math.ceil(vocab_size / tp.size)
        self.start = tp.rank * self.per_rank
        self.weight = _param((self.per_rank, dim), self._load)

    def _load(self, param: nn.Parameter, loaded: Weight, shard: int = 0) -> None:
        rows = max(0, min(self.per_rank, loaded.shape[0] - self.start))  # the last rank's share may run past the vocabulary
        self._gather(0, Piece(loaded, slice(self.start, self.start + rows), slice(None), self.per_rank - rows), 1)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, QuantizedMatrix):
            return self.weight.embed(ids)
        return F.embedding(ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = self._lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits: each rank computes its rows, then they are gathered."""
        local = linear(hidden, self.weight)
        return self.tp.all_gather_last_dim(local)[..., : self.vocab_size]


def use_native_ops(model: nn.Module) -> None:
    """Run the model's norms (with their residual adds) and SiLU-mul on the native CPU kernels
    (kernels/cpu): one call each instead of several torch ops. The worker turns this on where
    the weights are served on those kernels; `--quantization none` keeps torch's ops, which
    equal HF's bit for bit."""
    for m in model.modules():
        if isinstance(m, (RMSNorm, SiluMul)):
            m.native = True


class RMSNorm(nn.Module):
    """x / rms(x) * weight; `forward(x, residual)` first adds x into `residual` in place and
    normalizes the sum (the decoder's residual stream, one op on the native path)."""

    native = False

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param((dim,), _copy_loader)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.native and x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
            from radixlm.kernels import cpu

            return cpu.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = residual.add_(x)
        if x.dtype == torch.float32:  # one fused op, bit for bit the same as the lines below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class SiluMul(nn.Module):
    """silu(gate) * up for [tokens, 2 * inner] (gate first)."""

    native = False

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.native and gate_up.dtype == torch.float32 and gate_up.is_contiguous():
            from radixlm.kernels import cpu

            return cpu.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhMul(nn.Module):
    """gelu(gate) * up for [tokens, 2 * inner] (gate first), GELU's tanh approximation (Gemma's
    gelu_pytorch_tanh)."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class ClampedSwiGLU(nn.Module):
    """gpt-oss's experts' activation for [tokens, 2 * inner] (gate first): the gate clamped below
    `limit`, up within +-`limit`, then gate * sigmoid(alpha * gate) * (up + 1)."""

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + 1)


def activation(cfg: Any) -> nn.Module:
    """The gated MLP's activation a ModelConfig names."""
    if cfg.hidden_act == "gelu_tanh":
        return GeluTanhMul()
    if cfg.hidden_act == "swiglu_clamped":
        return ClampedSwiGLU(cfg.swiglu_alpha, cfg.swiglu_limit)
    return SiluMul()


def fit_positions(model: nn.Module, positions: int, exactly: bool) -> None:
    """`model`'s rotary tables sized for `positions`: exactly (the worker that loaded it), or grown
    where they hold fewer (a model shared by workers: each keeps the rows it reads)."""
    for m in model.modules():
        if isinstance(m, RotaryEmbedding) and (exactly or m.cos2.shape[0] < positions):
            m.resize(positions)


def _copy_loader(param: nn.Parameter, loaded: Weight, shard: int = 0) -> None:
    param.data.copy_(loaded.full())


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the "rotate half" layout over the first `dim` dimensions of a
    head (all of them but for Phi-4's partial rotary), with an optional frequency scaling (linear,
    llama3, YaRN, a GGUF's per-frequency factors, or Phi-3's LongRoPE: its long factors wherever the
    model's context passes its original one, as llama.cpp serves it at that context, and its
    attention factor on the tables)."""

    def __init__(self, dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        wavelengths = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        inv_freq = 1.0 / wavelengths
        magnitude = 1.0
        if scaling and scaling.get("rope_type") == "longrope":
            long = max_positions > scaling["original_max_position_embeddings"]
            factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
            if factors.shape != wavelengths.shape:
                raise ValueError(f"LongRoPE has {factors.numel()} factors for {wavelengths.numel()} frequencies")
            inv_freq = 1.0 / (factors * wavelengths)
            magnitude = scaling["attention_factor"]
        elif scaling and scaling.get("rope_type") == "yarn":
            inv_freq = _yarn_inv_freq(wavelengths, theta, scaling)
            magnitude = scaling["attention_factor"]
        elif scaling:
            inv_freq = _scale_inv_freq(inv_freq, scaling)
        self.inv_freq, self.magnitude = inv_freq, magnitude
        self.register_buffer("cos2", torch.empty(0), persistent=False)
        self.register_buffer("sin2", torch.empty(0), persistent=False)
        self.resize(max_positions)

    def resize(self, positions: int) -> None:
        """Tables for positions 0 .. positions - 1 (each row the same whatever the size): a
        Llama 3's 131,072 positions are 64-128 MB that a pool of a few thousand tokens never reads."""
        t = torch.arange(positions, dtype=torch.float32, device=self.cos2.device)
        freqs = torch.outer(t, self.inv_freq.to(t.device))
        # full-width tables (each frequency twice, as "rotate half" pairs dimension i with i + d/2)
        cos, sin = freqs.cos(), freqs.sin()
        if self.magnitude != 1:
            cos, sin = cos * self.magnitude, sin * self.magnitude
        self.cos2, self.sin2 = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at each position, [tokens, 1, head_dim]: looked up once per forward pass,
        shared by every layer."""
        return self.cos2[positions].unsqueeze(1), self.sin2[positions].unsqueeze(1)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim] (any heads: q and k may be rotated together); where the
        tables are narrower than a head, its first dimensions rotate and the rest pass."""
        dim = cos.shape[-1]
        if dim < x.shape[-1]:
            return torch.cat((RotaryEmbedding.rotate(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
        x32 = x.float()
        x1, x2 = x32.chunk(2, dim=-1)
        return (x32 * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


def _yarn_inv_freq(wavelengths: torch.Tensor, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: the frequencies that turn fewer than `beta_slow` times over the original context are
    interpolated (divided by the factor), those that turn more than `beta_fast` times kept, and
    those between blended along a linear ramp over their index (its ends rounded outwards where
    `truncate`, as llama.cpp always does)."""
    dim = 2 * wavelengths.shape[0]
    original, factor = scaling["original_max_position_embeddings"], scaling["factor"]

    def index_turning(turns: float) -> float:  # the (fractional) frequency index that turns `turns` times
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = index_turning(scaling["beta_fast"]), index_turning(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1: the frequency as it is, 0: interpolated
    return 1.0 / (factor * wavelengths) * (1 - kept) + 1.0 / wavelengths * kept


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "factors":  # a GGUF's rope_freqs: each frequency's divisor, as llama.cpp applies it
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_freqs holds {factors.numel()} factors for {inv_freq.numel()} frequencies")
        return inv_freq / factors
    if kind != "llama3":
        raise NotImplementedError(f"rope scaling {kind!r} is not supported (supported: default, linear, llama3, "
                                  "yarn, longrope)")
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return torch.where(mid, blended, out)
