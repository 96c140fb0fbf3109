"""radixlm's native CPU kernels: quantized matmuls on a GGUF file's own codes, and fused ops.

C++ in `csrc/`, registered as torch ops (`torch.ops.radixlm.*`), built on first use by `build.py`
and cached. Every op takes `isa` (-1: the best this CPU runs, chosen once from cpuid; 0: the
portable path; 1: AVX2+FMA+F16C; 2: AVX-512 F/BW/VL/VNNI for the matmuls) so tests can run each path against the portable one.
`reference.py` holds the torch reference of each op.

    from radixlm.kernels import cpu
    cpu.load()                      # builds once per machine; raises cpu.NativeBuildError
    w = cpu.tile(codes, scale, zero, bits=4)  # once, at load: the kernels' layout
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


TILE_ROWS = 8  # weight rows per tile (csrc/common.h)


class Tiled(NamedTuple):
    """A matrix's codes, scales and zero points laid out for the kernels (`tile`): `tiles` is uint8
    [ceil(rows / 8), cols / 32, tile bytes], the rest its format."""

    tiles: torch.Tensor
    rows: int
    cols: int
    bits: int  # 4: codes 0..15; 8: int8
    group: int  # columns per scale: 32, or 16 (8-bit codes without zero points)
    half: bool  # scales and zero points in fp16 (else fp32)
    zero: bool  # zero points present

    @property
    def format(self) -> list[int]:
        """(rows, bits, group, half, zero): what the ops take beside the tiles."""
        return [self.rows, self.bits, self.group, int(self.half), int(self.zero)]

    @property
    def nbytes(self) -> int:
        return self.tiles.numel()


def tile(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int) -> Tiled:
    """w = scale * code + zero, codes [n, k] integers in column order (0..15 for 4 bits, -128..127
    for 8), scale and zero [n, k / group] fp16 or fp32 (zero may be None), laid out for the kernels
    once: rows in groups of 8 (the last padded with zeros), each group's blocks of 32 columns in
    order, one tile each holding the 8 rows' scales, zero points and codes (csrc/common.h)."""
    n, k = codes.shape
    group = k // scale.shape[1]
    if bits not in (4, 8) or group not in (16, BLOCK) or (group == 16 and (bits != 8 or zero is not None)):
        raise ValueError(f"the kernels take 4- or 8-bit codes in groups of {BLOCK} (16: 8-bit, no zero points), "
                         f"not {bits}-bit in groups of {group}")
    half = scale.dtype == torch.float16
    groups, nb, pad = -(-n // TILE_ROWS), k // BLOCK, -n % TILE_ROWS

    def rows_padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t

    if bits == 4:  # chunk j, word i (row i // 2, column 2 (4j + k) + i % 2 in bits 4k..4k+3): a word's
        # low byte holds nibbles k = 0, 1 and its high byte k = 2, 3 (made in bytes: a quarter of the
        # memory traffic of 32-bit words)
        c = rows_padded(codes.to(torch.uint8))
        c = c.view(groups, TILE_ROWS, nb, 4, 4, 2).permute(0, 2, 3, 1, 5, 4).reshape(groups, nb, 4, 16, 2, 2)
        code_bytes = (c[..., 0] | (c[..., 1] << 4)).view(groups, nb, -1)
    else:  # chunk j, word i: low byte column 4j + i % 2, high byte 4j + 2 + i % 2 of row i // 2
        c = rows_padded(codes.to(torch.int8)).view(groups, TILE_ROWS, nb, 8, 2, 2).permute(0, 2, 3, 1, 5, 4)
        code_bytes = c.reshape(groups, nb, -1).view(torch.uint8)
    dtype = torch.float16 if half else torch.float32

    def per_tile(t: torch.Tensor) -> torch.Tensor:  # [n, blocks * parts] -> [groups, blocks, parts * 8] bytes
        parts = t.shape[1] // nb
        t = rows_padded(t.to(dtype)).view(groups, TILE_ROWS, nb, parts).permute(0, 2, 3, 1)
        return t.contiguous().view(torch.uint8).view(groups, nb, -1)

    pieces = [per_tile(scale)] + ([per_tile(zero)] if zero is not None else []) + [code_bytes]
    return Tiled(torch.cat(pieces, -1).contiguous(), n, k, bits, group, half, zero is not None)


def untile(t: Tiled, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The inverse of `tile` (for `rows` only, where given): codes [r, k] int32 in column order,
    scale and zero [r, k / group] in the tiles' dtype (zero None where there are none)."""
    ids = torch.arange(t.rows) if rows is None else rows.reshape(-1)
    tiles = t.tiles[ids // TILE_ROWS]  # [r, blocks, tile bytes]: each row's group
    r, nb = ids.shape[0], t.cols // BLOCK
    dtype, size = (torch.float16, 2) if t.half else (torch.float32, 4)
    parts = BLOCK // t.group
    scale_bytes, zero_bytes = TILE_ROWS * parts * size, TILE_ROWS * size if t.zero else 0
    within = (ids % TILE_ROWS)[:, None, None]

    def values(first: int, count: int) -> torch.Tensor:
        v = tiles[:, :, first : first + count * TILE_ROWS * size].contiguous().view(dtype).view(r, nb, count, TILE_ROWS)
        return v.gather(3, within[..., None].expand(r, nb, count, 1)).view(r, nb * count)

    scale = values(0, parts)
    zero = values(scale_bytes, 1) if t.zero else None
    chunks = tiles[:, :, scale_bytes + zero_bytes :].to(torch.int32)
    if t.bits == 4:
        words = (chunks[..., 0::2] | (chunks[..., 1::2] << 8)).view(r, nb, 4, TILE_ROWS, 2)  # [j, row, e]
        words = words.gather(3, within[..., None, None].expand(r, nb, 4, 1, 2)).squeeze(3)  # [r, nb, j, e]
        nibbles = (words[..., None] >> torch.tensor([0, 4, 8, 12])) & 15  # [r, nb, j, e, k]
        codes = nibbles.permute(0, 1, 2, 4, 3).reshape(r, -1)  # column 8j + 2k + e
    else:
        b = chunks.to(torch.uint8).view(torch.int8).to(torch.int32).view(r, nb, 8, TILE_ROWS, 2, 2)  # [j, row, e, h]
        b = b.gather(3, within[..., None, None, None].expand(r, nb, 8, 1, 2, 2)).squeeze(3)  # [r, nb, j, e, h]
        codes = b.permute(0, 1, 2, 4, 3).reshape(r, -1)  # column 4j + 2h + e
    return codes, scale, zero


def dequantize_rows(w: Tiled, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (int64, any shape) of the tiled matrix as float32 [*ids.shape, cols]: scale *
    code + zero (a multiply, then an add), read from those rows' tiles alone (embedding lookups)."""
    return torch.ops.radixlm.dequantize_rows(w.tiles, ids, *w.format, w.cols)


def quant_matmul(x: torch.Tensor, w: Tiled, isa: int = -1) -> torch.Tensor:
    """x W^T for x [m, k] float32 and W the tiled codes (`tile`). Returns float32 [m, n].

    x is quantized per block of 32 columns to int16 (x ~= d q, d = max|x| / 32767, round half
    to even: finer than bf16, so the weights' codes are the only coarse factor); each output is
    sum_b (scale_b d_b <codes_b, q_b>) + sum_b (zero_b d_b sum(q_b)), the integer dots exact,
    each sum taken over the blocks in order in fp32: one order per output whatever m, so results
    are batch invariant, and every ISA path is bitwise the portable one."""
    return torch.ops.radixlm.quant_matmul(x, w.tiles, *w.format, isa)


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


__all__ = ["BLOCK", "ISA_NAMES", "NativeBuildError", "TILE_ROWS", "Tiled", "best_isa", "cpu_flags", "decode_attention",
           "dequantize_rows", "extend_attention", "isa_name", "load", "quant_matmul", "quantize_activations", "rms_norm",
           "rope_store", "silu_mul", "tile", "untile"]
