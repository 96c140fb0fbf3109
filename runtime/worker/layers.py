"""Building blocks of the decoder, written tensor-parallel: at tp size 1 they are plain layers.

Every parameter carries a `weight_loader(param, loaded, shard)` that reads this
rank's slice of a checkpoint tensor (a loader.Weight: only those rows or
columns are read) into it, so the model's loader needs no knowledge of the
parallel layout.

The matrices (`quant_role` "linear" or "table") may be served quantized
(runtime/worker/quant.py): their loaders then also keep the file's own codes for the
same slice (`param.file_blocks`), and after loading `quant.quantize_model` replaces
`weight` with a QuantizedMatrix, which `linear` and the embedding dispatch on.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.worker import lora
from radixlm.runtime.worker.gemm import linear
from radixlm.runtime.worker.loader import Weight
from radixlm.runtime.worker.parallel import TPContext
from radixlm.runtime.worker.quant import Blocks, QuantizedMatrix


def _param(shape: Sequence[int], loader: Callable[..., None]) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


def _keep_blocks(param: nn.Parameter, loaded: Weight, part: Callable[[], Blocks | None], rows: slice,
                 cols: slice = slice(None)) -> None:
    """Note the file's format for `param` and, when quantized serving asked for them
    (`param.keep_blocks`), record its codes for `param[rows, cols]` (`part` reads them); one part
    without codes, or of another kind, leaves none for the whole."""
    if not hasattr(param, "keep_blocks"):
        return
    param.file_formats = getattr(param, "file_formats", set()) | {loaded.format}  # type: ignore[attr-defined]
    have = getattr(param, "file_blocks", None)
    if not param.keep_blocks or have is False:
        return
    part = part()
    if part is None or (have is not None and (have.bits, have.group) != (part.bits, part.group)):
        param.file_blocks = False  # type: ignore[attr-defined]
        return
    n, k = param.shape
    if have is None and rows in (slice(None), slice(0, n)) and cols == slice(None):  # the whole matrix at once
        param.file_blocks = Blocks(part.codes, *(t.to(torch.float32, copy=True) for t in (part.scale, part.zero)),
                                   part.bits, part.group)
        return
    if have is None:  # (empty: the parts cover every row and column, as they do the weight itself)
        have = Blocks(torch.empty(n, k, dtype=part.codes.dtype), torch.empty(n, k // part.group),
                      torch.empty(n, k // part.group), part.bits, part.group)
        param.file_blocks = have  # type: ignore[attr-defined]
    g = part.group
    block_cols = slice(None) if cols == slice(None) else slice(cols.start // g, cols.stop // g)
    have.codes[rows, cols] = part.codes
    have.scale[rows, block_cols] = part.scale
    have.zero[rows, block_cols] = part.zero


class MergedColumnLinear(nn.Module):
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
        at = sum(s for s, _ in self.blocks[:shard])
        param.data[at : at + size].copy_(loaded.rows(first, size))
        if param is self.weight:
            _keep_blocks(param, loaded, lambda: loaded.row_blocks(first, size), slice(at, at + size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return lora.apply(self, x, linear(x, self.weight, self.bias))


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input dimension split across ranks; partial sums are all-reduced."""

    quant_role = "linear"

    def __init__(self, in_features: int, out_features: int, tp: TPContext, bias: bool = False) -> None:
        """`bias`: added once, to the reduced sum (every rank holds all of it)."""
        super().__init__()
        self.tp = tp
        self.weight = _param((out_features, in_features // tp.size), self._load)
        self.bias = _param((out_features,), _copy_loader) if bias else None

    def _load(self, param: nn.Parameter, loaded: Weight, shard: int = 0) -> None:
        cols = self.tp.shard(loaded.shape[1])
        param.data.copy_(loaded.cols(*cols))
        _keep_blocks(param, loaded, lambda: loaded.col_blocks(*cols), slice(None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(linear(x, self.weight))
        return lora.apply(self, x, out if self.bias is None else out.add_(self.bias))


class VocabParallelEmbedding(nn.Module):
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
        rows = loaded.rows(self.start, self.per_rank)  # the last rank's share may run past the vocabulary
        param.data.zero_()
        param.data[: rows.shape[0]].copy_(rows)
        _keep_blocks(param, loaded, lambda: loaded.row_blocks(self.start, rows.shape[0]), slice(0, rows.shape[0]))

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
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        # full-width tables (each frequency twice, as "rotate half" pairs dimension i with i + d/2)
        cos, sin = freqs.cos(), freqs.sin()
        if magnitude != 1:
            cos, sin = cos * magnitude, sin * magnitude
        self.register_buffer("cos2", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin2", torch.cat((sin, sin), dim=-1), persistent=False)

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
