"""Torch references of the native ops (what each computes, written plainly): the tests' oracle.
And weights for them: random blocks of every format the quantized matmul serves, with their
values read independently (gguf's own dequantization; numpy for the two fp32-scaled formats of
codes made at load)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

K_FORMATS = ("Q4_K", "Q5_K", "Q6_K")  # blocks of 256 columns

BLOCK = 32


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, k = x.shape
    blocks = x.view(m, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1)
    inv = torch.full_like(amax, 32767) / amax  # (a tensor's division: `32767 / amax` is 32767 * (1 / amax) in torch)
    finite = inv.isfinite()  # not where max|x| is 0 or below ~1e-34: a block of zeros (csrc/common.h block_scale)
    d = torch.where(finite, amax / 32767, 0.0)
    inv = torch.where(finite, inv, 0.0)
    q = torch.round(blocks * inv[..., None])  # round half to even, as the kernels
    return q.to(torch.int16).view(m, k), d, d * q.sum(-1)


def quant_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """In float64: the weights' served values `w` [n, k] (a file's blocks dequantized by gguf's own
    code, or codes times scales plus zero points) times the quantized activations."""
    q, d, _ = quantize_activations(x)
    m, k = x.shape
    xq = (q.double().view(m, k // BLOCK, BLOCK) * d.double()[..., None]).view(m, k)
    return (xq @ w.double().T).float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


HALF_MAX = 65504.0


def encode_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows x [..., d] float32 as a KV pool of `dtype` stores them (csrc/kv_types.h): float16
    saturated at +-65504 then rounded to nearest even, bfloat16 rounded to nearest even; int8 as
    d codes round(x * (127 / max|x|)) and then the row's scale max|x| / 127 in 4 bytes: [..., d + 4]
    (a row whose 127 / max|x| is not finite, max|x| 0 or below ~4e-37, is zeros: codes and scale)."""
    if dtype == torch.int8:
        amax = x.abs().amax(-1, keepdim=True)
        inv = torch.full_like(amax, 127) / amax
        finite = inv.isfinite()
        codes = torch.round(x * torch.where(finite, inv, 0.0)).to(torch.int8)
        return torch.cat([codes, torch.where(finite, amax / 127, 0.0).contiguous().view(torch.int8)], -1)
    if dtype == torch.float16:
        x = x.clamp(-HALF_MAX, HALF_MAX)
    return x.to(dtype)


def decode_kv(rows: torch.Tensor) -> torch.Tensor:
    """A pool's rows [..., row] as float32 [..., d]: an int8 row's codes times its scale."""
    if rows.dtype == torch.int8:
        d = rows.shape[-1] - 4
        return rows[..., :d].float() * rows[..., d:].contiguous().view(torch.float32)
    return rows.float()


def rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor,
               k_pool: torch.Tensor, v_pool: torch.Tensor, out_slots: torch.Tensor, heads: int, kv_heads: int) -> None:
    d = cos2.shape[1]
    qk = qkv[:, : (heads + kv_heads) * d].view(-1, heads + kv_heads, d)
    cos, sin = cos2[positions][:, None], sin2[positions][:, None]
    x1, x2 = qk.chunk(2, -1)
    qk.copy_(qk * cos + torch.cat([-x2, x1], -1) * sin)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(-1, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(-1, kv_heads, d)
    k_pool[:, out_slots] = encode_kv(k.transpose(0, 1), k_pool.dtype)
    v_pool[:, out_slots] = encode_kv(v.transpose(0, 1), v_pool.dtype)


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                     rows: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int = 0,
                     softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    d = decode_kv(k_pool[:, :1]).shape[2]
    out = []
    for r in range(rows.shape[0]):
        end = int(seq_lens[r])
        slots = table[rows[r], max(0, end - window) if window else 0 : end]
        keys, values = decode_kv(k_pool[:, slots]), decode_kv(v_pool[:, slots])  # [kv_heads, len, d]
        group = q.shape[1] // d // k_pool.shape[0]
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)  # [heads, len, d]
        scores = torch.einsum("hd,hkd->hk", q[r].view(-1, d), keys) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if sinks is not None:  # the sink's column joins the softmax, then is dropped
            scores = torch.cat((scores, sinks[:, None]), dim=1)
        probs = torch.softmax(scores, -1)[:, : keys.shape[1]]
        out.append(torch.einsum("hk,hkd->hd", probs, values).reshape(-1))
    return torch.stack(out)


def extend_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                     rows: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor, scale: float,
                     window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Each new token as a decode row over the keys up to its own position."""
    token_rows = torch.repeat_interleave(rows, extend_lens)
    within = torch.cat([torch.arange(int(n)) for n in extend_lens])
    lens = torch.repeat_interleave(prefix_lens, extend_lens) + within + 1
    return decode_attention(q, k_pool, v_pool, table, token_rows, lens, scale, window, softcap, sinks)


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, bytes]: random codes (every bit pattern is a valid block) with scales and
    zero points of a trained model's size, so products stay finite and comparable."""
    from radixlm.kernels.cpu import BLOCK_SHAPES

    block_cols, size = BLOCK_SHAPES[kind]
    blocks = cols // block_cols
    raw = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)

    def put(at: int, low: float, high: float, dtype: type) -> None:
        value = rng.uniform(low, high, (rows, blocks)).astype(dtype)
        raw[:, :, at : at + value.itemsize] = value.view(np.uint8).reshape(rows, blocks, value.itemsize)

    if kind in ("Q4_K", "Q5_K"):
        put(0, 1e-4, 2e-3, np.float16)  # d
        put(2, 1e-4, 2e-3, np.float16)  # dmin
    elif kind == "Q6_K":
        put(208, 1e-4, 2e-3, np.float16)
    elif kind == "MXFP4":
        raw[:, :, 0] = rng.integers(118, 126, (rows, blocks))  # 2^-10 .. 2^-3
    elif kind.endswith("_WIDE"):
        put(0, 1e-3, 1e-2, np.float32)
        if kind == "Q4_1_WIDE":
            put(4, -0.08, 0.0, np.float32)
    else:
        put(0, 1e-3, 1e-2, np.float16)
        if kind == "Q4_1":
            put(2, -0.08, 0.0, np.float16)
    return raw.reshape(rows, -1)


def dequantize_blocks(kind: str, raw: np.ndarray, cols: int) -> np.ndarray:
    """The blocks' values, float32 [rows, cols]."""
    rows = raw.shape[0]
    if kind == "Q4_1_WIDE":
        b = raw.reshape(rows, -1, 24)
        d, m = (np.ascontiguousarray(b[:, :, at : at + 4]).view(np.float32) for at in (0, 4))
        q = np.concatenate([b[:, :, 8:] & 15, b[:, :, 8:] >> 4], -1).astype(np.float32)
        return (q * d + m).reshape(rows, cols)
    if kind == "Q8_0_WIDE":
        b = raw.reshape(rows, -1, 36)
        d = np.ascontiguousarray(b[:, :, :4]).view(np.float32)
        return (b[:, :, 4:].view(np.int8).astype(np.float32) * d).reshape(rows, cols)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    return gguf_dequantize(raw, GGMLQuantizationType[kind]).reshape(rows, cols)
