"""Weight-only quantized matrices, multiplied by PyTorch's own CPU kernels.

Two served precisions, each a kernel that ships with PyTorch:

* int4: 4-bit codes in groups of `group` along the input dimension, each group with a scale and
  a zero point (w = (code - 8) * scale + zero), multiplied by `_weight_int4pack_mm_for_cpu`;
* int8: 8-bit codes with one scale per output row (w = code * scale), by `_weight_int8pack_mm`.

Both take their activations (and scales) in bf16 and accumulate in fp32: on an AVX-512-bf16 EPYC
they read SmolLM2's weights at batch 1 in 3.3 and 5.2 ms against fp32's 10.1, but with fp32
activations they ran 10-100x slower (benchmarks/quant_kernels.py), so activations are cast to
bf16 at each quantized matmul and the result back to fp32; norms, attention and sampling stay fp32.

A GGUF block format that is a group-32 scale and zero point serves its own codes (loader.py
reads them): Q4_1 (w = d * q + m) is int4 with scale d and zero m + 8d, Q4_0 (w = d * (q - 8))
int4 with scale d and zero 0, Q4_K (w = d * sc * q - dmin * m per sub-block of 32) int4 with
scale d * sc; only the scales and zero points are rounded (to bf16, as the kernel wants them in
the activations' dtype). Q8_0 (one scale per 32 codes) has no int8 kernel with per-group
scales, so its codes are split into two 4-bit halves for the int4 kernel (GroupInt8Matrix):
exact too, scales aside. Everything else (fp checkpoints, other GGUF types) is quantized here from its
dequantized values: int4 by each group's min and max (Q4_1's own rule), int8 per output row.

The int4 kernel unpacks codes for every activation row, so from some batch size on a dense
matmul is faster (16 rows on that EPYC: 10.9 ms for dense bf16 against 15.4). A quantized matrix
therefore keeps a dense copy of its dequantized values for prefill-sized batches when the
timing at start says one is worth it (`Plan.dense_above`); decode batches read the codes.

The embedding table and the LM head never go below 8 bits (the LM head's precision is most of
a small model's quality loss): a Q8_0 table is served from its codes, any other as int8 per
row. One table serves both when they are tied, and the embedding reads only the rows it
looks up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from radixlm.runtime.args import QUANT_GROUP_SIZES as GROUP_SIZES, QUANTIZATIONS as METHODS
from radixlm.runtime.utils import best_time

log = logging.getLogger(__name__)

ACT = torch.bfloat16  # the activations' dtype on the quantized path (the kernels' fast one)
# the ops' overloads, resolved once (about 120 calls a token)
_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default
_INT8_MM = torch.ops.aten._weight_int8pack_mm.default


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


class Plan(NamedTuple):
    """How a step's matmuls run: batches of more than `dense_above` rows on the dense copies
    (None: always on the codes)."""

    dense_above: int | None = None


class QuantizedMatrix:
    """A weight in a served precision: `matmul(x, bias, plan)` for x [rows, in]."""

    bits: int
    out_features: int
    in_features: int
    code_bytes: int

    def __init__(self, values: torch.Tensor) -> None:
        # the served values in fp32 (the codes dequantized), until `settle` makes the dense copy of them
        self.source: torch.Tensor | None = values
        self.dense: torch.Tensor | None = None  # oneDNN-packed copy for large batches, when the plans use one
        self.dtype = torch.float32  # the model's: what an embedding lookup returns (quantize_model sets it)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        dense = 0 if self.dense is None else self.out_features * self.in_features * self.dense.element_size()
        return self.code_bytes + dense

    def settle(self, dense_dtype: torch.dtype | None) -> None:
        """Keep a dense copy of the served values in `dense_dtype` (None: none); drop the fp32 ones."""
        if dense_dtype is not None:
            self.dense = _pack_dense(self.source.to(dense_dtype))
        self.source = None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, plan: Plan) -> torch.Tensor:
        above = plan.dense_above
        if above is not None and x.shape[0] > above and self.dense is not None:
            y = _dense_matmul(x, self.dense).to(x.dtype)
        else:
            y = self.kernel(x.to(ACT)).to(x.dtype)
        return y if bias is None else y + bias

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T on the codes, x in bf16."""
        raise NotImplementedError


def int4_fits(rows: int, cols: int, group: int) -> bool:
    """Whether the int4 kernel takes a [rows, cols] weight in groups of `group` (it packs 16 rows at a time)."""
    return rows % 16 == 0 and cols % group == 0


class Int4Matrix(QuantizedMatrix):
    bits = 4

    def __init__(self, blocks: Blocks) -> None:
        super().__init__(blocks.dequantize())
        if blocks.bits != 4:
            raise ValueError("int4 needs 4-bit codes")
        self.out_features, self.in_features = blocks.codes.shape
        self.group = blocks.group
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.codes.to(torch.int32), 1)
        # the kernel's w = (code - 8) * scale + zero, as [in / group, out, 2]
        zero = blocks.zero + 8 * blocks.scale
        self.scales_zeros = torch.stack([blocks.scale, zero], -1).transpose(0, 1).contiguous().to(ACT)
        self.code_bytes = self.packed.numel() + self.scales_zeros.numel() * 2

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        return _INT4_MM(x, self.packed, self.group, self.scales_zeros)


class GroupInt8Matrix(QuantizedMatrix):
    """8-bit codes with a scale per group of 32 (GGUF Q8_0: w = d * q), served exactly on the int4
    kernel: with u = q + 128 split into nibbles (hi, lo), w = 16d * hi - 128d + d * lo, two
    int4 halves side by side along the input dimension, multiplied in one call by [x, x]. Reads
    1.25 bytes per weight; per-row int8 (1 byte) cost SmolLM2's LM head a point of top-1
    agreement with fp32 (benchmarks/quality.py). Also an embedding table, from the codes."""

    bits = 8

    def __init__(self, blocks: Blocks) -> None:
        super().__init__(blocks.dequantize())
        if blocks.bits != 8 or blocks.zero.any():
            raise ValueError("group int8 needs symmetric 8-bit codes (Q8_0)")
        self.out_features, self.in_features = blocks.codes.shape
        u = blocks.codes.to(torch.int32) + 128
        scale = blocks.scale.to(ACT).float()  # the kernel's bf16: 16x and 8x of it are exact
        # as Blocks (w = scale * code + zero): 16d * hi - 128d, and d * lo
        halves = Blocks(torch.cat([u >> 4, u & 15], 1).to(torch.uint8), torch.cat([16 * scale, scale], 1),
                        torch.cat([-128 * scale, torch.zeros_like(scale)], 1), 4, blocks.group)
        self._pair = Int4Matrix(halves)
        self._pair.settle(None)
        self.codes, self.scale, self.group = blocks.codes, scale, blocks.group
        self.code_bytes = self._pair.code_bytes + self.codes.numel() + self.scale.numel() * 4

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        return self._pair.kernel(torch.cat([x, x], 1))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the table, from the codes: only those rows are read."""
        rows = self.codes[ids].float().view(*ids.shape, -1, self.group)
        return (rows * self.scale[ids][..., None]).flatten(-2).to(self.dtype)


class Int8Matrix(QuantizedMatrix):
    """int8 codes with one scale per output row; also an embedding table (`embed`)."""

    bits = 8

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        w = weight.float()
        # the kernel's scale is bf16: round it up first (so no code passes 127), then the codes to it
        scale = (w.abs().amax(1) / 127 * (1 + 2**-7)).clamp(min=torch.finfo(ACT).tiny).to(ACT)
        self._scale32 = scale.float()
        self.codes = (w / self._scale32[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.scale = scale
        super().__init__(self.codes.float() * self._scale32[:, None])
        self.code_bytes = self.codes.numel() + self.scale.numel() * 2

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        return _INT8_MM(x, self.codes, self.scale)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the table: only those rows are read."""
        return (self.codes[ids].float() * self._scale32[ids, None]).to(self.dtype)


def _pack_dense(w: torch.Tensor) -> torch.Tensor:
    if torch.backends.mkldnn.is_available():
        return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 16)
    return w.contiguous()


def _dense_matmul(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    xd = x.to(packed.dtype)
    if torch.backends.mkldnn.is_available():
        return torch.ops.mkldnn._linear_pointwise(xd, packed, None, "none", [], "")
    return F.linear(xd, packed)


# ---- choosing at start ---------------------------------------------------------------------------

PLAN_ROWS = (1, 4, 8, 16, 32, 64)


class Timing(NamedTuple):
    """One layer's matrices timed on the codes and on dense copies (ms per pass by rows)."""

    rows: tuple[int, ...]
    codes: tuple[float, ...]
    dense: dict[torch.dtype, tuple[float, ...]]

    def plans(self, invariant_rows: int) -> tuple[Plan, Plan, torch.dtype | None]:
        """(the plan by batch size, the one-kernel plan for --deterministic, the dense copies'
        dtype or None): codes up to the first row count where a dense copy is faster."""
        best_dense = min(self.dense, key=lambda dt: self.dense[dt][-1])  # at prefill's batch sizes
        dense = self.dense[best_dense]
        plan = Plan()
        for n, q, d in zip(self.rows, self.codes, dense):
            if d < q:  # NOTE: assumes the dense lead holds for larger batches, as measured
                plan = Plan(n - 1)
                break
        at = self.rows.index(invariant_rows)
        invariant = Plan(0) if dense[at] < self.codes[at] else Plan()
        used = plan.dense_above is not None or invariant.dense_above is not None
        return plan, invariant, best_dense if used else None

    def describe(self) -> str:
        cols = [f"{n} rows: codes {q:.2f}" + "".join(f", {str(dt).removeprefix('torch.')} {t[i]:.2f}"
                                                  for dt, t in self.dense.items())
                for i, (n, q) in enumerate(zip(self.rows, self.codes))]
        return "; ".join(cols) + " ms"


def time_layer(sample: list[QuantizedMatrix]) -> Timing:
    """Time `sample` (one layer's quantized matrices, not yet settled) on its kernel and on
    dense copies, fp32 and (where oneDNN has it) bf16, at PLAN_ROWS rows."""
    dtypes = [torch.float32] + ([torch.bfloat16] if torch.ops.mkldnn._is_mkldnn_bf16_supported() else [])
    dense = {dt: [_pack_dense(m.source.to(dt)) for m in sample] for dt in dtypes}
    codes, by_dtype = [], {dt: [] for dt in dtypes}
    for n in PLAN_ROWS:
        xs = {m.in_features: torch.randn(n, m.in_features) for m in sample}
        codes.append(best_time(lambda: [m.matmul(xs[m.in_features], None, Plan()) for m in sample]) * 1e3)
        for dt, ws in dense.items():
            by_dtype[dt].append(best_time(lambda: [_dense_matmul(xs[m.in_features], w) for m, w in zip(sample, ws)]) * 1e3)
    return Timing(PLAN_ROWS, tuple(codes), {dt: tuple(t) for dt, t in by_dtype.items()})


# ---- a whole model --------------------------------------------------------------------------------

INT4_FORMATS = ("Q4_0", "Q4_1", "Q4_K")  # GGUF formats whose codes int4 serves as they are
TABLE_FORMATS = ("Q4_0", "Q4_1", "Q4_K", "Q8_0")  # a quantized table in the file: 8-bit under auto


@dataclass
class Summary:
    """What the served weights are, for logs and /get_server_info."""

    requested: tuple[str, int]  # (--quantization, group size) as asked
    method: str  # none, int8, int4 or mixed (auto resolved)
    formats: dict[str, str]  # role -> how it is served, e.g. "int4 g32: the file's Q4_1 codes"
    weight_bytes: int
    plan: Plan = Plan()
    invariant_plan: Plan = Plan()
    timing: str = ""


def mark_for_codes(model: torch.nn.Module, method: str) -> None:
    """Before loading: ask the matrices' loaders to note the file's formats and, unless `method`
    is none, keep its own codes, which `quantize_model` serves where their format has a kernel."""
    for m in _matrices(model, "linear") + _matrices(model, "table"):
        m.weight.keep_blocks = method != "none"


def quantize_model(model: torch.nn.Module, method: str, group: int, invariant_rows: int) -> Summary:
    """Serve `model`'s matrices as `method` says (see the module's docstring); its weights stay
    dense for `none`, and for `auto` where the file holds them dense or the kernels are not faster
    on this CPU than fp32."""
    requested = (method, group)
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}; got {method!r}")
    if group not in GROUP_SIZES:
        raise ValueError(f"quantization group size must be one of {GROUP_SIZES}; got {group}")
    linears, tables = _matrices(model, "linear"), _matrices(model, "table")
    device = next(model.parameters()).device
    if method != "none" and device.type != "cpu":
        if method == "auto":
            method = "none"
        else:
            raise ValueError(f"--quantization {method} runs on CPU only (PyTorch's int4/int8 CPU kernels); "
                             f"on {device.type} use --quantization none")
    chosen: dict[torch.nn.Module, QuantizedMatrix] = {}
    formats: dict[str, set[str]] = {}
    for m in linears:
        q, how = _linear_choice(m.weight, method, group)
        if q is not None:
            chosen[m] = q
        formats.setdefault("layers", set()).add(how)
    for m in tables:
        file_formats = getattr(m.weight, "file_formats", set())
        blocks = getattr(m.weight, "file_blocks", None)
        source = "/".join(sorted(file_formats)) or "dense"
        if method == "none" or (method == "auto" and not file_formats & set(TABLE_FORMATS)):
            formats.setdefault("embedding and LM head", set()).add(_dense(m.weight))
        elif blocks not in (None, False) and blocks.bits == 8 and int4_fits(*m.weight.shape, blocks.group):
            chosen[m] = GroupInt8Matrix(blocks)
            formats.setdefault("embedding and LM head", set()).add(f"int8 g{blocks.group}: the file's {source} codes, "
                                                                   "scales in bf16")
        else:
            chosen[m] = Int8Matrix(m.weight.data)
            formats.setdefault("embedding and LM head", set()).add(f"int8 per row (requantized from {source})")
    summary = Summary(requested, "none", {k: "; ".join(sorted(v)) for k, v in formats.items()}, 0)
    layer = [chosen[m] for m in linears[:4] if m in chosen]  # one layer's matrices (qkv, o, gate_up, down)
    if layer:
        timing = time_layer(layer)
        summary.timing = timing.describe()
        log.info("quantized matmuls against dense copies: %s", summary.timing)
        if method == "auto" and timing.codes[0] >= min(t[0] for t in timing.dense.values()):
            log.info("quantization auto: the codes are no faster than dense weights at batch 1 here; serving dense")
            chosen, summary.formats = {}, {k: _dense(m.weight) for k, m in (("layers", linears[0]),
                                                                           ("embedding and LM head", tables[0]))}
        else:
            summary.plan, summary.invariant_plan, dense_dtype = timing.plans(invariant_rows)
            for m, q in chosen.items():
                # a table's dense copy stays fp32: bf16 weights in the LM head cost as much agreement
                # with fp32 as per-row int8 did (benchmarks/quality.py)
                q.settle(torch.float32 if dense_dtype is not None and m in tables else dense_dtype)
    elif chosen:  # only tables: their own kernel at every batch size
        for q in chosen.values():
            q.settle(None)
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


def _linear_choice(w: torch.Tensor, method: str, group: int) -> tuple[QuantizedMatrix | None, str]:
    """How one layer matrix is served, and in words."""
    file_formats = getattr(w, "file_formats", set())
    blocks = getattr(w, "file_blocks", None)
    source = "/".join(sorted(file_formats)) or "dense"
    fits = blocks not in (None, False) and int4_fits(*w.shape, blocks.group)
    own = fits and blocks.bits == 4 and file_formats <= set(INT4_FORMATS)
    own8 = fits and blocks.bits == 8
    if method == "auto":
        if own:
            return Int4Matrix(blocks), f"int4 g{blocks.group}: the file's {source} codes, scales in bf16"
        if own8:
            return GroupInt8Matrix(blocks), f"int8 g{blocks.group}: the file's {source} codes, scales in bf16"
        return None, _dense(w)
    if method == "int4":
        if own and blocks.group == group:
            return Int4Matrix(blocks), f"int4 g{group}: the file's {source} codes, scales in bf16"
        if not int4_fits(*w.shape, group):
            return Int8Matrix(w.data), f"int8 per row (from {source}: {tuple(w.shape)} does not fit int4 g{group})"
        return Int4Matrix(Blocks.int4_from(w.data, group)), f"int4 g{group} (requantized from {source})"
    if method == "int8":
        if own8:
            return GroupInt8Matrix(blocks), f"int8 g{blocks.group}: the file's {source} codes, scales in bf16"
        return Int8Matrix(w.data), f"int8 per row (from {source})"
    return None, _dense(w)
