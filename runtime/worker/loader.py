"""Stream a model's weights under Hugging Face tensor names (`model_config` finds the model and
reads its config).

Two sources: a HF checkpoint directory (safetensors shards) and a GGUF file (mapped once). A
tensor is read only when and as far as its matrix asks: as the file's own blocks for the native
kernels (`Weight.file_part`, no value touched: radixlm.kernels.cpu.pack lays them out), or
dequantized to float32 with the `gguf` package (`Weight.rows` / `cols` / `full`); once a matrix
holds what it read, `Weight.release` hands the tensor's pages of the mapping back, so the
process holds at most the served weights and one tensor's working set.
"""

from __future__ import annotations

import glob
import mmap
import os
import re
import warnings
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple, Sequence

import numpy as np
import torch

from radixlm.runtime.families import FAMILIES
from radixlm.runtime.model_config import ModelConfig, ModelSource, gguf_reader

if TYPE_CHECKING:
    from radixlm.kernels.cpu import Part


class Weight:
    """A checkpoint tensor that is read only as far as asked: a tensor-parallel rank takes its rows
    or columns (from safetensors only those bytes leave the file, from GGUF only those quant blocks
    are dequantized, or laid out as they are), everyone else the whole.

    `format` names how the file stores it (a GGUF type such as "Q4_1", or "dense")."""

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

    def full(self) -> torch.Tensor:
        return self._read(self._source[:])

    def read(self, rows: slice, cols: slice) -> torch.Tensor:
        return self._read(self._source[rows] if cols == slice(None) else self._source[rows, cols])

    def file_part(self, rows: slice, cols: slice) -> Part | None:
        """These rows and columns as the file's own blocks, for the native kernels (None where the
        file holds them dense, in a format the kernels do not read, or the columns cut blocks)."""
        part = getattr(self._source, "file_part", None)
        return part(rows, cols) if part is not None else None

    def release(self) -> None:
        """The tensor is read for good: its pages of a mapped file go back to the page cache."""
        release = getattr(self._source, "release", None)
        if release is not None:
            release()

    def rows_from(self, start: int) -> Weight:
        """The rows from `start` on, as a Weight of their own (one block of a checkpoint tensor
        that fuses several, as Phi-3's qkv_proj)."""
        return Weight(_RowsFrom(self._source, start), (self.shape[0] - start, *self.shape[1:]), self.dtype)

    def _read(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.dtype is None else t.to(self.dtype)


class Piece(NamedTuple):
    """The rows and columns of a checkpoint tensor that a matrix holds (a fused projection's part,
    a rank's shard), then `pad` rows of zeros; read only when the matrix asks."""

    weight: Weight
    rows: slice
    cols: slice = slice(None)
    pad: int = 0

    @property
    def format(self) -> str:
        return self.weight.format

    def dense(self) -> torch.Tensor:
        w = self.weight.read(self.rows, self.cols)
        return torch.cat([w, w.new_zeros(self.pad, w.shape[1])]) if self.pad else w

    def file_part(self) -> Part | None:
        part = self.weight.file_part(self.rows, self.cols)
        if part is None or not self.pad:
            return part
        return part._replace(rows=torch.cat([part.rows, torch.full((self.pad,), -1, dtype=torch.int64)]))


class _RowsFrom:
    """A checkpoint tensor's rows from `start` on, indexed and read as the tensor itself is."""

    def __init__(self, source: Any, start: int) -> None:
        self._source, self._start = source, start
        self.format = getattr(source, "format", "dense")

    def _rows(self, rows: slice) -> slice:
        return slice(self._start + (rows.start or 0), None if rows.stop is None else self._start + rows.stop)

    def __getitem__(self, key: slice | tuple[slice, slice]) -> Any:
        if isinstance(key, tuple):
            return self._source[(self._rows(key[0]), *key[1:])]
        return self._source[self._rows(key)]

    def file_part(self, rows: slice, cols: slice) -> Part | None:
        part = getattr(self._source, "file_part", None)
        return part(self._rows(rows), cols) if part is not None else None

    def release(self) -> None:
        pass  # the tensor's other blocks are still to be read


def _part(fmt: str, data: np.ndarray, rows: np.ndarray) -> Part:
    """A kernels' Part over `data` (a view of the mapped file: never written)."""
    from radixlm.kernels import cpu

    with warnings.catch_warnings():  # torch warns that the mapped file's arrays are read-only
        warnings.simplefilter("ignore", UserWarning)
        return cpu.Part(fmt, torch.from_numpy(data), torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)))


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
    """One expert's matrix in OpenAI's MXFP4 (blocks [out, in / 32, 16] bytes, two E2M1 values a
    byte, low nibble first; exponents [out, in / 32]), held as GGUF's MXFP4 blocks (an exponent
    byte, then byte j holding column j and, above it, j + 16) and read as a GGUF tensor is.
    `interleaved`: its rows alternate gate and up (gpt-oss's gate_up_proj), read gate rows first."""

    format = "MXFP4"

    def __init__(self, blocks: np.ndarray, exponents: np.ndarray, interleaved: bool = False) -> None:
        rows, groups = blocks.shape[:2]
        codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(rows, groups, 32)  # column order
        packed = codes[..., :16] | (codes[..., 16:] << 4)
        self._raw = np.concatenate([exponents.astype(np.uint8)[..., None], packed], -1).reshape(rows, groups * 17)
        self._order = (np.concatenate([np.arange(0, rows, 2), np.arange(1, rows, 2)]) if interleaved
                       else np.arange(rows))
        self.shape = (rows, groups * 32)

    def file_part(self, rows: slice, cols: slice) -> Part | None:
        c0, c1, _ = cols.indices(self.shape[1])
        if c0 % 32 or c1 % 32:
            return None
        return _part("MXFP4", self._raw[:, c0 // 32 * 17 : c1 // 32 * 17], self._order[rows])

    def __getitem__(self, key: slice | tuple[slice, slice]) -> torch.Tensor:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        rows, cols = key if isinstance(key, tuple) else (key, slice(None))
        w = dequantize(self._raw[self._order[rows]], GGMLQuantizationType.MXFP4).reshape(-1, self.shape[1])
        return torch.from_numpy(np.ascontiguousarray(w[:, cols], dtype=np.float32))


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
# where a family's file means another HF tensor by the same name (families.py: `gguf_tensor_names`)
_GGUF_FAMILY_NAMES = {f.hf_name: f.gguf_tensor_names for f in FAMILIES if f.gguf_tensor_names}
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


# families whose q/k rows llama.cpp's converter permutes (families.py: `gguf_permuted_qk`)
PERMUTED_ARCHITECTURES = tuple(f.hf_name for f in FAMILIES if f.gguf_permuted_qk)


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
                yield (f"model.layers.{m.group(1)}.mlp.experts.{e}.{_GGUF_EXPERT_NAMES[m.group(2)]}",
                       GGUFTensor(part, reader=reader))
            continue
        name = gguf_to_hf_name(t.name, config.architecture)
        if name is None:
            continue
        heads = None
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = config.num_heads
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = config.num_kv_heads
        yield name, GGUFTensor(t, heads, reader)


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

    def __init__(self, tensor: Any, heads: int | None = None, reader: Any = None) -> None:
        from gguf.constants import GGML_QUANT_SIZES

        self._t, self._reader = tensor, reader  # reader: the mapping `release` gives pages back to
        self.format = tensor.tensor_type.name
        self.shape = tuple(int(d) for d in reversed(tensor.shape))
        self._head_rows = self.shape[0] // heads if heads else 1
        self._block = GGML_QUANT_SIZES[tensor.tensor_type][0]  # columns per quant block (1: unquantized)

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

    def file_part(self, rows: slice, cols: slice) -> Part | None:
        """The file's own blocks for this part (a view of the mapped file), rows in the served
        order (un-permuted): None for a format the kernels do not read, or columns off block edges."""
        from radixlm.kernels import cpu

        if self.format not in cpu.SOURCES or len(self.shape) != 2:
            return None
        block_cols, block_bytes = cpu.BLOCK_SHAPES[self.format]
        c0, c1, _ = cols.indices(self.shape[1])
        if c0 % block_cols or c1 % block_cols:
            return None
        data = np.asarray(self._t.data)[:, c0 // block_cols * block_bytes : c1 // block_cols * block_bytes]
        order = np.arange(self.shape[0])
        if self._head_rows > 1:
            order = _unpermute_rows(order, self.shape[0] // self._head_rows)
        return _part(self.format, data, order[rows])

    def release(self) -> None:
        if self._reader is not None:
            release_pages(self._reader, np.asarray(self._t.data))

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


def release_pages(reader: Any, data: np.ndarray) -> None:
    """Drop `data`'s pages (a view of the reader's mapped file) from this process's mapping: they
    stay in the page cache for a later read, but no longer count in this process's memory."""
    mapped = getattr(reader.data, "base", None)
    handle = getattr(mapped, "_mmap", None)
    if handle is None or data.size == 0:
        return
    base = reader.data.__array_interface__["data"][0]
    start = data.__array_interface__["data"][0] - base
    end = start + (data.shape[0] - 1) * data.strides[0] + data.shape[-1] * data.itemsize if data.ndim > 1 else \
        start + data.nbytes
    first = start // mmap.PAGESIZE * mmap.PAGESIZE
    handle.madvise(mmap.MADV_DONTNEED, first, min(end, len(handle)) - first)
