"""Quantized weights: the file's codes read exactly, each kernel against a dense oracle, the plan logic."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixlm.runtime.args import ServerArgs
from radixlm.runtime.worker import quant
from radixlm.runtime.worker.loader import GGUFTensor

BF16 = torch.bfloat16


def _gguf_tensors(tmp_path, kinds: tuple[str, ...], rows: int = 32, cols: int = 128):
    """A GGUF file holding one random [rows, cols] tensor per kind, quantized by the gguf package
    (so the blocks are laid out by its writer, not by us); returns {kind: (reader tensor, dequantized)}."""
    import gguf

    rng = np.random.default_rng(0)
    path = str(tmp_path / "t.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    for kind in kinds:
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "Q4_K":  # gguf cannot quantize to it: random blocks, with sane fp16 d and dmin
            raw = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
            raw[:, :, 0:4] = (rng.random((rows, cols // 256, 2)) * 0.01).astype(np.float16).view(np.uint8)
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


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q8_0"])
def test_gguf_blocks_are_the_files_own_values(tmp_path, kind):
    cols = 512 if kind == "Q4_K" else 128  # a K-quant block spans 256 columns
    raw, dense = _gguf_tensors(tmp_path, (kind,), cols=cols)[kind]
    t = GGUFTensor(raw)
    assert t.has_blocks and t.format == kind
    whole = t.blocks(slice(None), slice(None))
    assert whole.bits == (8 if kind == "Q8_0" else 4) and whole.group == 32
    assert whole.codes.min() >= (-128 if kind == "Q8_0" else 0) and whole.codes.max() <= (127 if kind == "Q8_0" else 15)
    assert torch.equal(whole.dequantize(), torch.from_numpy(dense))  # bit for bit gguf's own dequantization
    edge = 256 if kind == "Q4_K" else 32
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


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # the kernels return bf16: each output within bf16's rounding of its magnitude (plus sums' order)
    err = (got.float() - want).abs()
    assert float((err / (want.abs() + 1e-3)).max()) < 2e-2, float(err.max())


@pytest.mark.parametrize("group", [32, 64])
def test_int4_kernel_multiplies_by_the_codes(group):
    blocks = _blocks4(96, 256, group)
    m = quant.Int4Matrix(blocks)
    # the oracle: the same codes with the kernel's bf16 scale and zero, in fp32
    scale = blocks.scale.to(BF16).float()
    zero = (blocks.zero + 8 * blocks.scale).to(BF16).float() - 8 * scale
    w = quant.Blocks(blocks.codes, scale, zero, 4, group).dequantize()
    x = torch.randn(5, 256).to(BF16)
    _close(m.kernel(x), x.float() @ w.t())
    # and the codes are Q4_1's rule: every group's min and max come back (to rounding)
    assert (blocks.dequantize() - _blocks4(96, 256, group).dequantize()).abs().max() == 0


def test_int4_from_recovers_q4_1_codes(tmp_path):
    raw, dense = _gguf_tensors(tmp_path, ("Q4_1",))["Q4_1"]
    file = GGUFTensor(raw).blocks(slice(None), slice(None))
    again = quant.Blocks.int4_from(torch.from_numpy(dense), 32)
    assert (again.dequantize() - file.dequantize()).abs().max() < 1e-6


def test_group_int8_serves_q8_0_exactly(tmp_path):
    raw, dense = _gguf_tensors(tmp_path, ("Q8_0",))["Q8_0"]
    blocks = GGUFTensor(raw).blocks(slice(None), slice(None))
    m = quant.GroupInt8Matrix(blocks)
    # the oracle: the file's codes times their scale rounded to bf16 (the kernel's)
    w = quant.Blocks(blocks.codes, blocks.scale.to(BF16).float(), blocks.zero, 8, 32).dequantize()
    x = torch.randn(3, 128).to(BF16)
    _close(m.kernel(x), x.float() @ w.t())
    ids = torch.tensor([[0, 7], [31, 7]])
    assert torch.equal(m.embed(ids), w[ids])


def test_shapes_the_int4_kernel_cannot_take():
    assert quant.int4_fits(32, 128, 32) and not quant.int4_fits(24, 128, 32) and not quant.int4_fits(32, 100, 32)


def test_int8_per_row():
    torch.manual_seed(1)
    w = torch.randn(40, 64)
    m = quant.Int8Matrix(w)
    ref = m.codes.float() * m.scale.float()[:, None]
    assert ((ref - w).abs() <= m.scale.float()[:, None] * 0.5 + 1e-7).all()  # within half a step of its row
    x = torch.randn(2, 64).to(BF16)
    _close(m.kernel(x), x.float() @ ref.t())
    assert torch.equal(m.embed(torch.tensor([3, 39])), ref[[3, 39]])


def test_matmul_takes_the_dense_copy_above_the_plans_rows():
    blocks = _blocks4(64, 128, 32)
    source = blocks.dequantize()  # the dense copy holds the served values: the codes dequantized
    m = quant.Int4Matrix(blocks)
    m.settle(torch.float32)
    assert m.source is None and m.dense is not None
    x = torch.randn(9, 128)
    exact = x @ source.t()
    dense = m.matmul(x, None, quant.Plan(dense_above=8))  # 9 rows > 8: the fp32 copy
    codes = m.matmul(x, None, quant.Plan())
    assert (dense - exact).abs().max() < 1e-4
    assert (codes - exact).abs().max() > 1e-4  # bf16 activations: visibly another kernel
    bias = torch.randn(64)
    assert torch.allclose(m.matmul(x, bias, quant.Plan(dense_above=8)), dense + bias)


def test_plans_switch_at_the_first_row_count_a_dense_copy_wins():
    fp32, bf16 = torch.float32, torch.bfloat16
    timing = quant.Timing((1, 4, 16, 64), codes=(1.0, 2.0, 6.0, 20.0),
                          dense={fp32: (3.0, 3.5, 7.0, 18.0), bf16: (2.0, 2.5, 5.0, 9.0)})
    plan, invariant, dtype = timing.plans(invariant_rows=16)
    assert plan == quant.Plan(dense_above=15) and dtype == bf16  # bf16 is faster at prefill's sizes
    assert invariant == quant.Plan(dense_above=0)  # at 16 rows the dense copy wins: every batch on it
    slow_dense = quant.Timing((1, 16), codes=(1.0, 2.0), dense={fp32: (3.0, 4.0)})
    assert slow_dense.plans(invariant_rows=16) == (quant.Plan(), quant.Plan(), None)


def test_bad_quantization_options_are_named():
    with pytest.raises(ValueError, match="quantization must be one of"):
        ServerArgs(quantization="fp8")
    with pytest.raises(ValueError, match="quantization_group_size"):
        ServerArgs(quantization="int4", quantization_group_size=48)
