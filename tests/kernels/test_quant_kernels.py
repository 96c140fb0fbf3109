"""The native quantized matmul (kernels/cpu) on every block format it serves: a file's blocks laid
out as tiles read back as gguf reads them, products against the float64 reference, and every ISA
path this CPU runs bitwise the portable one (each sums in the same order), whatever the batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from radixlm.kernels import cpu
from radixlm.kernels.cpu import reference as ref

cpu.load()
FORMATS = list(cpu.SOURCES)
PATHS = list(range(cpu.best_isa() + 1))  # every path this CPU runs: portable (0) first


def _matrix(rng: np.random.Generator, kinds: list[str], rows: list[int], cols: int) -> tuple[cpu.Tiled, torch.Tensor]:
    """A matrix of one part per kind (its rows a segment of its own where the kind changes): its
    tiles, and its values by gguf's own reading of the same blocks."""
    parts, values = [], []
    for kind, n in zip(kinds, rows):
        raw = ref.random_blocks(kind, n + 3, cols, rng)
        order = rng.permutation(n + 3)[:n]  # rows picked out of order, as a permuted q/k is
        parts.append(cpu.Part(kind, torch.from_numpy(raw), torch.from_numpy(order)))
        values.append(ref.dequantize_blocks(kind, raw, cols)[order])
    return cpu.pack(parts, cols), torch.from_numpy(np.concatenate(values))


def _check_product(x: torch.Tensor, tiled: cpu.Tiled, values: torch.Tensor) -> torch.Tensor:
    """The portable path against the float64 reference, every other path bitwise the portable."""
    portable = cpu.quant_matmul(x, tiled, isa=0)
    want = ref.quant_matmul(x, values)
    # the reference is float64 on the same quantized activations: only fp32 accumulation differs, its
    # error a small multiple of fp32's epsilon (6e-8) times the sum of the terms' magnitudes
    terms = ref.quant_matmul(x.abs(), values.abs())
    assert ((portable - want).abs() <= 3e-5 * terms + 1e-6).all(), (((portable - want).abs() - 1e-6) / terms).max()
    for isa in PATHS[1:]:
        assert torch.equal(cpu.quant_matmul(x, tiled, isa=isa), portable), cpu.ISA_NAMES[isa]
    return portable


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 9), kinds=st.lists(st.sampled_from(FORMATS), min_size=1, max_size=3),
       rows=st.lists(st.integers(1, 37), min_size=3, max_size=3), blocks=st.integers(1, 3), seed=st.integers(0, 2**16),
       tiny=st.sampled_from([None, 1e-30, 1e-34, 1e-36, 1e-39, 1e-44]))
def test_every_format_against_the_reference_and_across_paths(m, kinds, rows, blocks, seed, tiny):
    """`tiny`: some activation blocks, and the first row whole, scaled down to that magnitude
    (below ~1e-34, 32767 / max|x| is no float: such blocks are zeros on every path)."""
    rng = np.random.default_rng(seed)
    cols = blocks * (256 if any(k in ref.K_FORMATS for k in kinds) else 32 * (1 + seed % 3))
    tiled, values = _matrix(rng, kinds, rows, cols)
    assert torch.equal(cpu.dequantize_rows(tiled, torch.arange(tiled.rows)), values)  # the layout holds the file's values
    picked = torch.tensor([[tiled.rows - 1, 0], [tiled.rows // 2, 0]])
    assert torch.equal(cpu.dequantize_rows(tiled, picked), values[picked])  # the embedding's lookup
    x = torch.from_numpy(rng.standard_normal((m, cols)).astype(np.float32)) * 3
    if tiny is not None:
        small = torch.from_numpy(rng.random((m, cols // 32, 1)) < 0.3).repeat_interleave(32, 1).view(m, cols)
        small[0] = True
        x = torch.where(small, x * tiny, x)
    portable = _check_product(x, tiled, values)
    # batch invariance: each row alone gives its row of the batch, bit for bit
    for i in range(m):
        assert torch.equal(cpu.quant_matmul(x[i : i + 1].clone(), tiled), portable[i : i + 1])


def test_prefill_sized_batches_span_activation_slices():
    """A batch longer than the rows a task takes at once (128 KB of 16-bit activations: 32 rows
    of 2,048 columns) gives every row what it gives alone, on every path, and the reference's
    values: the slices' outputs land in their own rows, the ragged last slice included."""
    rng = np.random.default_rng(7)
    cols, m = 2048, 75
    for kinds in (["Q4_1"], ["Q4_K", "Q6_K"], ["Q8_0"]):
        tiled, values = _matrix(rng, kinds, [19, 13], cols)
        x = torch.from_numpy(rng.standard_normal((m, cols)).astype(np.float32))
        got = _check_product(x, tiled, values)
        for isa in PATHS:
            for i in (0, 31, 32, 63, 64, 74):
                assert torch.equal(cpu.quant_matmul(x[i : i + 1].clone(), tiled, isa=isa), got[i : i + 1])


def test_the_dots_have_no_overflow_at_the_extremes():
    """Every code at its largest magnitude against activations at theirs (-32767 each): the 8-bit
    and Q6_K dots at their int32 limits come out exact."""
    x = torch.full((2, 256), -1.0)
    q8 = np.zeros((3, 8, 34), dtype=np.uint8)
    q8[:, :, :2] = np.array([1.0], np.float16).view(np.uint8)
    q8[:, :, 2:] = np.array([-128], np.int8).view(np.uint8)
    q6 = np.zeros((3, 1, 210), dtype=np.uint8)  # every 6-bit code 0 (value -32), every sub-scale -128, d 1
    q6[:, :, 192:208] = np.array([-128], np.int8).view(np.uint8)
    q6[:, :, 208:210] = np.array([1.0], np.float16).view(np.uint8)
    # each weight times each activation: Q8_0 -128 x -1; Q6_K (-128 x -32) x -1
    for kind, raw, each in (("Q8_0", q8, 128.0), ("Q6_K", q6, -4096.0)):
        tiled = cpu.pack([cpu.Part(kind, torch.from_numpy(raw.reshape(3, -1)), torch.arange(3))], 256)
        for isa in PATHS:
            got = cpu.quant_matmul(x, tiled, isa=isa)
            assert torch.allclose(got, torch.full((2, 3), 256 * each), rtol=1e-6), (kind, got)


@pytest.mark.parametrize("isa", PATHS)
def test_quantize_activations_is_the_references(isa):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 160, generator=gen) * 4
    x[2, :32] = 0  # an all-zero block: scale 0, codes 0
    x[3, 5] = 0.5 * (x[3, :32].abs().max() / 32767) * 3  # odd multiples of half a step: ties round to even
    # blocks too small for 32767 / max|x| to be a float (below ~1e-34: subnormals among them): zeros
    x[4, 32:64] = torch.linspace(-1e-35, 1e-35, 32)
    x[5, 64:96] = torch.linspace(-1e-40, 3e-45, 32)
    x[6, 96:128] = 1e-34  # the first max|x| whose inverse is finite: quantized as any block
    q, d, s = cpu.quantize_activations(x, isa)
    rq, rd, rs = ref.quantize_activations(x)
    assert torch.equal(q, rq) and torch.equal(d, rd) and torch.equal(s, rs)
    for row, block in ((2, 0), (4, 1), (5, 2)):
        assert not q[row, 32 * block : 32 * block + 32].any() and d[row, block] == 0 and s[row, block] == 0
    assert (q[6, 96:128] == 32767).all() and d[6, 3] == torch.tensor(1e-34) / 32767


def test_bad_arguments_are_named():
    rng = np.random.default_rng(0)
    w, _ = _matrix(rng, ["Q4_1"], [4], 64)
    x = torch.randn(2, 64)
    op = torch.ops.radixlm.quant_matmul
    with pytest.raises(RuntimeError, match="multiple of 32 columns"):
        cpu.quant_matmul(torch.randn(2, 40), w)
    with pytest.raises(RuntimeError, match="segment 0 runs past the tiles"):
        op(x, w.tiles[:10].contiguous(), w.segments, 4)
    with pytest.raises(RuntimeError, match="the segments hold 4 rows of a matrix of 9"):
        op(x, w.tiles, w.segments, 9)
    bad = w.segments.clone()
    bad[0, 3] = 11
    with pytest.raises(RuntimeError, match="segment 0 names no format"):
        op(x, w.tiles, bad, 4)
    with pytest.raises(RuntimeError, match="float32 CPU tensor"):
        cpu.quant_matmul(x.double(), w)
    with pytest.raises(RuntimeError, match="not supported by this CPU"):
        cpu.quant_matmul(x, w, isa=len(cpu.ISA_NAMES) + 3)
    with pytest.raises(RuntimeError, match="row 4 outside a matrix of 4 rows"):
        cpu.dequantize_rows(w, torch.tensor([0, 4]))
    raw = torch.from_numpy(ref.random_blocks("Q4_K", 4, 256, rng))
    with pytest.raises(RuntimeError, match="blocks of 256 columns do not make 288"):
        cpu.pack([cpu.Part("Q4_K", raw, torch.arange(4))], 288)
    with pytest.raises(RuntimeError, match="row 4 outside part 0's 4 rows"):
        cpu.pack([cpu.Part("Q4_K", raw, torch.tensor([0, 4]))], 256)
    with pytest.raises(RuntimeError, match=r"must be uint8 \[rows, >= 144 bytes\]"):
        cpu.pack([cpu.Part("Q4_K", raw[:, :100], torch.arange(4))], 256)


def test_smollm2s_own_tensors():
    """A Q4_1 layer matrix and the Q8_0 table of the embedded file, served from their blocks: the
    kernel against the float64 product of gguf's own dequantization and the quantized input."""
    from radixlm.runtime.model_config import gguf_reader, resolve_model
    from radixlm.runtime.worker.loader import GGUFTensor

    tensors = {t.name: t for t in gguf_reader(resolve_model(None).path).tensors}
    gen = torch.Generator().manual_seed(0)
    for name in ("blk.3.ffn_down.weight", "token_embd.weight"):
        t = GGUFTensor(tensors[name])
        rows = slice(0, 2048)
        served = cpu.pack([t.file_part(rows, slice(None))], t.shape[1])
        x = torch.randn(3, t.shape[1], generator=gen)
        want = ref.quant_matmul(x, t[rows])
        got = cpu.quant_matmul(x, served)
        assert (got - want).abs().max() < 1e-4 * want.abs().max(), name
        assert (got - x.double() @ t[rows].double().T).abs().max() < 1e-3 * want.abs().max()  # 16-bit inputs: near exact
        assert served.nbytes == served.rows * t.file_part(rows, slice(None)).data.shape[1]  # the file's own size
