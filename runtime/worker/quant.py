"""Weight-only quantized matrices, multiplied by our native CPU kernels (kernels/cpu).

A served matrix is integer codes in groups of 32 input columns, w = scale * code + zero: 4-bit
codes (0..15) or 8-bit (int8), scale and zero per group, kept in fp16 where that is exact (the
file's own fp16 values) and fp32 where it is not, laid out once at load in the kernels' tiles
(`radixlm.kernels.cpu.tile`: 8 rows' codes, scales and zero points together, one stream a
matrix). `radixlm.kernels.cpu.quant_matmul` quantizes the activations per block of 32 to int16
and takes integer dot products against the codes.

A GGUF block format that is a scale and zero point per 32 columns serves its own codes, read by
loader.py: Q4_1 (w = d * q + m), Q4_0 (w = d * q - 8d), Q4_K (w = d * sc * q - dmin * m per
sub-block of 32), Q5_K (the same with 5-bit codes, served as 8-bit ones), Q8_0 (w = d * q), and
Q6_K (w = d * sc * q, q in -32..31, a scale per 16 columns: 8-bit codes in groups of 16), and
MXFP4 (gpt-oss's experts: w = 2^(e - 128) * q, q twice an E2M1 value, an integer in -12..12): all
exact, nothing requantized. Everything else (dense
checkpoints, other GGUF types) is quantized here from its dequantized values when asked:
int4 by each group's min and max (Q4_1's rule), int8 symmetric per group (Q8_0's).

Which kernel runs a step's matmuls is a fact of the CPU and the batch, never a timing. Where
oneDNN multiplies bf16 natively (AVX-512 bf16, AMX), batches of more than `CODES_ROWS` rows
(prefill, large decode batches) run on a bf16 dense copy of the served values, made once at
load. Everywhere else every batch reads the codes: the kernel's 16-bit integer multiply-adds
take 16 products an instruction where an fp32 FMA takes 8, so on the codes a batch of 32 ran
1.2-1.5x and prefill rows 1.1-1.4x as fast as oneDNN's fp32 on the same values (AMD EPYC, AVX2:
benchmarks/README.md), with no dense copy in memory. Under --deterministic every batch reads the
codes: the kernel sums each output in one order whatever the batch, so batch invariance costs
no padding.

The embedding table and the LM head never go below 8 bits (the LM head's precision is most of
a small model's quality loss): a Q8_0 table is served from its codes, any other as int8 in
groups of 32; one table serves both when they are tied, and the embedding reads only the rows
it looks up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from radixlm.runtime.args import QUANT_GROUP_SIZES as GROUP_SIZES, QUANTIZATIONS as METHODS

log = logging.getLogger(__name__)

KERNEL_GROUP = 32  # columns per scale in the kernels' layout
# Where the CPU multiplies bf16 natively, batches of up to this many rows read the codes and
# larger ones the bf16 dense copy (a fixed rule: the same file on the same machine is always
# served the same way).
CODES_ROWS = 8


class Blocks(NamedTuple):
    """A [rows, cols] matrix as integer codes in groups of `group` columns: w = scale * code + zero
    (scale and zero [rows, cols // group], fp32; codes uint8 for 4 bits, int8 for 8)."""

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

    def regroup(self, group: int) -> Blocks:
        """The same values in groups of `group` (a divisor of this group): each scale repeated."""
        k = self.group // group
        return self._replace(scale=self.scale.repeat_interleave(k, 1), zero=self.zero.repeat_interleave(k, 1),
                             group=group)


class Plan(NamedTuple):
    """How a step's matmuls run: batches of more than `dense_above` rows on the dense copies
    (None: always on the codes)."""

    dense_above: int | None = None


def fits(cols: int) -> bool:
    """Whether the kernels take a matrix of `cols` input columns."""
    return cols % KERNEL_GROUP == 0


def _compact(t: torch.Tensor) -> torch.Tensor:
    """fp16 where every value survives the round trip exactly (the file's own fp16 scales), else fp32."""
    half = t.to(torch.float16)
    return half if torch.equal(half.float(), t) else t.float().contiguous()


class QuantizedMatrix:
    """A weight served from its codes: `matmul(x, bias, plan)` for x [rows, in], `embed(ids)` for
    a table's rows."""

    def __init__(self, blocks: Blocks) -> None:
        from radixlm.kernels import cpu

        b = blocks.regroup(KERNEL_GROUP) if blocks.group % KERNEL_GROUP == 0 else blocks
        if b.group != KERNEL_GROUP and not (b.group == 16 and b.bits == 8 and not b.zero.any()):
            raise ValueError(f"the kernels take groups of {KERNEL_GROUP} columns (or 16, for 8-bit codes without "
                             f"zero points), not {blocks.group}")
        self.bits, self.group = b.bits, b.group
        self.out_features, self.in_features = b.codes.shape
        scale = _compact(b.scale)
        zero = _compact(b.zero).to(scale.dtype) if b.zero.any() else None
        self.tiled = cpu.tile(b.codes, scale, zero, b.bits)
        self.code_bytes = self.tiled.nbytes
        self.dense: torch.Tensor | None = None  # oneDNN-packed copy for large batches, when the plan uses one
        cpu.load()
        self._op = torch.ops.radixlm.quant_matmul.default
        self._rows = torch.ops.radixlm.dequantize_rows.default
        self._format = self.tiled.format
        self.dtype = torch.float32  # the model's: what an embedding lookup returns (quantize_model sets it)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        dense = 0 if self.dense is None else self.out_features * self.in_features * self.dense.element_size()
        return self.code_bytes + dense

    def dequantize(self) -> torch.Tensor:
        """The served values, [out, in] fp32."""
        rows = torch.arange(self.out_features)
        return self.embed(rows).float()

    def settle(self, dense_dtype: torch.dtype | None) -> None:
        """Keep a dense copy of the served values in `dense_dtype` for large batches (None: none)."""
        self.dense = None if dense_dtype is None else _pack_dense(self.dequantize().to(dense_dtype))

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, plan: Plan) -> torch.Tensor:
        above = plan.dense_above
        if above is not None and x.shape[0] > above and self.dense is not None:
            y = _dense_matmul(x, self.dense).to(x.dtype)
        else:
            y = self.kernel(x)
        return y if bias is None else y + bias

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T on the codes (radixlm.kernels.cpu.quant_matmul, its overload called directly)."""
        x32 = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        y = self._op(x32, self.tiled.tiles, *self._format, -1)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the table, from the codes: only those rows' tiles are read."""
        rows = self._rows(self.tiled.tiles, ids, *self._format, self.in_features)
        return rows if self.dtype == torch.float32 else rows.to(self.dtype)


def _pack_dense(w: torch.Tensor) -> torch.Tensor:
    if torch.backends.mkldnn.is_available():
        return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 16)
    return w.contiguous()


def _dense_matmul(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    xd = x.to(packed.dtype)
    if torch.backends.mkldnn.is_available():
        return torch.ops.mkldnn._linear_pointwise(xd, packed, None, "none", [], "")
    return F.linear(xd, packed)


# ---- a whole model --------------------------------------------------------------------------------

INT4_FORMATS = ("Q4_0", "Q4_1", "Q4_K")  # GGUF formats whose codes are served as 4-bit codes
TABLE_FORMATS = ("Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0")  # a quantized table in the file: 8-bit under auto


@dataclass
class Summary:
    """What the served weights are, for logs and /get_server_info."""

    requested: tuple[str, int]  # (--quantization, group size) as asked
    method: str  # none, int8, int4 or mixed (auto resolved)
    formats: dict[str, str]  # role -> how it is served, e.g. "int4 g32: the file's Q4_1 codes"
    weight_bytes: int
    plan: Plan = Plan()
    invariant_plan: Plan = Plan()
    kernels: str = "none"  # the native kernels' path (kernels/cpu ISA name), or none
    notes: list[str] = field(default_factory=list)


def mark_for_codes(model: torch.nn.Module, method: str) -> None:
    """Before loading: ask the matrices' loaders to note the file's formats and, unless `method`
    is none, keep its own codes, which `quantize_model` serves where their format has a kernel."""
    for m in _matrices(model, "linear") + _matrices(model, "table"):
        m.weight.keep_blocks = method != "none"


def native_kernels() -> str | None:
    """The native kernels' path on this CPU (built on first use), or None with the reason logged."""
    from radixlm.kernels import cpu

    try:
        return cpu.isa_name()
    except cpu.NativeBuildError as e:
        log.warning("%s", e)
        return None


def native_bf16() -> bool:
    """Whether oneDNN multiplies bf16 natively on this CPU (AVX-512 bf16 or AMX): only there do
    large batches run faster on a dense copy than on the codes."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def quantize_model(model: torch.nn.Module, method: str, group: int) -> Summary:
    """Serve `model`'s matrices as `method` says (see the module's docstring); its weights stay
    dense for `none`, and for `auto` where the file holds them dense or no native kernels can
    be built here."""
    requested = (method, group)
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}; got {method!r}")
    if group not in GROUP_SIZES:
        raise ValueError(f"quantization group size must be one of {GROUP_SIZES}; got {group}")
    linears, tables = _matrices(model, "linear"), _matrices(model, "table")
    device = next(model.parameters()).device
    kernels = None
    if method != "none":
        if device.type != "cpu":
            if method != "auto":
                raise ValueError(f"--quantization {method} runs on CPU only (radixlm's native CPU kernels); "
                                 f"on {device.type} use --quantization none")
        else:
            kernels = native_kernels()
            if kernels is None and method != "auto":
                raise ValueError(f"--quantization {method} needs radixlm's native CPU kernels, which could not be "
                                 "built here (the log says why); use --quantization none")
        if kernels is None:
            method = "none"
    chosen: dict[torch.nn.Module, QuantizedMatrix] = {}
    formats: dict[str, set[str]] = {}
    for m in linears:
        q, how = _linear_choice(m.weight, method, group)
        if q is not None:
            chosen[m] = q
        formats.setdefault("layers", set()).add(how)
    for m in tables:
        q, how = _table_choice(m.weight, method)
        if q is not None:
            chosen[m] = q
        formats.setdefault("embedding and LM head", set()).add(how)
    summary = Summary(requested, "none", {k: "; ".join(sorted(v)) for k, v in formats.items()}, 0,
                      kernels=kernels if chosen else "none")
    if chosen and native_bf16():
        summary.plan = Plan(CODES_ROWS)
        for m, q in chosen.items():
            # a table's dense copy stays fp32: bf16 weights in the LM head cost as much agreement
            # with fp32 as per-row int8 did (benchmarks/quality.py)
            q.settle(torch.float32 if m in tables else torch.bfloat16)
        log.info("quantized weights on the native kernels (%s): batches of up to %d rows on the codes, larger ones "
                 "on dense bf16 copies", kernels, CODES_ROWS)
    elif chosen:
        log.info("quantized weights on the native kernels (%s): every batch on the codes", kernels)
    for m in linears + tables:
        for attr in ("file_blocks", "keep_blocks"):  # the codes now live in the served matrices
            m.weight.__dict__.pop(attr, None)
    for m, q in chosen.items():
        q.dtype = m.weight.dtype
        del m.weight
        m.weight = q
    bits = {q.bits for m, q in chosen.items() if m in linears}
    summary.method = f"int{bits.pop()}" if len(bits) == 1 else ("mixed" if bits else ("int8" if chosen else "none"))
    summary.weight_bytes = weight_bytes(model)
    model.quantization = summary
    return summary


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the served weights hold: dense parameters (with the layouts oneDNN made of them,
    runtime/worker/gemm.py), codes, and the codes' dense copies."""
    params = list(model.parameters())
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


def _dense(w: torch.Tensor) -> str:
    formats = "/".join(sorted(getattr(w, "file_formats", set()))) or "dense"
    return f"dense {str(w.dtype).removeprefix('torch.')}" + (f" (dequantized from {formats})" if formats != "dense" else "")


def _file_blocks(w: torch.Tensor) -> tuple[Blocks | None, str]:
    """The file's own codes for `w` where the kernels take them, and the file's formats in words."""
    blocks = getattr(w, "file_blocks", None)
    source = "/".join(sorted(getattr(w, "file_formats", set()))) or "dense"
    if blocks in (None, False) or not fits(w.shape[1]):
        return None, source
    return blocks, source


def _linear_choice(w: torch.Tensor, method: str, group: int) -> tuple[QuantizedMatrix | None, str]:
    """How one layer matrix is served, and in words."""
    blocks, source = _file_blocks(w)
    own4 = blocks is not None and blocks.bits == 4 and getattr(w, "file_formats", set()) <= set(INT4_FORMATS)
    own8 = blocks is not None and blocks.bits == 8
    if method == "none" or not fits(w.shape[1]):
        return None, _dense(w)
    if own4 and (method == "auto" or (method == "int4" and blocks.group == group)):
        return QuantizedMatrix(blocks), f"int4 g{blocks.group}: the file's {source} codes"
    if own8 and method in ("auto", "int8"):
        return QuantizedMatrix(blocks), f"int8 g{blocks.group}: the file's {source} codes"
    if method == "int4":
        return QuantizedMatrix(Blocks.int4_from(w.data, group)), f"int4 g{group} (requantized from {source})"
    if method == "int8":
        return QuantizedMatrix(Blocks.int8_from(w.data)), f"int8 g{KERNEL_GROUP} (requantized from {source})"
    return None, _dense(w)


def _table_choice(w: torch.Tensor, method: str) -> tuple[QuantizedMatrix | None, str]:
    """How the embedding table (and the LM head, when tied) is served: never below 8 bits."""
    blocks, source = _file_blocks(w)
    file_formats = getattr(w, "file_formats", set())
    if method == "none" or not fits(w.shape[1]) or (method == "auto" and not file_formats & set(TABLE_FORMATS)):
        return None, _dense(w)
    if blocks is not None and blocks.bits == 8:
        return QuantizedMatrix(blocks), f"int8 g{blocks.group}: the file's {source} codes"
    return QuantizedMatrix(Blocks.int8_from(w.data)), f"int8 g{KERNEL_GROUP} (requantized from {source})"
