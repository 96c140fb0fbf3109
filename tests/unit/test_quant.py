"""Quantized weights: the file's codes read exactly, each kernel against a dense oracle, the plan logic."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixlm.runtime.args import ServerArgs
from radixlm.runtime.worker import quant
from radixlm.runtime.worker.loader import GGUFTensor

# K-quant block bytes, where its fp16 scales start and how many: d and dmin first, or Q6_K's d last
K_QUANTS = {"Q4_K": (144, 0, 2), "Q5_K": (176, 0, 2), "Q6_K": (210, 208, 1)}


def _gguf_tensors(tmp_path, kinds: tuple[str, ...], rows: int = 32, cols: int = 128):
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


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "MXFP4"])
def test_gguf_blocks_are_the_files_own_values(tmp_path, kind):
    cols = 512 if kind in K_QUANTS else 128  # a K-quant block spans 256 columns
    raw, dense = _gguf_tensors(tmp_path, (kind,), cols=cols)[kind]
    t = GGUFTensor(raw)
    assert t.has_blocks and t.format == kind
    whole = t.blocks(slice(None), slice(None))
    bits, group, low, high = {"Q8_0": (8, 32, -128, 127), "Q5_K": (8, 32, 0, 31), "Q6_K": (8, 16, -32, 31),
                              "MXFP4": (8, 32, -12, 12)}.get(kind, (4, 32, 0, 15))
    assert whole.bits == bits and whole.group == group
    assert whole.codes.min() >= low and whole.codes.max() <= high
    assert torch.equal(whole.dequantize(), torch.from_numpy(dense))  # bit for bit gguf's own dequantization
    edge = 256 if kind in K_QUANTS else 32
    part = t.blocks(slice(5, 17), slice(edge, 2 * edge))  # a tensor-parallel rank's rows and columns
    assert torch.equal(part.dequantize(), torch.from_numpy(dense[5:17, edge : 2 * edge]))
    assert t.blocks(slice(None), slice(16, 64)) is None  # columns off the block edges: no codes


def test_gguf_blocks_follow_the_qk_row_permutation(tmp_path):
    raw, _ = _gguf_tensors(tmp_path, ("Q4_1",))["Q4_1"]
    t = GGUFTensor(raw, heads=3)  # rows un-permuted within each of 3 heads, as q/k projections are
    assert torch.equal(t.blocks(slice(8, 16), slice(None)).dequantize(), t[8:16])


def _blocks4(rows: int, cols: int, group: int) -> quant.Blocks:
    torch.manual_seed(0)
    return quant.Blocks.int4_from(torch.randn(rows, cols) * 0.05, group)


def _served_exactly(m: quant.QuantizedMatrix, values: torch.Tensor) -> None:
    """m serves exactly `values` (its codes dequantized), and multiplies by them: against the
    float64 product with the kernel's own quantized activations."""
    from radixlm.kernels.cpu import reference

    assert torch.equal(m.dequantize(), values)
    x = torch.randn(5, values.shape[1])
    q, d, _ = reference.quantize_activations(x)
    xq = (q.double().view(5, -1, 32) * d.double()[..., None]).view(5, -1)
    want = xq @ values.double().T
    assert (m.kernel(x) - want).abs().max() < 1e-5 * want.abs().max()


@pytest.mark.parametrize("group", [32, 64])
def test_int4_codes_are_served_as_they_are(group):
    blocks = _blocks4(96, 256, group)
    m = quant.QuantizedMatrix(blocks)
    assert (m.tiled.bits, m.tiled.rows, m.tiled.cols) == (4, 96, 256)
    _served_exactly(m, blocks.dequantize())
    # and the codes are Q4_1's rule: every group's min and max come back (to rounding)
    assert (blocks.dequantize() - _blocks4(96, 256, group).dequantize()).abs().max() == 0


def test_int4_from_recovers_q4_1_codes(tmp_path):
    raw, dense = _gguf_tensors(tmp_path, ("Q4_1",))["Q4_1"]
    file = GGUFTensor(raw).blocks(slice(None), slice(None))
    again = quant.Blocks.int4_from(torch.from_numpy(dense), 32)
    assert (again.dequantize() - file.dequantize()).abs().max() < 1e-6


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "MXFP4"])
def test_gguf_codes_are_served_exactly(tmp_path, kind):
    cols = 512 if kind in K_QUANTS else 128
    raw, dense = _gguf_tensors(tmp_path, (kind,), cols=cols)[kind]
    m = quant.QuantizedMatrix(GGUFTensor(raw).blocks(slice(None), slice(None)))
    _served_exactly(m, torch.from_numpy(dense))
    # the file's fp16 scales stay fp16 (no bandwidth spent on exact values); Q4_K's products need fp32
    assert m.tiled.half == (kind not in K_QUANTS)
    assert m.tiled.zero == (kind not in ("Q8_0", "Q6_K", "MXFP4")) and m.tiled.group == (16 if kind == "Q6_K" else 32)
    ids = torch.tensor([[0, 7], [31, 7]])
    assert torch.equal(m.embed(ids), torch.from_numpy(dense)[ids])


def test_int8_from_is_q8_0s_rule():
    torch.manual_seed(1)
    w = torch.randn(40, 64)
    blocks = quant.Blocks.int8_from(w)
    step = blocks.scale.repeat_interleave(32, 1)
    assert ((blocks.dequantize() - w).abs() <= step * 0.5 + 1e-7).all()  # within half a step of its group
    assert blocks.codes.abs().max() == 127
    _served_exactly(quant.QuantizedMatrix(blocks), blocks.dequantize())


def test_matmul_takes_the_dense_copy_above_the_plans_rows():
    blocks = _blocks4(64, 128, 32)
    source = blocks.dequantize()  # the dense copy holds the served values: the codes dequantized
    m = quant.QuantizedMatrix(blocks)
    m.settle(torch.float32)
    assert m.dense is not None
    x = torch.randn(9, 128)
    exact = x @ source.t()
    dense = m.matmul(x, None, quant.Plan(dense_above=8))  # 9 rows > 8: the fp32 copy
    codes = m.matmul(x, None, quant.Plan())
    assert (dense - exact).abs().max() < 1e-4 and (codes - exact).abs().max() < 1e-3
    assert torch.equal(codes, m.kernel(x)) and not torch.equal(dense, codes)  # two kernels, two summation orders
    assert torch.equal(m.matmul(x[:8], None, quant.Plan(dense_above=8)), codes[:8])  # 8 rows: the codes
    bias = torch.randn(64)
    assert torch.allclose(m.matmul(x, bias, quant.Plan(dense_above=8)), dense + bias)


def _toy_model() -> torch.nn.Module:
    """Two layer matrices and a table, marked as the model classes mark theirs."""
    model = torch.nn.Module()
    model.up, model.down, model.table = torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(96, 64, bias=False), \
        torch.nn.Embedding(40, 64)
    for name, role in (("up", "linear"), ("down", "linear"), ("table", "table")):
        getattr(model, name).quant_role = role
    return model


@pytest.mark.parametrize("bf16", [False, True])
def test_the_plan_is_a_fact_of_the_cpu(monkeypatch, bf16):
    """Dense copies (and a row count above which batches read them) only where oneDNN multiplies
    bf16 natively; on any other CPU every batch reads the codes and no copy is kept."""
    monkeypatch.setattr(quant, "native_bf16", lambda: bf16)
    if bf16:  # oneDNN lays bf16 out only on a CPU that has it: keep the copies plain here
        monkeypatch.setattr(quant, "_pack_dense", lambda w: w)
    model = _toy_model()
    summary = quant.quantize_model(model, "int8", 32)
    served = [model.up.weight, model.down.weight, model.table.weight]
    assert all(isinstance(w, quant.QuantizedMatrix) for w in served)
    if bf16:
        assert summary.plan == quant.Plan(quant.CODES_ROWS)
        assert [w.dense.dtype for w in served] == [torch.bfloat16, torch.bfloat16, torch.float32]  # the LM head's fp32
    else:
        assert summary.plan == quant.Plan() and all(w.dense is None for w in served)
        x = torch.randn(64, 96)  # a prefill-sized batch: the codes, as one row alone gives
        assert torch.equal(model.down.weight.matmul(x, None, summary.plan)[5:6], model.down.weight.kernel(x[5:6].clone()))
    assert summary.invariant_plan == quant.Plan()  # --deterministic: the codes whatever the CPU
    assert summary.weight_bytes == sum(w.nbytes for w in served)


def test_bad_quantization_options_are_named():
    with pytest.raises(ValueError, match="quantization must be one of"):
        ServerArgs(quantization="fp8")
    with pytest.raises(ValueError, match="quantization_group_size"):
        ServerArgs(quantization="int4", quantization_group_size=48)
