"""Stream a model's weights under Hugging Face tensor names (`model_config` finds the model and
reads its config).

Two sources: a HF checkpoint directory (safetensors shards) and a GGUF file (dequantized to
float32 with the `gguf` package, or kept as the file's own codes for quantized serving).
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any, Iterator, NamedTuple, Sequence

import numpy as np
import torch

from radixlm.runtime.model_config import ModelConfig, ModelSource, gguf_reader
from radixlm.runtime.worker.quant import Blocks

class Weight:
    """A checkpoint tensor that is read only as far as asked: a tensor-parallel rank takes its rows
    or columns (from safetensors only those bytes leave the file, from GGUF only those quant blocks
    are dequantized), everyone else the whole.

    `format` names how the file stores it (a GGUF type such as "Q4_1", or "dense"); for the GGUF
    block formats with a scale and zero point per group, `row_blocks` / `col_blocks` read the same
    parts as the file's own codes (quant.Blocks), for serving them without requantizing."""

    def __init__(self, source: Any, shape: Sequence[int], dtype: torch.dtype | None = None) -> None:
        self._source, self.shape, self.dtype = source, tuple(shape), dtype  # source: a tensor or a safetensors slice

    @property
    def format(self) -> str:
        return getattr(self._source, "format", "dense")

    def to(self, dtype: torch.dtype) -> Weight:
        return Weight(self._source, self.shape, dtype)

    def rows(self, start: int, count: int) -> torch.Tensor:
        return self._read(self._source[start : start + count])

    def cols(self, start: int, end: int) -> torch.Tensor:
        return self._read(self._source[:, start:end])

    def row_blocks(self, start: int, count: int) -> Blocks | None:
        return self._blocks(slice(start, start + count), slice(None))

    def col_blocks(self, start: int, end: int) -> Blocks | None:
        return self._blocks(slice(None), slice(start, end))

    def _blocks(self, rows: slice, cols: slice) -> Blocks | None:
        return self._source.blocks(rows, cols) if getattr(self._source, "has_blocks", False) else None

    def full(self) -> torch.Tensor:
        return self._read(self._source[:])

    def rows_from(self, start: int) -> Weight:
        """The rows from `start` on, as a Weight of their own (one block of a checkpoint tensor
        that fuses several, as Phi-3's qkv_proj)."""
        return Weight(_RowsFrom(self._source, start), (self.shape[0] - start, *self.shape[1:]), self.dtype)

    def _read(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.dtype is None else t.to(self.dtype)


class _RowsFrom:
    """A checkpoint tensor's rows from `start` on, indexed and read as the tensor itself is."""

    def __init__(self, source: Any, start: int) -> None:
        self._source, self._start = source, start
        self.format = getattr(source, "format", "dense")
        self.has_blocks = getattr(source, "has_blocks", False)

    def _rows(self, rows: slice) -> slice:
        return slice(self._start + (rows.start or 0), None if rows.stop is None else self._start + rows.stop)

    def __getitem__(self, key: slice | tuple[slice, slice]) -> Any:
        if isinstance(key, tuple):
            return self._source[(self._rows(key[0]), *key[1:])]
        return self._source[self._rows(key)]

    def blocks(self, rows: slice, cols: slice) -> Blocks | None:
        return self._source.blocks(self._rows(rows), cols)


def iter_weights(src: ModelSource, config: ModelConfig) -> Iterator[tuple[str, Weight]]:
    """Yield (HF parameter name, Weight) pairs; dtype is whatever the file holds (GGUF: float32)."""
    if src.is_gguf:
        for name, tensor in _iter_gguf(src.path, config):
            yield name, Weight(tensor, tensor.shape)  # dequantized when a rank reads its part
    else:
        yield from _iter_safetensors(src.path)


def _iter_safetensors(path: str) -> Iterator[tuple[str, Weight]]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path!r}")
    stacked: dict[str, str] = {}  # gpt-oss's stacked expert tensors -> their file, read once all are found
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if _STACKED.fullmatch(name):
                    stacked[name] = file
                    continue
                part = f.get_slice(name)
                yield name, Weight(part, part.get_shape())
    yield from _split_experts(stacked)


# gpt-oss's experts as HF keeps them: each projection of every expert in one tensor, laid out for
# x @ W ([experts, in, out], gate and up interleaved along out) with a bias beside it, or in
# OpenAI's MXFP4 (`_blocks` [experts, out, in / 32, 16] bytes, two E2M1 values a byte, low nibble
# first; `_scales` [experts, out, in / 32] E8M0 exponents)
_STACKED = re.compile(r"(.+\.mlp\.experts)\.(gate_up_proj|down_proj)(|_bias|_blocks|_scales)")


def _split_experts(stacked: dict[str, str]) -> Iterator[tuple[str, Weight]]:
    """Each expert's matrices and biases of gpt-oss's stacked tensors, under our per-expert names
    (gate and up de-interleaved into our fused gate_up_proj, gate first)."""
    from safetensors import safe_open

    def read(name: str) -> torch.Tensor:
        with safe_open(stacked[name], framework="pt") as f:
            return f.get_tensor(name)

    for name in sorted(stacked):
        prefix, proj, kind = _STACKED.fullmatch(name).groups()
        if kind == "_scales":
            continue
        t = read(name)
        gate_up = proj == "gate_up_proj"
        for e in range(t.shape[0]):
            base = f"{prefix}.{e}.{proj}"
            if kind == "_bias":
                b = t[e]
                yield f"{base}.bias", Weight(torch.cat((b[0::2], b[1::2])) if gate_up else b, b.shape)
            elif kind == "_blocks":
                exps = read(f"{prefix}.{proj}_scales")[e]
                m = MXFP4Matrix(t[e].numpy(), exps.numpy(), interleaved=gate_up)
                yield f"{base}.weight", Weight(m, m.shape)
            else:
                w = t[e].t()  # [out, in]
                w = torch.cat((w[0::2], w[1::2])) if gate_up else w.contiguous()
                yield f"{base}.weight", Weight(w, w.shape)


class MXFP4Matrix:
    """One expert's matrix in OpenAI's MXFP4 (blocks [out, in / 32, 16] bytes, exponents
    [out, in / 32]), read as a GGUF tensor is: dequantized as far as indexed, or as the 8-bit
    codes MXFP4_TWICE[q] with scale 2^(e - 128) (exact). `interleaved`: its rows alternate gate
    and up (gpt-oss's gate_up_proj), reordered gate rows first."""

    format = "MXFP4"
    has_blocks = True

    def __init__(self, blocks: np.ndarray, exponents: np.ndarray, interleaved: bool = False) -> None:
        rows = blocks.shape[0]
        pairs = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(rows, -1)  # low nibble first
        self._codes, self._exps = MXFP4_TWICE[pairs], exponents
        if interleaved:
            order = np.concatenate([np.arange(0, rows, 2), np.arange(1, rows, 2)])
            self._codes, self._exps = self._codes[order], self._exps[order]
        self.shape = self._codes.shape

    def blocks(self, rows: slice, cols: slice) -> Blocks | None:
        c0, c1, _ = cols.indices(self.shape[1])
        if c0 % 32 or c1 % 32:
            return None
        scale = mxfp4_scale(self._exps[rows, c0 // 32 : c1 // 32])
        return Blocks(torch.from_numpy(np.ascontiguousarray(self._codes[rows, c0:c1])), torch.from_numpy(scale),
                      torch.zeros(scale.shape), 8, 32)

    def __getitem__(self, key: slice | tuple[slice, slice]) -> torch.Tensor:
        rows, cols = key if isinstance(key, tuple) else (key, slice(None))
        b = self.blocks(rows, slice(None))
        return b.dequantize()[:, cols].contiguous()


# ---- GGUF -------------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",  # gpt-oss's
    "attn_sinks.weight": "self_attn.sinks",  # gpt-oss's per-head sink logits
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",  # OLMo 2's norms after each sublayer
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",  # a mixture of experts' router
    "ffn_gate_inp.bias": "mlp.gate.bias",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",  # Qwen2-MoE's shared expert, and its gate
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # Phi-3's q, k and v in one tensor, as ours
}
# where a family's file means another HF tensor by the same name: a Gemma's ffn_norm is the norm
# before the MLP in a layer that also normalizes each sublayer's output (a Llama's is its
# post_attention_layernorm); Phi-3's ffn_up holds gate and up in one tensor, as ours
_GGUF_FAMILY_NAMES = {
    "Gemma2ForCausalLM": {"ffn_norm.weight": "pre_feedforward_layernorm.weight"},
    "Gemma3ForCausalLM": {"ffn_norm.weight": "pre_feedforward_layernorm.weight"},
    "Phi3ForCausalLM": {"ffn_up.weight": "mlp.gate_up_proj.weight"},
}
# a mixture of experts' matrices, every expert's stacked in one tensor: [experts, rows, columns]
# (and gpt-oss's biases: [experts, rows])
_GGUF_EXPERT_NAMES = {"ffn_gate_exps.weight": "gate_proj.weight", "ffn_up_exps.weight": "up_proj.weight",
                      "ffn_down_exps.weight": "down_proj.weight", "ffn_gate_exps.bias": "gate_proj.bias",
                      "ffn_up_exps.bias": "up_proj.bias", "ffn_down_exps.bias": "down_proj.bias"}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def gguf_to_hf_name(name: str, architecture: str = "LlamaForCausalLM") -> str | None:
    """The HF name of a GGUF tensor of a model of `architecture` (HF's name for it)."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    m = _BLOCK.fullmatch(name)
    if m is None:
        return None  # e.g. rope_freqs: derived from the config instead
    hf = _GGUF_FAMILY_NAMES.get(architecture, {}).get(m.group(2)) or _GGUF_LAYER_NAMES.get(m.group(2))
    return f"model.layers.{m.group(1)}.{hf}" if hf else None


# families whose q/k rows llama.cpp's converter permutes (its LlamaModel and the classes built on it)
PERMUTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "GraniteForCausalLM", "SmolLM3ForCausalLM",
                          "MixtralForCausalLM")


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's conversion, which interleaves the two rotary halves of each q/k head."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _iter_gguf(path: str, config: ModelConfig) -> Iterator[tuple[str, GGUFTensor]]:
    reader = gguf_reader(path)
    permuted = config.architecture in PERMUTED_ARCHITECTURES
    for t in reader.tensors:
        m = _BLOCK.fullmatch(t.name)
        if m and m.group(2) in _GGUF_EXPERT_NAMES:  # each expert's slice, under HF's per-expert names
            for e in range(int(t.shape[-1])):
                part = _ExpertPart(t.data[e], t.tensor_type, t.shape[:-1])
                yield f"model.layers.{m.group(1)}.mlp.experts.{e}.{_GGUF_EXPERT_NAMES[m.group(2)]}", GGUFTensor(part)
            continue
        name = gguf_to_hf_name(t.name, config.architecture)
        if name is None:
            continue
        heads = None
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = config.num_heads
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = config.num_kv_heads
        yield name, GGUFTensor(t, heads)


class _ExpertPart(NamedTuple):
    """One expert's matrix of a stacked GGUF tensor, shaped as a reader's tensor (shape in ggml's
    order, columns first)."""

    data: np.ndarray
    tensor_type: Any
    shape: Any


class GGUFTensor:
    """A GGUF tensor dequantized to float32 only as far as it is indexed: `[a:b]` reads rows a..b,
    `[:, a:b]` the quant blocks that cover columns a..b of each row, so a tensor-parallel rank
    dequantizes its own slice alone. `heads`: undo llama.cpp's q/k row permutation, which
    stays within each head (whole heads are read, then trimmed to the rows asked for)."""

    def __init__(self, tensor: Any, heads: int | None = None) -> None:
        from gguf.constants import GGML_QUANT_SIZES

        self._t = tensor
        self.format = tensor.tensor_type.name
        self.shape = tuple(int(d) for d in reversed(tensor.shape))
        self._head_rows = self.shape[0] // heads if heads else 1
        self._block = GGML_QUANT_SIZES[tensor.tensor_type][0]  # columns per quant block (1: unquantized)
        self.has_blocks = self.format in _BLOCK_LAYOUTS and len(self.shape) == 2  # codes servable as they are

    def __getitem__(self, key: slice | tuple[slice, slice]) -> torch.Tensor:
        from gguf.quants import dequantize

        rows, cols = key if isinstance(key, tuple) else (key, slice(None))
        if len(self.shape) == 1:  # a norm or a bias: small, and its quant blocks (if any) span rows
            r0, r1, _ = rows.indices(self.shape[0])
            w = dequantize(np.asarray(self._t.data), self._t.tensor_type)[r0:r1]
        else:
            w = self._read(rows, cols, lambda data: dequantize(data, self._t.tensor_type).reshape(len(data), -1))
        # a copy: unquantized data are read-only views of the memory-mapped file
        return torch.from_numpy(np.array(w, dtype=np.float32, copy=True))

    def blocks(self, rows: slice, cols: slice) -> Blocks | None:
        """The file's own codes, scales and zero points for this part (None if its columns do not
        start and end on block edges)."""
        c0, c1, _ = cols.indices(self.shape[1])
        if c0 % self._block or (c1 % self._block and c1 != self.shape[1]):
            return None
        layout = _BLOCK_LAYOUTS[self.format]
        codes = self._read(rows, cols, layout.codes)
        a, b = self._whole_heads(rows)
        groups = slice(c0 // layout.group, -(-c1 // layout.group))
        scale, zero = (self._trim(part[:, groups], rows) for part in layout.scale_zero(self._t.data[a:b]))
        return Blocks(*(torch.from_numpy(np.ascontiguousarray(t)) for t in (codes, scale, zero)), layout.bits,
                      layout.group)

    def _read(self, rows: slice, cols: slice, decode: Any) -> np.ndarray:
        """Rows `rows`, columns `cols` of what `decode` makes of the quant blocks that cover them."""
        a, b = self._whole_heads(rows)
        c0, c1, _ = cols.indices(self.shape[1])
        q = self._block
        first, last = c0 // q, -(-c1 // q)
        data = self._t.data[a:b]
        per = data.shape[1] // (self.shape[1] // q)  # bytes (elements when unquantized) per block
        w = decode(np.ascontiguousarray(data[:, first * per : last * per]))
        return self._trim(w[:, c0 - first * q : c1 - first * q], rows)

    def _whole_heads(self, rows: slice) -> tuple[int, int]:
        """The rows to read for `rows`: whole heads when q/k rows are permuted."""
        r0, r1, _ = rows.indices(self.shape[0])
        h = self._head_rows
        return r0 // h * h, -(-r1 // h) * h

    def _trim(self, w: np.ndarray, rows: slice) -> np.ndarray:
        """`w` read for `_whole_heads(rows)`: un-permuted, then cut to `rows`."""
        a, b = self._whole_heads(rows)
        if self._head_rows > 1:
            w = _unpermute_rows(w, (b - a) // self._head_rows)
        r0, r1, _ = rows.indices(self.shape[0])
        return w[r0 - a : r1 - a]


class _BlockLayout(NamedTuple):
    """Where a GGUF block format keeps its codes, scale and zero point (w = scale * code + zero)."""

    bits: int  # as served: 4, or 8 for wider codes (5 and 6 bits fit int8)
    codes: Any  # [rows, blocks * bytes per block] -> [rows, columns] codes
    scale_zero: Any  # [rows, blocks * bytes per block] -> ([rows, columns / group] scale, same zero), fp32
    group: int = 32  # columns per scale and zero point (a K-quant's sub-block)


def _fp16_at(data: np.ndarray, size: int, at: int) -> np.ndarray:
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, size)[:, :, at : at + 2]
    return np.ascontiguousarray(blocks).view(np.float16).reshape(rows, -1).astype(np.float32)


def _nibbles(data: np.ndarray, size: int, at: int) -> np.ndarray:
    """4-bit codes: in each block, byte j holds element j (low nibble) and element j + 16 (high)."""
    rows = data.shape[0]
    qs = data.reshape(rows, -1, size)[:, :, at:]
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, -1)


def _q4_k_codes(data: np.ndarray) -> np.ndarray:
    """Q4_K's 4-bit codes: each 256-column block keeps 128 bytes of them after its 16 bytes of
    scales; byte i of its 32-byte chunk c holds column 64c + i (low nibble) and 64c + 32 + i (high)."""
    rows = data.shape[0]
    qs = data.reshape(rows, -1, 144)[:, :, 16:].reshape(rows, -1, 4, 1, 32)
    return np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(rows, -1)


def _k_scale_zero(data: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's eight sub-blocks of 32 per block (`size` bytes): scale d * sc, zero
    -dmin * m, with sc and m the 6-bit values gguf's own Q4_K.get_scale_min unpacks."""
    from gguf.quants import Q4_K

    rows = data.shape[0]
    blocks = data.reshape(-1, size)
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    d = np.ascontiguousarray(blocks[:, 0:2]).view(np.float16).astype(np.float32)
    dmin = np.ascontiguousarray(blocks[:, 2:4]).view(np.float16).astype(np.float32)
    return (d * sc).reshape(rows, -1), (-dmin * m).reshape(rows, -1)


def _q5_k_codes(data: np.ndarray) -> np.ndarray:
    """Q5_K's 5-bit codes: per 256-column block, after d, dmin and 12 bytes of scales, 32 bytes of
    high bits (bit j of byte i: column 32j + i) and 128 of low nibbles laid out as Q4_K's."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, 176)
    qh = blocks[:, :, 16:48].reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    ql = blocks[:, :, 48:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    q = (ql & 0x0F).reshape(rows, -1, 8, 32) | ((qh & 1).reshape(rows, -1, 8, 32) << 4)
    return q.reshape(rows, -1).astype(np.int8)


def _q6_k_codes(data: np.ndarray) -> np.ndarray:
    """Q6_K's 6-bit codes less 32: per 256-column block, 128 bytes of low nibbles, 64 of high bit
    pairs, then 16 int8 scales and d (gguf's own Q6_K.dequantize_blocks reads them so)."""
    rows = data.shape[0]
    blocks = data.reshape(-1, 210)
    ql = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(-1, 8, 32)
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & 0x03).reshape(-1, 8, 32)
    return ((ql | (qh << 4)).astype(np.int16) - 32).astype(np.int8).reshape(rows, -1)


def _q6_k_scale_zero(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K's sixteen sub-blocks of 16 per block: scale d * sc (int8 sc), no zero point."""
    rows = data.shape[0]
    blocks = data.reshape(-1, 210)
    sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    d = np.ascontiguousarray(blocks[:, 208:210]).view(np.float16).astype(np.float32)
    scale = (d * sc).reshape(rows, -1)
    return scale, np.zeros_like(scale)


# MXFP4's 4-bit values (E2M1) times 2, as int8: every one an integer, so the format is served
# exactly as 8-bit codes with a power-of-two scale per 32 columns (half its E8M0 exponent's value)
MXFP4_TWICE = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)


def mxfp4_scale(exponents: np.ndarray) -> np.ndarray:
    """2^(e - 128) of each E8M0 exponent byte: the scale of MXFP4_TWICE's codes."""
    return np.ldexp(np.float32(1), exponents.astype(np.int32) - 128).astype(np.float32)


def _mxfp4_scale_zero(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    rows = data.shape[0]
    scale = mxfp4_scale(data.reshape(rows, -1, 17)[:, :, 0])
    return scale, np.zeros_like(scale)


_BLOCK_LAYOUTS = {
    # Q4_0: d (fp16), 16 bytes of nibbles; w = d * (q - 8)
    "Q4_0": _BlockLayout(4, lambda data: _nibbles(data, 18, 2),
                         lambda data: (_fp16_at(data, 18, 0), -8 * _fp16_at(data, 18, 0))),
    # Q4_1: d, m (fp16), 16 bytes of nibbles; w = d * q + m
    "Q4_1": _BlockLayout(4, lambda data: _nibbles(data, 20, 4),
                         lambda data: (_fp16_at(data, 20, 0), _fp16_at(data, 20, 2))),
    # Q4_K: 256 columns a block, d and dmin (fp16), 12 bytes of 6-bit scales and mins, 128 of nibbles
    "Q4_K": _BlockLayout(4, _q4_k_codes, lambda data: _k_scale_zero(data, 144)),
    # Q5_K: as Q4_K with a fifth bit per code (32 bytes of them before the nibbles): 8-bit codes 0..31
    "Q5_K": _BlockLayout(8, _q5_k_codes, lambda data: _k_scale_zero(data, 176)),
    # Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d; w = d * sc * (q - 32)
    "Q6_K": _BlockLayout(8, _q6_k_codes, _q6_k_scale_zero, group=16),
    # Q8_0: d (fp16), 32 int8 codes; w = d * q
    "Q8_0": _BlockLayout(8, lambda data: data.reshape(data.shape[0], -1, 34)[:, :, 2:].view(np.int8)
                         .reshape(data.shape[0], -1),
                         lambda data: (_fp16_at(data, 34, 0), np.zeros_like(_fp16_at(data, 34, 0)))),
    # MXFP4 (gpt-oss's experts): an E8M0 exponent byte, 16 bytes of nibbles (as Q4_0's), each an
    # E2M1 value; served as 8-bit codes MXFP4_TWICE[q] with scale 2^(e - 128)
    "MXFP4": _BlockLayout(8, lambda data: MXFP4_TWICE[_nibbles(data, 17, 1)], _mxfp4_scale_zero),
}
