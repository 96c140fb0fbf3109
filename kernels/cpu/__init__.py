"""radixlm's native CPU kernels: quantized matmuls on a GGUF file's own codes, and fused ops.

C++ in `csrc/`, registered as torch ops (`torch.ops.radixlm.*`), built on first use by `build.py`
and cached. Every op takes `isa` (-1: the best this CPU runs, chosen once from cpuid; 0: the
portable path; 1: AVX2+FMA+F16C; 2: AVX-512 F/BW/VL/VNNI for the matmuls) so tests can run each path against the portable one.
`reference.py` holds the torch reference of each op.

    from radixlm.kernels import cpu
    cpu.load()                      # builds once per machine; raises cpu.NativeBuildError
    w = cpu.pack([cpu.Part("Q4_0", blocks, rows)], cols)  # once, at load: the file's blocks as tiles
    y = cpu.quant_matmul(x, w)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from radixlm.kernels.cpu.build import NativeBuildError, cpu_flags, load

ISA_NAMES = ("portable", "avx2", "avx512")
BLOCK = 32  # columns per scale: the weights' groups and the activations' blocks


def best_isa() -> int:
    """The best path this CPU runs (an index into ISA_NAMES)."""
    load()
    return int(torch.ops.radixlm.best_isa())


def isa_name(isa: int = -1) -> str:
    return ISA_NAMES[best_isa() if isa < 0 else isa]


TILE_ROWS = 8  # weight rows per tile (csrc/tiles.h)

# The block formats a matrix is packed from (csrc/repack.h `Source`): GGUF's own, and two with
# fp32 scales for codes made at load (int4 and int8 requantized from dense weights). Each: its
# number, and (columns, bytes) per block.
SOURCES = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q4_K": 3, "Q5_K": 4, "Q6_K": 5, "MXFP4": 6, "Q4_1_WIDE": 7, "Q8_0_WIDE": 8}
BLOCK_SHAPES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_K": (256, 176),
                "Q6_K": (256, 210), "MXFP4": (32, 17), "Q4_1_WIDE": (32, 24), "Q8_0_WIDE": (32, 36)}
# the tile formats (csrc/tiles.h `Codes`), as a segment's kind
CODES = ("u4", "s4", "s8", "k4", "k5", "k6", "f4")


class Part(NamedTuple):
    """Rows of a matrix in a file's block format: `data` uint8 [rows, bytes] (each row's blocks for
    the matrix's columns; rows may be strided, e.g. a view of a mapped file), `rows` the row of
    `data` each output row reads (int64; -1: a row of zeros)."""

    source: str
    data: torch.Tensor
    rows: torch.Tensor


class Tiled(NamedTuple):
    """A matrix laid out for the kernels (`pack`): `tiles` uint8, `segments` int64 [n, 5] (first
    row, rows, byte offset, kind, wide: a run of rows in one format each)."""

    tiles: torch.Tensor
    segments: torch.Tensor
    rows: int
    cols: int

    @property
    def nbytes(self) -> int:
        return self.tiles.numel()

    def kinds(self) -> list[str]:
        return [CODES[k] for k in self.segments[:, 3].tolist()]


def pack(parts: list[Part], cols: int) -> Tiled:
    """The parts' rows, in order, as one matrix of `cols` columns in the kernels' tiles (a segment
    per run of parts in one format), laid out once from the file's own blocks: no value is
    dequantized or rounded."""
    load()
    tiles, segments = torch.ops.radixlm.pack([p.data for p in parts], [p.rows for p in parts],
                                             [SOURCES[p.source] for p in parts], cols)
    return Tiled(tiles, segments, sum(p.rows.numel() for p in parts), cols)


def dequantize_rows(w: Tiled, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (int64, any shape) of the tiled matrix as float32 [*ids.shape, cols]: scale *
    code + zero (a multiply, then an add), read from those rows' tiles alone (embedding lookups)."""
    return torch.ops.radixlm.dequantize_rows(w.tiles, w.segments, ids, w.rows, w.cols)


def quant_matmul(x: torch.Tensor, w: Tiled, isa: int = -1) -> torch.Tensor:
    """x W^T for x [m, k] float32 and W the tiled codes (`pack`). Returns float32 [m, n].

    x is quantized per block of 32 columns to int16 (x ~= d q, d = max|x| / 32767, round half
    to even: finer than bf16, so the weights' codes are the only coarse factor); each output is
    summed over the blocks in order in one fp32 accumulator, each block's term its exact integer
    dot <codes_b, q_b> times (scale_b d_b) (plus zero_b d_b sum(q_b) in one fused multiply-add,
    where the format has zero points): one order per output whatever m, so results are batch
    invariant, and every ISA path is bitwise the portable one."""
    return torch.ops.radixlm.quant_matmul(x, w.tiles, w.segments, w.rows, isa)


def quantize_activations(x: torch.Tensor, isa: int = -1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [m, k] float32 -> (q int16 [m, k], d [m, k / 32], d * sum(q) [m, k / 32]), as
    quant_matmul quantizes its input."""
    return torch.ops.radixlm.quantize_activations(x, isa)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             isa: int = -1) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension of x [m, d] float32. With
    `residual` ([m, d], updated in place): residual += x first, and the sum is normalized."""
    return torch.ops.radixlm.rms_norm(x, weight, eps, residual, isa)


def silu_mul(gate_up: torch.Tensor, isa: int = -1) -> torch.Tensor:
    """silu(gate) * up for gate_up [m, 2i] float32 (gate the first i columns): [m, i]."""
    return torch.ops.radixlm.silu_mul(gate_up, isa)


def rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor,
               k_pool: torch.Tensor, v_pool: torch.Tensor, out_slots: torch.Tensor, heads: int, kv_heads: int,
               isa: int = -1) -> None:
    """Rotary on the q and k heads of qkv [t, (heads + 2 kv_heads) d] float32, in place ("rotate
    half": x_i cos_i - x_{i+d/2} sin_i, x_{i+d/2} cos_{i+d/2} + x_i sin_{i+d/2}, with cos2 / sin2
    [positions, d] the full-width tables at `positions` [t] int64), then each token's k and v
    written to the head-major pools at `out_slots` [t] int64, in the pools' type: float32,
    float16 (saturated at +-65504) or bfloat16 [kv_heads, slots, d], rounded to nearest even; or
    int8 [kv_heads, slots, d + 4], each row d codes and its fp32 scale's 4 bytes (symmetric, max|x|
    / 127). `reference.encode_kv` is the same conversion in torch, bit for bit."""
    torch.ops.radixlm.rope_store(qkv, positions, cos2, sin2, k_pool, v_pool, out_slots, heads, kv_heads, isa)


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                     rows: torch.Tensor, seq_lens: torch.Tensor, scale: float, isa: int = -1, window: int = 0,
                     softcap: float = 0.0, sinks: torch.Tensor | None = None, exact: bool = True) -> torch.Tensor:
    """Attention of decode row r (q [n, heads d] float32, rows contiguous but may be strided, as
    qkv's first columns are; already rotated) over its keys in the pools (any type rope_store
    writes; each element converted to fp32 as it is read, an int8 row's scale applied to its
    score and its weight), read in place at table[rows[r], :seq_lens[r]] (int64): [n, heads d]. Each (row, query head)
    is one task over its KV head's keys, summed in key order (scores, max, exp and their sum,
    then the weighted values), so a row's output is the same whatever the batch. `window` > 0:
    each row's last `window` keys only; `softcap` > 0: scores capped to softcap * tanh(s / softcap);
    `sinks` [heads] float32: one more logit in each head's softmax, with no value (gpt-oss).
    `exact` False: rows on one cached prompt (their first 64+ keys the same slots) may be attended
    together by extend_attention's blocked kernel, the prompt's keys packed once a block for all
    of them: faster, but a row's bits then depend on which rows share its set (True, for
    --deterministic: every row bitwise itself alone)."""
    return torch.ops.radixlm.decode_attention(q, k_pool, v_pool, table, rows, seq_lens, scale, isa, window, softcap,
                                              sinks, exact)


def extend_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                     rows: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor, scale: float,
                     out: torch.Tensor | None = None, isa: int = -1, window: int = 0, softcap: float = 0.0,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the extend rows' new tokens (prefill chunks; K/V already in the pools): row r's
    extend_lens[r] tokens are q's next rows (q [tokens, heads d] float32, rows contiguous but may be
    strided; already rotated), token t at position prefix_lens[r] + t, and it attends the keys at
    table[rows[r], :prefix_lens[r] + t + 1] (int64), read in place from pools of any type
    rope_store writes (converted as decode_attention's). Into `out` (the same shape,
    rows may be strided; a new tensor if None), returned. `window`, `softcap`, `sinks`: as
    decode_attention's. The AVX2 and AVX-512 paths take a row's tokens and one KV head's query
    heads together, 64 keys a block, each score summed over d in order and the softmax folded
    block by block (online); the portable path is decode_attention's kernel once per token, the
    keys in order. They agree to rounding, not bitwise (the block's rescaling), so
    --deterministic sends every token through decode_attention instead."""
    out = torch.empty(q.shape, dtype=q.dtype) if out is None else out
    torch.ops.radixlm.extend_attention(q, k_pool, v_pool, table, rows, prefix_lens, extend_lens, scale, out, isa, window,
                                       softcap, sinks)
    return out


__all__ = ["BLOCK", "BLOCK_SHAPES", "CODES", "ISA_NAMES", "NativeBuildError", "Part", "SOURCES", "TILE_ROWS", "Tiled",
           "best_isa", "cpu_flags", "decode_attention", "dequantize_rows", "extend_attention", "isa_name", "load", "pack",
           "quant_matmul", "quantize_activations", "rms_norm", "rope_store", "silu_mul"]
