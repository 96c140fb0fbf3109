"""Weight-only quantized matrices, multiplied by our native CPU kernels (kernels/cpu).

A served matrix is the file's own blocks laid out once at load in the kernels' tiles
(`radixlm.kernels.cpu.pack`, straight from the mapped file: no float32 copy is ever made), in its
own format and size: Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0 and MXFP4, a fused projection's parts
each in its own (Q4_K_M's q and k in Q4_K beside v in Q6_K). `radixlm.kernels.cpu.quant_matmul`
quantizes the activations per block of 32 to int16 and takes exact integer dots against the
codes, every batch size on the codes (no dense copy is kept anywhere): each output summed in one
order whatever the batch, so batch invariance costs nothing and --deterministic needs no plan.

Which matrices are served so is decided before loading (`plan_serving`), and each matrix as its
parts arrive (`serve`): --quantization auto serves the file's own codes wherever the kernels
read its format, and leaves a matrix dense where any part of it is dense in the file;
int4 and int8 serve the file's codes of that width and requantize the rest here from their
dequantized values (int4 by each group's min and max, Q4_1's rule; int8 symmetric per group,
Q8_0's). The embedding table (and the LM head, one table when tied) is served from the file's
codes too under auto; int4 and int8 never take it below 8 bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Sequence

import torch

from radixlm.runtime.args import QUANT_GROUP_SIZES as GROUP_SIZES, QUANTIZATIONS as METHODS

if TYPE_CHECKING:
    from radixlm.kernels.cpu import Part, Tiled
    from radixlm.runtime.worker.loader import Piece


KERNEL_GROUP = 32  # columns per scale in the kernels' layout
# The file formats the kernels serve as they are, by their codes' width
FILE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "MXFP4": 4, "Q5_K": 5, "Q6_K": 6, "Q8_0": 8}


class Blocks(NamedTuple):
    """A [rows, cols] matrix as integer codes in groups of `group` columns: w = scale * code + zero
    (scale and zero [rows, cols // group], fp32; codes uint8 for 4 bits, int8 for 8): codes made
    here from dense weights."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group: int

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.codes.shape
        g = self.codes.float().view(rows, cols // self.group, self.group)
        return (g * self.scale[..., None] + self.zero[..., None]).view(rows, cols)

    @staticmethod
    def int4_from(w: torch.Tensor, group: int) -> Blocks:
        """Round-to-nearest 4-bit codes by each group's min and max (llama.cpp's Q4_1 rule)."""
        rows, cols = w.shape
        g = w.float().view(rows, cols // group, group)
        low, high = g.amin(-1), g.amax(-1)
        scale = (high - low) / 15
        inv = torch.where(scale == 0, torch.zeros_like(scale), 1 / scale)
        codes = ((g - low[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8)
        return Blocks(codes.view(rows, cols), scale, low, 4, group)

    @staticmethod
    def int8_from(w: torch.Tensor, group: int = KERNEL_GROUP) -> Blocks:
        """Symmetric 8-bit codes per group, scale max|w| / 127 (llama.cpp's Q8_0 rule)."""
        rows, cols = w.shape
        g = w.float().view(rows, cols // group, group)
        scale = g.abs().amax(-1) / 127
        inv = torch.where(scale == 0, torch.zeros_like(scale), 1 / scale)
        codes = (g * inv[..., None]).round().clamp(-127, 127).to(torch.int8)
        return Blocks(codes.view(rows, cols), scale, torch.zeros_like(scale), 8, group)

    def part(self) -> Part:
        """These codes as blocks the kernels pack (fp32 scales: Q4_1's and Q8_0's layouts widened),
        in groups of 32 (a larger group's scale repeated)."""
        from radixlm.kernels import cpu

        k = self.group // KERNEL_GROUP
        scale, zero = self.scale.repeat_interleave(k, 1), self.zero.repeat_interleave(k, 1)
        rows, cols = self.codes.shape
        blocks = cols // KERNEL_GROUP
        codes = self.codes.view(rows, blocks, KERNEL_GROUP)
        head = [scale.float().contiguous().view(torch.uint8).view(rows, blocks, 4)]
        if self.bits == 4:
            head.append(zero.float().contiguous().view(torch.uint8).view(rows, blocks, 4))
            body = codes[..., :16] | (codes[..., 16:] << 4)  # byte j: column j, then j + 16 (Q4_0's order)
        else:
            body = codes.view(torch.uint8)
        data = torch.cat(head + [body], -1).view(rows, -1)
        return cpu.Part("Q4_1_WIDE" if self.bits == 4 else "Q8_0_WIDE", data, torch.arange(rows))


class QuantizedMatrix:
    """A weight served from its codes: `matmul(x, bias)` for x [rows, in], `embed(ids)` for a
    table's rows. `bits`: its codes' widths; `hows`: how its parts are served, in words."""

    def __init__(self, tiled: Tiled, bits: Sequence[int], hows: Sequence[str]) -> None:
        self.tiled = tiled
        self.bits = tuple(sorted(set(bits)))
        self.hows = tuple(sorted(set(hows)))
        self.out_features, self.in_features = tiled.rows, tiled.cols
        self._op = torch.ops.radixlm.quant_matmul.default
        self._rows = torch.ops.radixlm.dequantize_rows.default
        self.dtype = torch.float32  # the model's: what an embedding lookup returns

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return self.tiled.nbytes

    def dequantize(self) -> torch.Tensor:
        """The served values, [out, in] fp32."""
        return self.embed(torch.arange(self.out_features)).float()

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.kernel(x)
        return y if bias is None else y + bias

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T on the codes (radixlm.kernels.cpu.quant_matmul, its overload called directly)."""
        x32 = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        y = self._op(x32, self.tiled.tiles, self.tiled.segments, self.out_features, -1)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the table, from the codes: only those rows' tiles are read."""
        rows = self._rows(self.tiled.tiles, self.tiled.segments, ids, self.out_features, self.in_features)
        return rows if self.dtype == torch.float32 else rows.to(self.dtype)


# ---- choosing, per matrix ------------------------------------------------------------------------

@dataclass(frozen=True)
class Serving:
    """What --quantization asks of one matrix: `method` (auto, int4, int8), `group` (int4's
    columns per scale), `role` ("linear": a layer's matrix; "table": the embedding / LM head)."""

    method: str
    group: int
    role: str


def fits(cols: int) -> bool:
    """Whether the kernels take a matrix of `cols` input columns."""
    return cols % KERNEL_GROUP == 0


def serve(pieces: Sequence[Piece], serving: Serving, shape: tuple[int, int]) -> QuantizedMatrix | None:
    """The matrix `pieces` make (its rows in order, each piece's file format its own segment) on
    the codes as `serving` asks, or None where it stays dense (auto: some part is dense in the
    file, or its columns are not whole blocks)."""
    from radixlm.kernels import cpu

    if not fits(shape[1]):
        return None
    parts: list[Part] = []
    bits: list[int] = []
    hows: set[str] = set()
    for piece in pieces:
        own = piece.file_part()
        part, width, how = _own_or_made(piece, own, serving)
        if part is None:
            return None
        parts.append(part)
        bits.append(width)
        hows.add(how)
    return QuantizedMatrix(cpu.pack(parts, shape[1]), bits, hows)


def _own_or_made(piece: Piece, own: Part | None, serving: Serving) -> tuple[Part | None, int, str]:
    """One piece's blocks as `serving` asks: the file's own (their width), codes made here, or
    None (auto, and the piece has no codes the kernels read)."""
    fmt = piece.format
    width = FILE_BITS.get(fmt, 0) if own is not None else 0
    table = serving.role == "table"
    if own is not None and (serving.method == "auto"
                            or (width == 8 and (serving.method == "int8" or table))
                            or (serving.method == "int4" and not table and width == 4 and serving.group == KERNEL_GROUP)):
        return own, width, f"{_width_name(fmt)}: the file's {fmt} codes"
    if serving.method == "auto":
        return None, 0, ""
    if serving.method == "int4" and not table:
        return Blocks.int4_from(piece.dense(), serving.group).part(), 4, f"int4 g{serving.group} (requantized from {fmt})"
    return Blocks.int8_from(piece.dense()).part(), 8, f"int8 g{KERNEL_GROUP} (requantized from {fmt})"


def _width_name(fmt: str) -> str:
    return {"Q6_K": "int6 g16", "MXFP4": "fp4 g32"}.get(fmt, f"int{FILE_BITS[fmt]} g32")


def dense_how(formats: set[str], dtype: torch.dtype) -> str:
    """How a dense matrix is served, in words."""
    source = "/".join(sorted(formats)) or "dense"
    return f"dense {str(dtype).removeprefix('torch.')}" + (f" (dequantized from {source})" if source != "dense" else "")


# ---- a whole model -------------------------------------------------------------------------------

@dataclass
class Summary:
    """What the served weights are, for logs and /get_server_info."""

    requested: tuple[str, int]  # (--quantization, group size) as asked
    method: str  # none, int8, int4 or mixed (auto resolved)
    formats: dict[str, str]  # role -> how it is served, e.g. "int4 g32: the file's Q4_1 codes"
    weight_bytes: int
    kernels: str = "none"  # the native kernels' path (kernels/cpu ISA name), or none
    kernels_failure: str = ""  # why the kernels could not be built, where auto fell back to dense weights


class Kernels(NamedTuple):
    """The native kernels' path on this CPU (kernels/cpu's ISA name), or None where the weights
    stay dense; `failure`: why they could not be built, where that is why."""

    isa: str | None
    failure: str = ""


def native_kernels() -> Kernels:
    """The native kernels' path on this CPU (built on first use), or why they could not be built."""
    from radixlm.kernels import cpu

    try:
        return Kernels(cpu.isa_name())
    except cpu.NativeBuildError as e:
        return Kernels(None, str(e))


def _check(method: str, group: int) -> None:
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}; got {method!r}")
    if group not in GROUP_SIZES:
        raise ValueError(f"quantization group size must be one of {GROUP_SIZES}; got {group}")


def plan_serving(model: torch.nn.Module, method: str, group: int, device: torch.device) -> Kernels:
    """Before loading: mark each matrix module with what --quantization asks of it (`serving`),
    which its loader follows as its parts arrive. Returns the native kernels' path, or None where
    everything stays dense (`none`; auto without the kernels, or off a CPU)."""
    _check(method, group)
    kernels = _kernels_for(method, device)
    for role in ("linear", "table"):
        for m in _matrices(model, role):
            m.serving = Serving(method, group, role) if kernels.isa else None
    return kernels


def _kernels_for(method: str, device: torch.device) -> Kernels:
    if method == "none":
        return Kernels(None)
    if device.type != "cpu":
        if method != "auto":
            raise ValueError(f"--quantization {method} runs on CPU only (radixlm's native CPU kernels); "
                             f"on {device.type} use --quantization none")
        return Kernels(None)
    kernels = native_kernels()
    if kernels.isa is None and method != "auto":
        raise ValueError(f"--quantization {method} needs radixlm's native CPU kernels, which could not be "
                         f"built here ({kernels.failure}); use --quantization none")
    return kernels


def quantize_dense(model: torch.nn.Module, method: str, group: int, device: torch.device) -> Kernels:
    """Serve an already loaded dense model's matrices as --quantization asks (random weights made
    in place, `--load-format dummy`): int4 and int8 requantize them; auto and none leave them."""
    from radixlm.runtime.worker.loader import Piece, Weight

    kernels = plan_serving(model, method, group, device)
    for m in _matrices(model, "linear") + _matrices(model, "table"):
        serving = m.__dict__.pop("serving", None)
        if kernels.isa is None or serving is None or serving.method == "auto":
            continue
        w = m.weight.data
        q = serve([Piece(Weight(w, w.shape), slice(None), slice(None))], serving, tuple(w.shape))
        if q is not None:
            replace_weight(m, q)
    return kernels


def replace_weight(module: torch.nn.Module, q: QuantizedMatrix) -> None:
    del module.weight
    module.weight = q


def summarize(model: torch.nn.Module, requested: tuple[str, int], kernels: Kernels, dtype: torch.dtype) -> Summary:
    """After loading: what the served weights are (and `model.quantization` set to it); the
    tables' lookups return `dtype`, the model's."""
    for q in served_matrices(model):
        q.dtype = dtype
    linears, tables = _matrices(model, "linear"), _matrices(model, "table")
    formats: dict[str, set[str]] = {}
    for role, modules in (("layers", linears), ("embedding and LM head", tables)):
        for m in modules:
            w = m.weight
            hows = w.hows if isinstance(w, QuantizedMatrix) else (dense_how(getattr(m, "file_formats", set()), w.dtype),)
            formats.setdefault(role, set()).update(hows)
    served = [m.weight for m in linears if isinstance(m.weight, QuantizedMatrix)]
    bits = {b for q in served for b in q.bits}
    any_codes = any(isinstance(m.weight, QuantizedMatrix) for m in linears + tables)
    method = {frozenset({4}): "int4", frozenset({8}): "int8"}.get(frozenset(bits), "mixed" if bits else
                                                                   ("int8" if any_codes else "none"))
    summary = Summary(requested, method, {k: "; ".join(sorted(v)) for k, v in formats.items()}, weight_bytes(model),
                      kernels=kernels.isa if any_codes and kernels.isa else "none", kernels_failure=kernels.failure)
    model.quantization = summary
    return summary


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the served weights hold: dense parameters (with the layouts oneDNN made of them,
    runtime/worker/gemm.py) and codes."""
    params = [p for p in model.parameters() if not p.is_meta]
    dense = sum(p.numel() * p.element_size() for p in params)
    dense += sum(p._onednn_packed.numel() * p._onednn_packed.element_size()
                 for p in params if getattr(p, "_onednn_packed", None) is not None)
    return dense + sum(q.nbytes for q in served_matrices(model))


def parameter_count(model: torch.nn.Module) -> int:
    """The model's weights, however served (each quantized matrix counted once)."""
    return sum(p.numel() for p in model.parameters()) + sum(q.out_features * q.in_features
                                                           for q in served_matrices(model))


def served_matrices(model: torch.nn.Module) -> list[QuantizedMatrix]:
    """The model's quantized matrices, each once (a tied table serves two modules)."""
    seen = {id(m.weight): m.weight for m in model.modules() if isinstance(getattr(m, "weight", None), QuantizedMatrix)}
    return list(seen.values())


def _matrices(model: torch.nn.Module, role: str) -> list[torch.nn.Module]:
    return [m for m in model.modules() if getattr(m, "quant_role", None) == role]

