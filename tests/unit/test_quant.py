"""Quantized weights: the file's blocks served exactly at their own size, fused projections of
mixed formats, codes made here, and the choice per matrix."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixlm.kernels import cpu
from radixlm.kernels.cpu import reference
from radixlm.runtime.args import ServerArgs
from radixlm.runtime.worker import quant
from radixlm.runtime.worker.loader import GGUFTensor, Piece, Weight

# K-quant block bytes, where its fp16 scales start and how many: d and dmin first, or Q6_K's d last
K_QUANTS = {"Q4_K": (144, 0, 2), "Q5_K": (176, 0, 2), "Q6_K": (210, 208, 1)}
KINDS = ["Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "MXFP4"]


def _gguf_tensors(tmp_path, kinds: tuple[str, ...], rows: int = 32, cols: int = 512):
    """A GGUF file holding one random [rows, cols] tensor per kind, quantized by the gguf package
    (so the blocks are laid out by its writer, not by us); returns {kind: (reader tensor, dequantized)}."""
    import gguf

    rng = np.random.default_rng(0)
    path = str(tmp_path / "t.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    for kind in kinds:
        qtype = gguf.GGMLQuantizationType[kind]
        if kind in K_QUANTS:  # gguf cannot quantize to them: random blocks, with sane fp16 d (and dmin)
            size, at, count = K_QUANTS[kind]
            raw = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
            raw[:, :, at : at + 2 * count] = (rng.random((rows, cols // 256, count)) * 0.01).astype(np.float16).view(np.uint8)
            writer.add_tensor(kind.lower(), raw.reshape(rows, -1), raw_dtype=qtype)
            continue
        data = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        writer.add_tensor(kind.lower(), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(path)
    return {t.name.upper(): (t, gguf.quants.dequantize(t.data, t.tensor_type).reshape(rows, cols))
            for t in reader.tensors}


def _served(part: cpu.Part, cols: int) -> quant.QuantizedMatrix:
    return quant.QuantizedMatrix(cpu.pack([part], cols), [8], ["test"])


def _multiplies_by(m: quant.QuantizedMatrix, values: torch.Tensor) -> None:
    """m multiplies by exactly `values`: against the float64 product with the kernel's own
    quantized activations."""
    x = torch.randn(5, values.shape[1])
    want = reference.quant_matmul(x, values)
    assert (m.kernel(x) - want).abs().max() < 1e-5 * want.abs().max()


@pytest.mark.parametrize("kind", KINDS)
def test_the_files_blocks_are_served_as_gguf_reads_them(tmp_path, kind):
    raw, dense = _gguf_tensors(tmp_path, (kind,))[kind]
    t = GGUFTensor(raw)
    assert t.format == kind
    whole = t.file_part(slice(None), slice(None))
    m = _served(whole, 512)
    assert torch.equal(m.dequantize(), torch.from_numpy(dense))  # bit for bit gguf's own dequantization
    _multiplies_by(m, torch.from_numpy(dense))
    ids = torch.tensor([[0, 7], [31, 7]])
    assert torch.equal(m.embed(ids), torch.from_numpy(dense)[ids])
    edge = 256 if kind in K_QUANTS else 32
    part = t.file_part(slice(5, 17), slice(edge, 2 * edge))  # a tensor-parallel rank's rows and columns
    assert torch.equal(_served(part, edge).dequantize(), torch.from_numpy(dense[5:17, edge : 2 * edge]))
    assert t.file_part(slice(None), slice(16, 64)) is None  # columns off the block edges: no codes


@pytest.mark.parametrize("kind", KINDS)
def test_every_format_is_served_at_the_files_size(tmp_path, kind):
    """Issue 46: served bytes within 5% of the file's tensor bytes (Q4_K and Q5_K keep their 6-bit
    sub-scales as bytes: 2.8% and 2.3% over; the rest are the file's size)."""
    raw, _ = _gguf_tensors(tmp_path, (kind,), rows=64, cols=1024)[kind]
    served = _served(GGUFTensor(raw).file_part(slice(None), slice(None)), 1024)
    file_bytes = np.asarray(raw.data).nbytes
    assert file_bytes <= served.nbytes <= 1.05 * file_bytes, (served.nbytes, file_bytes)


def test_the_blocks_follow_the_qk_row_permutation(tmp_path):
    raw, _ = _gguf_tensors(tmp_path, ("Q4_1",), cols=128)["Q4_1"]
    t = GGUFTensor(raw, heads=4)  # rows un-permuted within each of 4 heads, as q/k projections are
    assert torch.equal(_served(t.file_part(slice(8, 24), slice(None)), 128).dequantize(), t[8:24])


def test_a_fused_matrix_keeps_each_parts_format(tmp_path):
    """Q4_K_M's q and k in Q4_K beside v in Q6_K: one matrix of two segments, each part's rows its
    own values, one product for all (rows of 12 and 20: a segment's last row group is padded)."""
    tensors = _gguf_tensors(tmp_path, ("Q4_K", "Q6_K"), rows=32)
    (q, dq), (v, dv) = tensors["Q4_K"], tensors["Q6_K"]
    pieces = [Piece(Weight(GGUFTensor(q), (32, 512)), slice(0, 12)),
              Piece(Weight(GGUFTensor(q), (32, 512)), slice(12, 24)),
              Piece(Weight(GGUFTensor(v), (32, 512)), slice(4, 24))]
    m = quant.serve(pieces, quant.Serving("auto", 32, "linear"), (44, 512))
    assert m.tiled.kinds() == ["k4", "k6"] and m.bits == (4, 6)
    values = torch.from_numpy(np.concatenate([dq[:24], dv[4:24]]))
    assert torch.equal(m.dequantize(), values)
    _multiplies_by(m, values)
    bias = torch.randn(44)
    x = torch.randn(3, 512)
    assert torch.equal(m.matmul(x, bias), m.kernel(x) + bias)


@pytest.mark.parametrize("group", [32, 64])
def test_int4_made_here_is_served_as_made(group):
    torch.manual_seed(0)
    blocks = quant.Blocks.int4_from(torch.randn(96, 256) * 0.05, group)
    m = _served(blocks.part(), 256)
    assert m.tiled.kinds() == ["u4"]
    assert torch.equal(m.dequantize(), blocks.dequantize())
    _multiplies_by(m, blocks.dequantize())


def test_int4_from_recovers_q4_1_codes(tmp_path):
    raw, dense = _gguf_tensors(tmp_path, ("Q4_1",), cols=128)["Q4_1"]
    again = quant.Blocks.int4_from(torch.from_numpy(dense), 32)
    assert (again.dequantize() - torch.from_numpy(dense)).abs().max() < 1e-6


def test_int8_from_is_q8_0s_rule():
    torch.manual_seed(1)
    w = torch.randn(40, 64)
    blocks = quant.Blocks.int8_from(w)
    step = blocks.scale.repeat_interleave(32, 1)
    assert ((blocks.dequantize() - w).abs() <= step * 0.5 + 1e-7).all()  # within half a step of its group
    assert blocks.codes.abs().max() == 127
    m = _served(blocks.part(), 64)
    assert m.tiled.kinds() == ["s8"] and torch.equal(m.dequantize(), blocks.dequantize())


def test_auto_keeps_a_matrix_dense_where_the_file_does(tmp_path):
    """auto serves the file's formats: a part stored dense leaves its matrix dense; int8 and int4
    make codes for it (int4 never for a table)."""
    raw, _ = _gguf_tensors(tmp_path, ("Q8_0",), cols=128)["Q8_0"]
    dense = torch.randn(8, 128)
    pieces = [Piece(Weight(GGUFTensor(raw), (32, 128)), slice(0, 8)), Piece(Weight(dense, dense.shape), slice(None))]
    assert quant.serve(pieces, quant.Serving("auto", 32, "linear"), (16, 128)) is None
    int4 = quant.serve(pieces, quant.Serving("int4", 32, "linear"), (16, 128))
    assert int4.tiled.kinds() == ["u4"] and int4.bits == (4,)
    assert int4.hows == ("int4 g32 (requantized from Q8_0)", "int4 g32 (requantized from dense)")
    table = quant.serve(pieces, quant.Serving("int4", 32, "table"), (16, 128))
    assert table.tiled.kinds() == ["s8", "s8"] and table.bits == (8,)  # the file's own Q8_0, then codes made here


def _toy_model() -> torch.nn.Module:
    """Two layer matrices and a table, marked as the model classes mark theirs."""
    model = torch.nn.Module()
    model.up, model.down, model.table = torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(96, 64, bias=False), \
        torch.nn.Embedding(40, 64)
    for name, role in (("up", "linear"), ("down", "linear"), ("table", "table")):
        getattr(model, name).quant_role = role
    return model


def test_a_dense_model_quantizes_in_place():
    """Weights made in place (--load-format dummy): int8 puts every matrix on the codes, and a
    prefill-sized batch reads them as one row alone does (no dense copy is kept anywhere)."""
    model = _toy_model()
    kernels = quant.quantize_dense(model, "int8", 32, torch.device("cpu"))
    assert kernels.isa == cpu.isa_name()
    summary = quant.summarize(model, ("int8", 32), kernels, torch.float32)
    served = [model.up.weight, model.down.weight, model.table.weight]
    assert all(isinstance(w, quant.QuantizedMatrix) for w in served)
    assert summary.method == "int8" and summary.weight_bytes == sum(w.nbytes for w in served)
    x = torch.randn(64, 96)
    assert torch.equal(model.down.weight.matmul(x, None)[5:6], model.down.weight.kernel(x[5:6].clone()))


def test_bad_quantization_options_are_named():
    with pytest.raises(ValueError, match="quantization must be one of"):
        ServerArgs(quantization="fp8")
    with pytest.raises(ValueError, match="quantization_group_size"):
        ServerArgs(quantization="int4", quantization_group_size=48)
