"""Real-shaped GGUF files with random weights: the sizes people run on a CPU, for the memory and
speed benchmarks (memory.py, run_all.py --models), without downloading a checkpoint.

    python benchmarks/make_models.py                          # 1b-q4_0, 1b-q4_k_m, 8b-q4_0, 8b-q4_k_m
    python benchmarks/make_models.py --models 1b-q4_0 --out /some/folder
    python benchmarks/make_models.py --models 30b-a3b-q4_k_m  # the MoE: only when named (below)

Each file is a model of the named shape (Llama-3.2-1B, Llama-3-8B, Qwen3-30B-A3B) with SmolLM2's
tokenizer (the embedded model's `tokenizer.*` keys copied, so radixlm and llama.cpp both tokenize
and apply its chat template; its 49,152-token vocabulary replaces the real models'), llama.cpp's
metadata keys as its converter writes them (Llama-3.2's llama3 rope scaling as the `rope_freqs`
tensor), and its quantization rules (src/llama-quant.cpp) for two file types:

- q4_0: every matrix Q4_0, but the output table Q6_K (a tied table, token_embd, is the output's
  too, so Q6_K; an untied token_embd stays Q4_0);
- q4_k_m: Q4_K, with attn_v and ffn_down Q6_K in the layers llama.cpp's `use_more_bits` picks (the
  first and last eighth, and every third between), the output table (or a tied token_embd) Q6_K.

Weights are N(0, 0.02) like a trained model's scale, norms 1, so activations stay finite and
sane (tests/model/test_benchmark_scripts.py runs the tiny shapes through HF transformers). They are
drawn per tensor from a generator seeded by (--seed, the tensor's name), so the q4_0 and q4_k_m
files of a shape hold the same model, and a rerun writes the same bytes. Q4_0, Q8_0 are gguf's own
quantizers; gguf (0.19) has none for the K formats, so Q4_K and Q6_K blocks are encoded here
(min/max scales, no search: enough for random weights) and checked against gguf's dequantizer.

Tensors are made, quantized and written one at a time, in chunks of rows (the 8B files never
take more than a few hundred MB); a file whose spec (shape, type, seed) matches is skipped, and a
file is written under a temporary name and renamed when complete. Quantizing in numpy is slow:
8-10 minutes per 8B file on 2 busy cores (1B: 1-2 minutes).

| name | file | weights | tensors |
|---|---|---|---|
| 1b-q4_0 | 0.63 GB | 1.07 B | Q4_0 91%, Q6_K 9% (the tied table) |
| 1b-q4_k_m | 0.67 GB | 1.07 B | Q4_K 77%, Q6_K 23% |
| 8b-q4_0 | 4.21 GB | 7.38 B | Q4_0 97%, Q6_K 3% (the output table) |
| 8b-q4_k_m | 4.47 GB | 7.38 B | Q4_K 84%, Q6_K 16% |
| 30b-a3b-q4_0, 30b-a3b-q4_k_m | 17.0, 18.3 GB | 30.1 B | as the 8B's |

The Qwen3-30B-A3B shape (128 experts of 768, 8 used, 48 layers) is 17-18 GB at 4 bits: it fits on
disk, and llama.cpp maps it on a 24 GB machine, but it takes about 40 minutes to write and no
server of ours holds it in 24 GB yet, so it is written only when named in --models.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

DEFAULT_FOLDER = os.path.join(os.path.expanduser("~"), ".cache", "radixlm", "bench-models")
SPEC_KEY = "radixlm.make_models.spec"  # the file's spec as JSON: a rerun skips a file whose spec matches
GENERATOR = 1  # bump when the bytes a spec makes change
STD = 0.02
CHUNK = 1 << 22  # weights drawn and quantized at a time
QK_K = 256


@dataclass(frozen=True)
class Shape:
    """A model's shape, with the metadata llama.cpp's converter writes for it."""

    label: str
    arch: str  # llama | qwen3moe
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    context: int
    rope_theta: float
    eps: float
    tied: bool
    vocab: int = 49152  # SmolLM2's tokenizer
    llama3_rope: tuple[float, float, float, int] | None = None  # factor, low, high, original context
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0


SHAPES = {
    "1b": Shape("Llama-3.2-1B", "llama", 2048, 16, 32, 8, 64, 8192, 131072, 500000.0, 1e-5, True,
                llama3_rope=(32.0, 1.0, 4.0, 8192)),
    "8b": Shape("Llama-3-8B", "llama", 4096, 32, 32, 8, 128, 14336, 8192, 500000.0, 1e-5, False),
    "30b-a3b": Shape("Qwen3-30B-A3B", "qwen3moe", 2048, 48, 32, 4, 128, 6144, 40960, 1e6, 1e-6, False,
                     experts=128, experts_used=8, expert_ffn=768),
    # for tests: the same generator on small matrices (rows a multiple of 256 for the K formats)
    "tiny": Shape("tiny Llama", "llama", 256, 2, 4, 2, 64, 512, 2048, 500000.0, 1e-5, True,
                  llama3_rope=(32.0, 1.0, 4.0, 8192)),
    # (experts of 768, as the real one's: HF's GGUF reader takes that width, not the file's)
    "tiny-moe": Shape("tiny Qwen3-MoE", "qwen3moe", 256, 2, 4, 2, 64, 512, 2048, 1e6, 1e-6, False,
                      experts=4, experts_used=2, expert_ffn=768),
}
# file type: (its default tensor type, llama.cpp's ftype)
RECIPES = {"q4_0": (QType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
           "q4_k_m": (QType.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_M)}
DEFAULT_MODELS = ("1b-q4_0", "1b-q4_k_m", "8b-q4_0", "8b-q4_k_m")
EMBEDDED = "smollm2"  # the embedded model's name where a model is asked for by name


def split_name(model: str) -> tuple[str, str]:
    """'8b-q4_k_m' -> ('8b', 'q4_k_m'); a clear error for anything else."""
    for recipe in RECIPES:
        shape = model.removesuffix("-" + recipe)
        if shape != model and shape in SHAPES:
            return shape, recipe
    raise ValueError(f"unknown model {model!r}: a shape ({', '.join(SHAPES)}) and a type "
                     f"({', '.join(RECIPES)}), e.g. 8b-q4_0")


def file_name(model: str) -> str:
    shape, recipe = split_name(model)
    return f"{SHAPES[shape].label.lower().replace(' ', '-')}-shaped-random-{recipe}.gguf"


def resolve(model: str, folder: str = DEFAULT_FOLDER) -> str:
    """A model for the benchmarks: `smollm2` (the embedded file), a name make_models writes (in
    `folder`, which must hold it), or a GGUF path."""
    if model == EMBEDDED:
        from radixlm.runtime.model_config import default_model_path

        return default_model_path()
    if os.path.isfile(model):
        return model
    path = os.path.join(folder, file_name(model))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist: python benchmarks/make_models.py --models {model} "
                                f"--out {folder} writes it")
    return path


# ---- the K formats, encoded in numpy (gguf 0.19 only decodes them) ---------------------------------

def _half(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _codes(x: np.ndarray, scale: np.ndarray, low: int, high: int) -> np.ndarray:
    """round(x / scale) clipped to [low, high], 0 where the scale is 0."""
    safe = np.where(scale == 0, 1, scale)
    return np.clip(np.rint(x / safe), low, high).astype(np.int16)


def encode_q4_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] float32 -> [n, 144] bytes of Q4_K: fp16 d and dmin, eight 6-bit scales and mins
    packed in 12 bytes, 4-bit codes; x = d * sc * q - dmin * m per sub-block of 32."""
    n = len(blocks)
    sub = blocks.reshape(n, 8, 32)
    low = np.minimum(sub.min(-1), 0)  # the format's min is subtracted: at most 0
    scale = (sub.max(-1) - low) / 15
    d, dmin = _half(scale.max(-1) / 63), _half(-low.min(-1) / 63)
    sc = _codes(scale, d.astype(np.float32)[:, None], 0, 63).astype(np.uint8)
    m = _codes(-low, dmin.astype(np.float32)[:, None], 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * m
    q = _codes(sub + offset[..., None], step[..., None], 0, 15).astype(np.uint8)
    packed = np.empty((n, 12), np.uint8)
    packed[:, 0:4] = sc[:, :4] | (sc[:, 4:] >> 4) << 6
    packed[:, 4:8] = m[:, :4] | (m[:, 4:] >> 4) << 6
    packed[:, 8:12] = (sc[:, 4:] & 0xF) | (m[:, 4:] & 0xF) << 4
    pairs = q.reshape(n, 4, 2, 32)  # sub-blocks 2j and 2j+1 share 32 bytes: low and high nibbles
    qs = (pairs[:, :, 0] | pairs[:, :, 1] << 4).reshape(n, 128)
    return np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), packed, qs], axis=1)


def encode_q6_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] float32 -> [n, 210] bytes of Q6_K: 6-bit codes (low 4 bits, then high 2 bits),
    sixteen int8 scales, fp16 d; x = d * sc * (q - 32) per sub-block of 16."""
    n = len(blocks)
    sub = blocks.reshape(n, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = _half(scale.max(-1) / 127)
    sc = _codes(scale, d.astype(np.float32)[:, None], -128, 127).astype(np.int8)
    step = d.astype(np.float32)[:, None] * sc
    q = (_codes(sub, step[..., None], -32, 31) + 32).astype(np.uint8).reshape(n, 256)
    halves = q.reshape(n, 2, 2, 64)  # per 128 values: byte b's nibbles are values b and 64 + b
    ql = ((halves[:, :, 0] & 0xF) | (halves[:, :, 1] & 0xF) << 4).reshape(n, 128)
    high = q.reshape(n, 2, 4, 32) >> 4  # per 128 values: byte b's bit pairs are values b, 32+b, 64+b, 96+b
    qh = (high[:, :, 0] | high[:, :, 1] << 2 | high[:, :, 2] << 4 | high[:, :, 3] << 6).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(n, 2)], axis=1)


K_ENCODERS = {QType.Q4_K: encode_q4_k, QType.Q6_K: encode_q6_k}


def quantize(rows: np.ndarray, qtype: QType) -> np.ndarray:
    """[r, c] float32 -> [r, bytes a row] of qtype's blocks."""
    if qtype in K_ENCODERS:
        return K_ENCODERS[qtype](rows.reshape(-1, QK_K)).reshape(len(rows), -1)
    return gguf.quants.quantize(rows, qtype)


# ---- what a file holds -------------------------------------------------------------------------

@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]  # numpy order: [experts,] rows, columns (the dot's length last)
    qtype: QType
    value: float | None = None  # a constant (norms: 1), else N(0, STD)


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get more bits under Q4_K_M."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def matrix_type(s: Shape, recipe: str, kind: str, layer: int) -> QType:
    """llama.cpp's type for a matrix under `recipe` (llama-quant.cpp, for these shapes: no fused
    qkv, no 8-expert MoE, rows a multiple of 256)."""
    default, _ = RECIPES[recipe]
    if kind == "output" or (kind == "token_embd" and s.tied):  # a tied table is quantized as the output
        return QType.Q8_0 if s.hidden % gguf.GGML_QUANT_SIZES[default][0] else QType.Q6_K
    if recipe == "q4_k_m" and kind in ("attn_v", "ffn_down", "ffn_down_exps") and use_more_bits(layer, s.layers):
        return QType.Q6_K
    return default


def tensors(s: Shape, recipe: str) -> Iterator[Tensor]:
    """Every tensor of the file, in the converter's order."""
    yield Tensor("token_embd.weight", (s.vocab, s.hidden), matrix_type(s, recipe, "token_embd", 0))
    if s.llama3_rope:
        yield Tensor("rope_freqs.weight", (s.head_dim // 2,), QType.F32)
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    for i in range(s.layers):
        blk = f"blk.{i}."
        yield Tensor(blk + "attn_norm.weight", (s.hidden,), QType.F32, 1.0)
        if s.arch == "qwen3moe":
            yield Tensor(blk + "attn_q_norm.weight", (s.head_dim,), QType.F32, 1.0)
            yield Tensor(blk + "attn_k_norm.weight", (s.head_dim,), QType.F32, 1.0)
        for kind, shape in (("attn_q", (q, s.hidden)), ("attn_k", (kv, s.hidden)), ("attn_v", (kv, s.hidden)),
                            ("attn_output", (s.hidden, q))):
            yield Tensor(blk + kind + ".weight", shape, matrix_type(s, recipe, kind, i))
        yield Tensor(blk + "ffn_norm.weight", (s.hidden,), QType.F32, 1.0)
        if s.experts:
            yield Tensor(blk + "ffn_gate_inp.weight", (s.experts, s.hidden), QType.F32)  # llama.cpp keeps the router
            ffn = {"ffn_gate_exps": (s.experts, s.expert_ffn, s.hidden), "ffn_up_exps": (s.experts, s.expert_ffn, s.hidden),
                   "ffn_down_exps": (s.experts, s.hidden, s.expert_ffn)}
        else:
            ffn = {"ffn_gate": (s.ffn, s.hidden), "ffn_up": (s.ffn, s.hidden), "ffn_down": (s.hidden, s.ffn)}
        for kind, shape in ffn.items():
            yield Tensor(blk + kind + ".weight", shape, matrix_type(s, recipe, kind, i))
    yield Tensor("output_norm.weight", (s.hidden,), QType.F32, 1.0)
    if not s.tied:
        yield Tensor("output.weight", (s.vocab, s.hidden), matrix_type(s, recipe, "output", 0))


def llama3_rope_factors(s: Shape) -> np.ndarray:
    """The per-frequency factors llama.cpp's converter writes as rope_freqs for llama3 scaling."""
    factor, low, high, original = s.llama3_rope
    freqs = 1.0 / s.rope_theta ** (np.arange(0, s.head_dim, 2, dtype=np.float64) / s.head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, mid)).astype(np.float32)


def tensor_data(t: Tensor, s: Shape, seed: int) -> np.ndarray:
    """The tensor as the file stores it (quantized rows), drawn and quantized a chunk of rows at a time."""
    if t.name == "rope_freqs.weight":
        return llama3_rope_factors(s)
    if t.value is not None:
        return np.full(t.shape, t.value, np.float32)
    rng = np.random.default_rng([seed, zlib.crc32(t.name.encode())])
    cols = t.shape[-1]
    rows = math.prod(t.shape[:-1])
    if t.qtype == QType.F32:
        return (rng.standard_normal(t.shape, dtype=np.float32) * STD).astype(np.float32)
    block, size = gguf.GGML_QUANT_SIZES[t.qtype]
    if cols % block:
        raise ValueError(f"{t.name}: rows of {cols} are not whole {t.qtype.name} blocks of {block}")
    out = np.empty((rows, cols // block * size), np.uint8)
    step = max(1, CHUNK // cols)
    for start in range(0, rows, step):
        chunk = rng.standard_normal((min(step, rows - start), cols), dtype=np.float32)
        chunk *= STD
        out[start:start + len(chunk)] = quantize(chunk, t.qtype)
    return out.reshape(*t.shape[:-1], -1)


# ---- the file --------------------------------------------------------------------------------------

def spec(model: str, seed: int) -> str:
    shape, recipe = split_name(model)
    return json.dumps({"generator": GENERATOR, "seed": seed, "recipe": recipe, "shape": asdict(SHAPES[shape])},
                      sort_keys=True)


def existing_spec(path: str) -> str | None:
    """The spec a file was written with: its key is among the first, so read the header's keys up to
    it (gguf's reader would parse the whole 49,152-token vocabulary first)."""
    scalars = {t: np.dtype(f) for t, f in ((gguf.GGUFValueType.UINT8, "u1"), (gguf.GGUFValueType.INT8, "i1"),
               (gguf.GGUFValueType.UINT16, "<u2"), (gguf.GGUFValueType.INT16, "<i2"), (gguf.GGUFValueType.UINT32, "<u4"),
               (gguf.GGUFValueType.INT32, "<i4"), (gguf.GGUFValueType.FLOAT32, "<f4"), (gguf.GGUFValueType.BOOL, "u1"),
               (gguf.GGUFValueType.UINT64, "<u8"), (gguf.GGUFValueType.INT64, "<i8"), (gguf.GGUFValueType.FLOAT64, "<f8"))}
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return None
            f.read(4 + 8)  # version, tensor count
            (keys,) = struct.unpack("<Q", f.read(8))
            for _ in range(keys):
                key = f.read(struct.unpack("<Q", f.read(8))[0]).decode()
                kind = gguf.GGUFValueType(struct.unpack("<I", f.read(4))[0])
                if kind == gguf.GGUFValueType.STRING:
                    value = f.read(struct.unpack("<Q", f.read(8))[0]).decode()
                    if key == SPEC_KEY:
                        return value
                elif kind in scalars:
                    f.read(scalars[kind].itemsize)
                else:
                    return None  # an array: past the keys make_models writes first
    except (OSError, ValueError, struct.error):
        pass
    return None


def tokenizer_keys(path: str) -> list[tuple[str, object, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    """The `tokenizer.*` keys of a GGUF file: (key, value, type, array item type)."""
    fields = gguf.GGUFReader(path).fields
    return [(key, field.contents(), field.types[0], field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
            for key, field in fields.items() if key.startswith("tokenizer.")]


def add_metadata(writer: gguf.GGUFWriter, s: Shape, recipe: str, model_spec: str, tokenizer: list) -> None:
    """llama.cpp's keys for the shape, and the embedded model's tokenizer keys (`tokenizer_keys`)."""
    writer.add_string(SPEC_KEY, model_spec)  # first after the architecture: existing_spec reads up to it
    writer.add_type("model")
    writer.add_name(f"{s.label}-shaped, random weights (radixlm benchmarks)")
    writer.add_file_type(RECIPES[recipe][1])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(s.context)
    writer.add_embedding_length(s.hidden)
    writer.add_block_count(s.layers)
    writer.add_feed_forward_length(s.ffn)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_key_length(s.head_dim)
    writer.add_value_length(s.head_dim)
    writer.add_layer_norm_rms_eps(s.eps)
    writer.add_rope_freq_base(s.rope_theta)
    writer.add_rope_dimension_count(s.head_dim)
    writer.add_vocab_size(s.vocab)
    if s.experts:
        writer.add_expert_count(s.experts)
        writer.add_expert_used_count(s.experts_used)
        writer.add_expert_feed_forward_length(s.expert_ffn)
    for key, value, kind, item in tokenizer:
        if key == "tokenizer.ggml.tokens" and len(value) != s.vocab:
            raise ValueError(f"the tokenizer has {len(value)} tokens, the shape {s.vocab}")
        writer.add_key_value(key, value, kind, sub_type=item)


def write_model(model: str, path: str, seed: int, tokenizer: list) -> None:
    """Write one file, tensor by tensor, under a temporary name renamed when complete."""
    shape_name, recipe = split_name(model)
    s = SHAPES[shape_name]
    start = time.perf_counter()
    part = path + ".part"
    writer = gguf.GGUFWriter(part, s.arch)
    add_metadata(writer, s, recipe, spec(model, seed), tokenizer)
    layout = list(tensors(s, recipe))
    for t in layout:
        block, size = gguf.GGML_QUANT_SIZES[t.qtype]
        nbytes = math.prod(t.shape) // block * size
        if t.qtype == QType.F32:
            writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), nbytes)
        else:
            byte_shape = (*t.shape[:-1], t.shape[-1] // block * size)
            writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=t.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in layout:
        writer.write_tensor_data(tensor_data(t, s, seed))
    writer.close()
    os.replace(part, path)
    print(f"{model}: wrote {path}, {os.path.getsize(path) / 1e9:.2f} GB in {time.perf_counter() - start:.0f} s",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS),
                    help=f"comma-separated shape-type names: shapes {', '.join(SHAPES)}, types {', '.join(RECIPES)} "
                         f"(default: {','.join(DEFAULT_MODELS)})")
    ap.add_argument("--out", default=DEFAULT_FOLDER, help=f"the folder (default: {DEFAULT_FOLDER})")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    models = args.models.split(",")
    for model in models:
        try:
            split_name(model)
        except ValueError as e:
            ap.error(str(e))
    from radixlm.runtime.model_config import default_model_path

    os.makedirs(args.out, exist_ok=True)
    tokenizer = None  # read once, if a file is to be written (a few seconds)
    for model in models:
        path = os.path.join(args.out, file_name(model))
        if existing_spec(path) == spec(model, args.seed):
            print(f"{model}: {path} exists with the same spec, {os.path.getsize(path) / 1e9:.2f} GB: skipped", flush=True)
            continue
        tokenizer = tokenizer or tokenizer_keys(default_model_path())
        write_model(model, path, args.seed, tokenizer)


if __name__ == "__main__":
    main()
