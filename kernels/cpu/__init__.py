"""radixlm's native CPU kernels: quantized matmuls on a GGUF file's own codes, and fused ops.

C++ in `csrc/`, registered as torch ops (`torch.ops.radixlm.*`), built on first use by `build.py`
and cached. Every op takes `isa` (-1: the best this CPU runs, chosen once from cpuid; 0: the
portable path; 1: AVX2+FMA+F16C) so tests can run each path against the portable one.
`reference.py` holds the torch reference of each op.

    from radixlm.kernels import cpu
    cpu.load()                      # builds once per machine; raises cpu.NativeBuildError
    y = cpu.quant_matmul(x, codes, scale, zero, bits=4)
"""

from __future__ import annotations

import torch

from radixlm.kernels.cpu.build import NativeBuildError, cpu_flags, load

ISA_NAMES = ("portable", "avx2")
BLOCK = 32  # columns per scale: the weights' groups and the activations' blocks


def best_isa() -> int:
    """The best path this CPU runs (an index into ISA_NAMES)."""
    load()
    return int(torch.ops.radixlm.best_isa())


def isa_name(isa: int = -1) -> str:
    return ISA_NAMES[best_isa() if isa < 0 else isa]


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[n, k] integer codes in column order (0..15 for 4 bits, int8 for 8) in the kernels' layout:
    8-bit ones as they are; 4-bit ones two a byte, in each group of 32 byte j holding column j
    (low nibble) and column j + 16 (high), GGUF's own order."""
    if bits == 8:
        return codes.to(torch.int8).contiguous()
    n = codes.shape[0]
    g = codes.to(torch.uint8).view(n, -1, BLOCK)
    return (g[..., :16] | (g[..., 16:] << 4)).view(n, -1).contiguous()


def unpack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of pack_codes: [n, k] int32 codes in column order."""
    if bits == 8:
        return codes.view(torch.int8).to(torch.int32)
    n = codes.shape[0]
    g = codes.view(n, -1, BLOCK // 2).to(torch.int32)
    return torch.cat([g & 15, g >> 4], -1).view(n, -1)


def quant_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
                 isa: int = -1) -> torch.Tensor:
    """x W^T for x [m, k] float32 and W [n, k] given as codes in groups of 32 columns:
    w = scale * code + zero, with scale and zero [n, k / 32] (float32 or float16; zero may be
    None) and codes uint8 [n, k / 2] (4 bits, 0..15, byte j of a group holding column j low and
    j + 16 high: GGUF's order) or int8 [n, k] (8 bits). Returns float32 [m, n].

    x is quantized per block of 32 columns to int16 (x ~= d q, d = max|x| / 32767, round half
    to even: finer than bf16, so the weights' codes are the only coarse factor); each output is sum_b (scale_b d_b <codes_b, q_b> + zero_b d_b sum(q_b)) with the
    integer dots exact, the blocks accumulated in order in 8 lanes, the lanes summed in a fixed
    tree: one order per output whatever m, so results are batch invariant, and every ISA path
    is bitwise the portable one."""
    return torch.ops.radixlm.quant_matmul(x, codes, scale, zero, bits, isa)


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
    written to the head-major pools [kv_heads, slots, d] at `out_slots` [t] int64."""
    torch.ops.radixlm.rope_store(qkv, positions, cos2, sin2, k_pool, v_pool, out_slots, heads, kv_heads, isa)


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                     rows: torch.Tensor, seq_lens: torch.Tensor, scale: float, isa: int = -1) -> torch.Tensor:
    """Attention of decode row r (q [n, heads d] float32, rows contiguous but may be strided, as
    qkv's first columns are; already rotated) over its keys in the pools [kv_heads, slots, d],
    read in place at table[rows[r], :seq_lens[r]] (int64): [n, heads d]. Each (row, query head)
    is one task over its KV head's keys, summed in key order (scores, max, exp and their sum,
    then the weighted values), so a row's output is the same whatever the batch."""
    return torch.ops.radixlm.decode_attention(q, k_pool, v_pool, table, rows, seq_lens, scale, isa)


__all__ = ["BLOCK", "ISA_NAMES", "NativeBuildError", "best_isa", "cpu_flags", "decode_attention", "isa_name", "load", "pack_codes", "quant_matmul",
           "quantize_activations", "rms_norm", "rope_store", "silu_mul", "unpack_codes"]
