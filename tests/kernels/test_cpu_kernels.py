"""The native CPU kernels (kernels/cpu) against their torch references, and every ISA path this
CPU runs against the portable one: bitwise, since each path sums in the same order (extend
attention's vector paths only to rounding: they fold the softmax a block of keys at a time).
The attention kernels on pools of every KV type (fp32, fp16, bf16, int8 with a scale per row):
each stored row bitwise torch's conversion, each read against the reference on the same rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from radixlm.kernels import cpu
from radixlm.kernels.cpu import build, reference as ref

cpu.load()
PATHS = list(range(cpu.best_isa() + 1))  # every path this CPU runs: portable (0) first
KV_TYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8]  # the pools' element types
SCALE = 0.13  # attention scale of the bitwise tests: no power of two, so that each product's order shows


def _matrix(gen: torch.Generator, n: int, k: int, bits: int, half: bool, with_zero: bool, group: int = 32):
    raw = torch.randint(0, 16, (n, k), generator=gen) if bits == 4 else torch.randint(-127, 128, (n, k), generator=gen)
    dtype = torch.float16 if half else torch.float32
    scale = (torch.rand(n, k // group, generator=gen) * 0.05).to(dtype)
    zero = (torch.randn(n, k // group, generator=gen) * 0.05).to(dtype) if with_zero else None
    return raw, cpu.tile(raw, scale, zero, bits), scale, zero


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 9), n=st.integers(1, 37), blocks=st.integers(1, 9), kind=st.sampled_from(["4", "8", "8 g16"]),
       half=st.booleans(), with_zero=st.booleans(), seed=st.integers(0, 2**16))
def test_quant_matmul_against_the_reference_and_across_paths(m, n, blocks, kind, half, with_zero, seed):
    gen = torch.Generator().manual_seed(seed)
    k = 32 * blocks
    bits, group = int(kind[0]), (16 if "g16" in kind else 32)  # groups of 16: Q6_K's, 8-bit codes, no zero points
    raw, tiled, scale, zero = _matrix(gen, n, k, bits, half, with_zero and group == 32, group)
    back = cpu.untile(tiled)  # the layout holds exactly what it was given
    assert torch.equal(back[0], raw.to(torch.int32)) and torch.equal(back[1], scale)
    assert (back[2] is None) == (zero is None) and (zero is None or torch.equal(back[2], zero))
    rows = torch.tensor([n - 1, 0, n // 2])
    assert torch.equal(cpu.untile(tiled, rows)[0], raw[rows].to(torch.int32))
    looked_up = raw[rows].float().view(3, -1, group) * scale[rows].float()[..., None]  # the embedding's lookup
    if zero is not None:
        looked_up = looked_up + zero[rows].float()[..., None]
    assert torch.equal(cpu.dequantize_rows(tiled, rows), looked_up.view(3, k))
    x = torch.randn(m, k, generator=gen) * 3
    portable = cpu.quant_matmul(x, tiled, isa=0)
    want = ref.quant_matmul(x, raw, scale.float(), None if zero is None else zero.float())
    # the reference is float64 on the same quantized activations: only fp32 accumulation differs, its
    # error a small multiple of fp32's epsilon (6e-8) times the sum of the terms' magnitudes (3,000
    # random draws came within 1e-5 of it, one hypothesis found past it: 3e-5 is the bound held)
    terms = ref.quant_matmul(x.abs(), raw.abs(), scale.float().abs(), None if zero is None else zero.float().abs()).abs()
    assert ((portable - want).abs() <= 3e-5 * terms + 1e-6).all(), (((portable - want).abs() - 1e-6) / terms).max()
    for isa in PATHS[1:]:
        assert torch.equal(cpu.quant_matmul(x, tiled, isa=isa), portable), cpu.ISA_NAMES[isa]
    # batch invariance: each row alone gives its row of the batch, bit for bit
    for i in range(m):
        assert torch.equal(cpu.quant_matmul(x[i : i + 1].clone(), tiled), portable[i : i + 1])


def test_prefill_sized_batches_span_activation_slices():
    """A batch longer than the rows a task takes at once (128 KB of 16-bit activations: 32 rows
    of 2,048 columns) gives every row what it gives alone, on every path, and the reference's
    values: the slices' outputs land in their own rows, the ragged last slice included."""
    gen = torch.Generator().manual_seed(7)
    k, m = 2048, 75
    for bits, with_zero in ((4, True), (8, False)):
        raw, tiled, scale, zero = _matrix(gen, 19, k, bits, True, with_zero)
        x = torch.randn(m, k, generator=gen)
        want = ref.quant_matmul(x, raw, scale.float(), None if zero is None else zero.float())
        terms = ref.quant_matmul(x.abs(), raw.abs(), scale.float().abs(), None if zero is None else zero.float().abs())
        for isa in PATHS:
            got = cpu.quant_matmul(x, tiled, isa=isa)
            assert ((got - want).abs() <= 1e-5 * terms.abs() + 1e-6).all(), cpu.ISA_NAMES[isa]
            for i in (0, 31, 32, 63, 64, 74):
                assert torch.equal(cpu.quant_matmul(x[i : i + 1].clone(), tiled, isa=isa), got[i : i + 1])


def test_the_8_bit_dot_has_no_overflow_at_the_extremes():
    codes = torch.full((3, 64), -127, dtype=torch.int8)
    x = torch.full((2, 64), -1.0)  # every activation code -32767: products at their largest
    scale = torch.ones(3, 2)
    for isa in PATHS:
        got = cpu.quant_matmul(x, cpu.tile(codes, scale, None, 8), isa=isa)
        assert torch.allclose(got, torch.full((2, 3), 64 * 127.0), rtol=1e-6)  # 64 x (-127 x -1)


@pytest.mark.parametrize("isa", PATHS)
def test_quantize_activations_is_the_references(isa):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 160, generator=gen) * 4
    x[2, :32] = 0  # an all-zero block: scale 0, codes 0
    x[3, 5] = 0.5 * (x[3, :32].abs().max() / 32767) * 3  # odd multiples of half a step: ties round to even
    q, d, s = cpu.quantize_activations(x, isa)
    rq, rd, rs = ref.quantize_activations(x)
    assert torch.equal(q, rq) and torch.equal(d, rd) and torch.equal(s, rs)


@pytest.mark.parametrize("dim", [576, 64, 100])
def test_rms_norm_with_and_without_the_residual(dim):
    gen = torch.Generator().manual_seed(dim)
    x, w, res = torch.randn(5, dim, generator=gen), torch.randn(dim, generator=gen), torch.randn(5, dim, generator=gen)
    portable = cpu.rms_norm(x, w, 1e-5, isa=0)
    assert torch.allclose(portable, ref.rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-6)
    for isa in PATHS[1:]:
        assert torch.equal(cpu.rms_norm(x, w, 1e-5, isa=isa), portable)
    residual = res.clone()
    out = cpu.rms_norm(x, w, 1e-5, residual)
    assert torch.equal(residual, res + x)  # added in place
    assert torch.allclose(out, ref.rms_norm(res + x, w, 1e-5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("isa", PATHS)
def test_silu_mul(isa):
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(6, 2 * 1539, generator=gen) * 6  # a ragged tail past the vector width
    g[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    got, want = cpu.silu_mul(g, isa=isa), ref.silu_mul(g)
    assert torch.allclose(got, want, rtol=2e-6, atol=1e-7), (got - want).abs().max()


def test_bad_arguments_are_named():
    x = torch.randn(2, 64)
    w = cpu.tile(torch.zeros(4, 64, dtype=torch.int64), torch.ones(4, 2), None, 4)
    op = torch.ops.radixlm.quant_matmul
    with pytest.raises(RuntimeError, match="multiple of 32 columns"):
        cpu.quant_matmul(torch.randn(2, 40), w)
    with pytest.raises(RuntimeError, match="tiles of a 4 x 64 matrix of 4-bit codes must be"):
        op(x, w.tiles[:, :1].contiguous(), 4, 4, 32, False, False)
    with pytest.raises(RuntimeError, match="tiles of a 9 x 64 matrix"):
        op(x, w.tiles, 9, 4, 32, False, False)  # 9 rows take two groups of tiles
    with pytest.raises(RuntimeError, match="4 or 8 bits"):
        op(x, w.tiles, 4, 2, 32, False, False)
    with pytest.raises(RuntimeError, match="groups of 32 columns \\(or 16, for 8-bit codes without zero points\\)"):
        op(x, w.tiles, 4, 4, 16, False, False)
    with pytest.raises(RuntimeError, match="float32 CPU tensor"):
        cpu.quant_matmul(x.double(), w)
    with pytest.raises(RuntimeError, match="not supported by this CPU"):
        cpu.quant_matmul(x, w, isa=len(cpu.ISA_NAMES) + 3)
    with pytest.raises(RuntimeError, match="row 4 outside a matrix of 4 rows"):
        cpu.dequantize_rows(w, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="not 4-bit in groups of 16"):
        cpu.tile(torch.zeros(4, 64, dtype=torch.int64), torch.ones(4, 4), None, 4)


def test_the_build_is_cached_and_keyed_by_sources_and_cpu(monkeypatch):
    key = build.build_key()
    library = build.cache_root() / key / f"radixlm_cpu_{key}.so"
    assert library.exists() and build.load() == str(library)  # loaded from the cache, not rebuilt
    monkeypatch.setattr(build, "cpu_flags", lambda: ["avx2", "avx512f"])
    assert build.build_key() != key  # another CPU kind: another build


def test_a_missing_compiler_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-c++")
    with pytest.raises(build.NativeBuildError, match="no-such-c\\+\\+.*--quantization none"):
        build._build("radixlm_cpu_test", tmp_path)


def test_smollm2s_own_tensors():
    """A Q4_1 layer matrix and the Q8_0 table of the embedded file, served from their codes: the
    kernel against the float64 product of gguf's own dequantization and the quantized input."""
    from radixlm.runtime.model_config import gguf_reader, resolve_model
    from radixlm.runtime.worker.loader import GGUFTensor
    from radixlm.runtime.worker.quant import QuantizedMatrix

    tensors = {t.name: t for t in gguf_reader(resolve_model(None).path).tensors}
    gen = torch.Generator().manual_seed(0)
    for name in ("blk.3.ffn_down.weight", "token_embd.weight"):
        t = GGUFTensor(tensors[name])
        rows = slice(0, 2048)
        blocks = t.blocks(rows, slice(None))
        served = QuantizedMatrix(blocks)
        x = torch.randn(3, t.shape[1], generator=gen)
        q, d, _ = ref.quantize_activations(x)
        xq = (q.double().view(3, -1, 32) * d.double()[..., None]).view(3, -1)
        want = xq @ t[rows].double().T
        got = served.kernel(x)
        assert (got - want).abs().max() < 1e-4 * want.abs().max(), name
        assert (got - x.double() @ t[rows].double().T).abs().max() < 1e-3 * want.abs().max()  # 16-bit inputs: near exact
        assert served.tiled.half  # the file's fp16 scales kept as they are


def _step(gen: torch.Generator, tokens: int, heads: int, kv_heads: int, d: int, slots: int = 300,
          dtype: torch.dtype = torch.float32):
    """A step's qkv rows and a layer's pools of `dtype` (random rows stored as the pool stores them)."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen)
    k_pool, v_pool = (ref.encode_kv(torch.randn(kv_heads, slots, d, generator=gen), dtype) for _ in range(2))
    return qkv, k_pool, v_pool


def _stored(qkv: torch.Tensor, heads: int, kv_heads: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k and v heads of qkv rows as [kv_heads, tokens, d]."""
    k = qkv[:, heads * d : (heads + kv_heads) * d].reshape(-1, kv_heads, d).transpose(0, 1)
    return k, qkv[:, (heads + kv_heads) * d :].reshape(-1, kv_heads, d).transpose(0, 1)


@pytest.mark.parametrize("dtype", KV_TYPES)
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 32), (8, 2, 24)])
def test_rope_store_rotates_in_place_and_writes_the_pool(heads, kv_heads, d, dtype):
    """The rotation against the reference's, and the pool rows each path writes bitwise torch's
    conversion of the rotated k and v (reference.encode_kv): every path rounds alike."""
    from radixlm.runtime.worker.layers import RotaryEmbedding

    gen = torch.Generator().manual_seed(heads)
    rotary = RotaryEmbedding(d, 512, 10000.0, None)
    qkv, k_pool, v_pool = _step(gen, 5, heads, kv_heads, d, dtype=dtype)
    positions, slots = torch.tensor([0, 7, 100, 511, 3]), torch.tensor([4, 9, 250, 0, 299])
    untouched = torch.ones(300, dtype=torch.bool)
    untouched[slots] = False
    want = [t.clone() for t in (qkv, k_pool, v_pool)]
    ref.rope_store(*want[:1], positions, rotary.cos2, rotary.sin2, *want[1:], slots, heads, kv_heads)
    for isa in PATHS:
        got = [t.clone() for t in (qkv, k_pool, v_pool)]
        cpu.rope_store(got[0], positions, rotary.cos2, rotary.sin2, got[1], got[2], slots, heads, kv_heads, isa=isa)
        assert torch.allclose(got[0], want[0], rtol=1e-6, atol=1e-6), (isa, (got[0] - want[0]).abs().max())
        for pool, before, rows in zip(got[1:], (k_pool, v_pool), _stored(got[0], heads, kv_heads, d)):
            assert torch.equal(pool[:, slots], ref.encode_kv(rows, dtype)), cpu.ISA_NAMES[isa]
            assert torch.equal(pool[:, untouched], before[:, untouched])  # no other slot written
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu.rope_store(qkv, positions, rotary.cos2, rotary.sin2, k_pool, v_pool, slots + 300, heads, kv_heads)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int8])
def test_the_pool_rounds_as_torch_at_the_edges(dtype):
    """Values where rounding is hard, stored by every path (rotary at position 0 is the identity):
    exact ties between two neighbours (to the even one), fp16's subnormals and the halfway point
    below its least one, values past fp16's largest (saturated to +-65504, not inf), bf16 carries
    into the exponent; an int8 row of zeros (scale 0) and rows whose largest value ties."""
    heads, kv_heads, d = 2, 2, 32
    half_ties = [1 + 2 ** -11, 1 + 3 * 2 ** -11, 2 ** -24 * 1.5, 2 ** -24 * 2.5, 2 ** -25, 2 ** -25 * 1.0001, 2 ** -26,
                 6e-8, 65504.0, 65519.0, 65520.0, 1e6, -1e30, 2 ** -14 * (1 - 2 ** -11)]
    bf16_ties = [1 + 2 ** -8, 1 + 3 * 2 ** -8, 3.4e38, (2 - 2 ** -8) * 2 ** 127, 1e-40, -0.0]
    gen = torch.Generator().manual_seed(0)
    edges = torch.tensor(half_ties + bf16_ties)
    rows = torch.randn(6, 2 * kv_heads * d, generator=gen) * torch.exp2(torch.randint(-30, 30, (6, 2 * kv_heads * d),
                                                                                     generator=gen).float())
    rows[0, : len(edges)] = edges
    rows[1, : len(edges)] = -edges
    rows[2, :d] = 0.0  # an int8 row of zeros
    rows[3, :d] = torch.tensor([3.0, -3.0] * (d // 2))  # ties for the largest magnitude
    qkv = torch.cat([torch.randn(6, heads * d, generator=gen), rows], 1)
    cos2, sin2 = torch.ones(1, d), torch.zeros(1, d)
    positions, slots = torch.zeros(6, dtype=torch.int64), torch.arange(6)
    k, v = _stored(qkv, heads, kv_heads, d)
    for isa in PATHS:
        k_pool, v_pool = (ref.encode_kv(torch.zeros(kv_heads, 6, d), dtype) for _ in range(2))
        cpu.rope_store(qkv.clone(), positions, cos2, sin2, k_pool, v_pool, slots, heads, kv_heads, isa=isa)
        assert torch.equal(k_pool, ref.encode_kv(k, dtype)), cpu.ISA_NAMES[isa]
        assert torch.equal(v_pool, ref.encode_kv(v, dtype)), cpu.ISA_NAMES[isa]
        if dtype == torch.float16:  # saturated (bf16 rounds past its largest to inf, as torch: fp32's range)
            assert ref.decode_kv(k_pool).isfinite().all() and ref.decode_kv(k_pool).abs().max() == 65504


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), group=st.sampled_from([1, 3]), d=st.sampled_from([16, 64, 24]), seed=st.integers(0, 999),
       window=st.sampled_from([0, 1, 5, 20]), softcap=st.sampled_from([0.0, 0.5]), sinks=st.booleans(),
       dtype=st.sampled_from(KV_TYPES))
def test_decode_attention_reads_the_pool_through_the_table(rows, group, d, seed, window, softcap, sinks, dtype):
    """Each row over its keys (a sliding layer's last `window`; scores soft-capped as Gemma 2's
    where `softcap`; a sink logit per head in each softmax as gpt-oss's where `sinks`) against
    the torch reference on the same stored rows, on every path this CPU runs, on pools of every
    KV type."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads = 2
    heads = kv_heads * group
    qkv, k_pool, v_pool = _step(gen, rows + 2, heads, kv_heads, d, dtype=dtype)
    table = torch.randperm(300, generator=gen)[: 8 * 37].view(8, 37)  # scattered slots, as pages are
    table_rows = torch.randperm(8, generator=gen)[:rows]
    lens = torch.randint(1, 38, (rows,), generator=gen)
    q = qkv[:, : heads * d]  # strided rows, as the model's qkv holds them
    sink = torch.randn(heads, generator=gen) * 2 if sinks else None
    want = ref.decode_attention(q, k_pool, v_pool, table, table_rows, lens, 0.125, window, softcap, sink)
    outs = [cpu.decode_attention(q, k_pool, v_pool, table, table_rows, lens, 0.125, isa=i, window=window,
                                 softcap=softcap, sinks=sink) for i in PATHS]
    for got in outs:
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()
    # batch invariance: each row alone gives its row of the batch, bit for bit
    for r in range(rows):
        alone = cpu.decode_attention(q[r : r + 1].clone(), k_pool, v_pool, table, table_rows[r : r + 1],
                                     lens[r : r + 1], 0.125, window=window, softcap=softcap, sinks=sink)
        assert torch.equal(alone, outs[-1][r : r + 1])


@pytest.mark.parametrize("dtype", KV_TYPES)
@pytest.mark.parametrize("group,d", [(3, 64), (2, 40), (4, 40), (8, 16)])
def test_grouped_decode_attention_is_bitwise_each_head_alone(group, d, dtype):
    """Enough rows and the AVX2 path reads each key once for its KV head's query heads (one task a
    (row, KV head)); a row alone takes one task a query head. Each head's output is the same bits.
    SmolLM2's 3 heads a KV head and 64 dimensions, and group sizes and widths that take the kernel's
    other key and dimension blockings with their ragged ends."""
    if cpu.best_isa() < 1:  # no feature missing: without AVX2 the dispatcher never takes the grouped kernel
        pytest.skip("the grouped kernel is the AVX2 path's; this CPU has no AVX2")
    gen = torch.Generator().manual_seed(7)
    rows, kv_heads = 24, 3  # 72 tasks, more than twice any thread count here
    assert rows * kv_heads >= 2 * torch.get_num_threads()
    qkv, k_pool, v_pool = _step(gen, rows, kv_heads * group, kv_heads, d, slots=rows * 23, dtype=dtype)
    table = torch.randperm(rows * 23, generator=gen)[: rows * 23].view(rows, 23)
    lens = torch.randint(1, 24, (rows,), generator=gen)
    q = qkv[:, : kv_heads * group * d]
    table_rows = torch.arange(rows)
    for window in (0, 7):  # all keys, and a sliding layer's last 7
        batch = cpu.decode_attention(q, k_pool, v_pool, table, table_rows, lens, SCALE, isa=1, window=window)
        want = ref.decode_attention(q, k_pool, v_pool, table, table_rows, lens, SCALE, window)
        assert torch.allclose(batch, want, rtol=1e-5, atol=1e-5), (window, (batch - want).abs().max())
        for r in range(rows):
            alone = cpu.decode_attention(q[r : r + 1].clone(), k_pool, v_pool, table, table_rows[r : r + 1],
                                         lens[r : r + 1], SCALE, isa=1, window=window)
            assert torch.equal(alone, batch[r : r + 1]), (window, r)


@pytest.mark.parametrize("dtype", KV_TYPES)
@pytest.mark.parametrize("group,d", [(3, 64), (2, 40), (5, 16)])
def test_rows_on_one_prompt_read_it_once_and_get_each_rows_bits(group, d, dtype):
    """Rows whose keys begin with the same 100 slots (requests on one cached prompt) are attended
    in sets that read those keys once; each row's output is bitwise its output alone, and near the
    torch reference. Beside them: rows of another prompt, a row that shares only 40 keys (too few
    for a set), rows alone; lengths ragged around the shared part's blocks."""
    if cpu.best_isa() < 1:  # no feature missing: without AVX2 the dispatcher never forms sets (the portable
        # path reads every row's keys itself, tested above against the same reference)
        pytest.skip("the grouped kernel is the AVX2 path's; this CPU has no AVX2")
    gen = torch.Generator().manual_seed(11)
    kv_heads, width, slots = 3, 190, 6000
    qkv, k_pool, v_pool = _step(gen, 26, kv_heads * group, kv_heads, d, slots=slots, dtype=dtype)
    free = torch.randperm(slots, generator=gen)
    prompts = [free[:100], free[100:180]]  # two cached prompts, 100 and 80 keys
    table = free[180 : 180 + 26 * width].view(26, width).clone()
    for r in range(12):
        table[r, :100] = prompts[0]
    for r in range(12, 20):
        table[r, :80] = prompts[1]
    table[20, :40] = prompts[0][:40]
    lens = torch.cat([torch.randint(100, width + 1, (12,), generator=gen), torch.randint(80, width + 1, (8,), generator=gen),
                      torch.randint(41, width + 1, (6,), generator=gen)])
    lens[0], lens[12] = 100, 80  # a row that is all prompt
    rows = torch.randperm(26, generator=gen)  # the sets' rows apart in the batch
    q = qkv[:, : kv_heads * group * d]
    batch = cpu.decode_attention(q, k_pool, v_pool, table, rows, lens[rows], SCALE, isa=1)
    want = ref.decode_attention(q, k_pool, v_pool, table, rows, lens[rows], SCALE)
    assert torch.allclose(batch, want, rtol=1e-5, atol=1e-5), (batch - want).abs().max()
    for i in range(26):
        alone = cpu.decode_attention(q[i : i + 1].clone(), k_pool, v_pool, table, rows[i : i + 1], lens[rows][i : i + 1],
                                     SCALE, isa=1)
        assert torch.equal(alone, batch[i : i + 1]), i
    # outside --deterministic the sets take the blocked kernel (extend_attention's), on every vector
    # path: the same attention to rounding, in another summation order (so not the exact bits)
    for isa in PATHS[1:]:
        blocked = cpu.decode_attention(q, k_pool, v_pool, table, rows, lens[rows], SCALE, isa=isa, exact=False)
        assert torch.allclose(blocked, want, rtol=1e-5, atol=1e-5), (cpu.ISA_NAMES[isa], (blocked - want).abs().max())
        assert not torch.equal(blocked, batch), "the sets took the exact kernel"


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 4), group=st.sampled_from([1, 3, 8]), d=st.sampled_from([16, 24, 40, 64, 128]),
       seed=st.integers(0, 999), window=st.sampled_from([0, 1, 7, 80]), softcap=st.sampled_from([0.0, 0.5]),
       sinks=st.booleans(), dtype=st.sampled_from(KV_TYPES))
def test_extend_attention_reads_the_pool_through_the_table(rows, group, d, seed, window, softcap, sinks, dtype):
    """Each new token of a prefill chunk over the keys up to its own position (the last `window`
    of them; capped scores; sink logits), read in place through the table, against the torch
    reference (each token a decode row of it), on every path this CPU runs. Chunks of 1-150
    tokens after cached prefixes of 0-200 keys: the vector paths' 64-key blocks and their tasks'
    token ranges cut across prefixes, windows and chunk ends at every offset. Not bitwise across
    paths: the vector paths fold the softmax a block at a time. Into a strided `out`, whose other
    columns stay untouched."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads, cols = 2, 360
    heads = kv_heads * group
    extend_lens = torch.randint(1, 151, (rows,), generator=gen)
    prefix_lens = torch.randint(0, 201, (rows,), generator=gen)
    tokens = int(extend_lens.sum())
    qkv, k_pool, v_pool = _step(gen, tokens, heads, kv_heads, d, slots=8 * cols, dtype=dtype)
    table = torch.randperm(8 * cols, generator=gen).view(8, cols)  # scattered slots, as pages are
    table_rows = torch.randperm(8, generator=gen)[:rows]
    q = qkv[:, : heads * d]  # strided rows, as the model's qkv holds them
    sink = torch.randn(heads, generator=gen) * 2 if sinks else None
    want = ref.extend_attention(q, k_pool, v_pool, table, table_rows, prefix_lens, extend_lens, 0.125, window, softcap,
                                sink)
    for isa in PATHS:
        wide = torch.full((tokens, heads * d + 5), 7.0)
        got = cpu.extend_attention(q, k_pool, v_pool, table, table_rows, prefix_lens, extend_lens, 0.125,
                                   out=wide[:, : heads * d], isa=isa, window=window, softcap=softcap, sinks=sink)
        assert torch.allclose(got, want, rtol=1e-5, atol=2e-5), (cpu.ISA_NAMES[isa], (got - want).abs().max())
        assert (wide[:, heads * d :] == 7.0).all()


def test_extend_attention_names_bad_arguments():
    gen = torch.Generator().manual_seed(3)
    qkv, k_pool, v_pool = _step(gen, 6, 4, 2, 16, slots=40)
    q, table = qkv[:, :64], torch.arange(40).view(2, 20)
    rows, prefix, ext = torch.tensor([0, 1]), torch.tensor([4, 0]), torch.tensor([2, 4])
    cpu.extend_attention(q, k_pool, v_pool, table, rows, prefix, ext, 0.25)  # as given: fine
    with pytest.raises(RuntimeError, match="q has 5 rows for the extend rows' 6 tokens"):
        cpu.extend_attention(q[:5], k_pool, v_pool, table, rows, prefix, ext, 0.25)
    with pytest.raises(RuntimeError, match="extend row 1 has no valid token-table row, prefix or length"):
        cpu.extend_attention(q, k_pool, v_pool, table, rows, torch.tensor([4, 17]), ext, 0.25)
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu.extend_attention(q, k_pool, v_pool, table + 30, rows, prefix, ext, 0.25)
    with pytest.raises(RuntimeError, match="out must be a float32 \\[6, 64\\]"):
        cpu.extend_attention(q, k_pool, v_pool, table, rows, prefix, ext, 0.25, out=torch.empty(6, 63))
    with pytest.raises(RuntimeError, match="not whole query heads"):
        cpu.extend_attention(qkv[:, :60], k_pool, v_pool, table, rows, prefix, ext, 0.25)
    with pytest.raises(RuntimeError, match="k_pool and v_pool must be of one type"):
        cpu.extend_attention(q, k_pool, v_pool.half(), table, rows, prefix, ext, 0.25)
    with pytest.raises(RuntimeError, match="2 x 12 \\(an int8 pool's rows: head_dim codes, then a 4-byte scale"):
        cpu.decode_attention(q, k_pool.to(torch.int8), v_pool.to(torch.int8), table, rows, prefix + 1, 0.25)
    with pytest.raises(RuntimeError, match="got Double"):
        cpu.rope_store(qkv, prefix, torch.ones(8, 16), torch.zeros(8, 16), k_pool.double(), v_pool.double(), prefix, 4, 2)


def _random_decoder(seed: int, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, d: int = 16,
                    inner: int = 96, slots: int = 64, dtype: torch.dtype = torch.float32):
    """A small decoder on random 4- and 8-bit codes (zero points on some, a qkv bias), its pools and tables."""
    g = torch.Generator().manual_seed(seed)

    def matrix(n: int, k: int, bits: int) -> cpu.Tiled:
        codes = torch.randint(0, 16, (n, k), generator=g) if bits == 4 else torch.randint(-128, 128, (n, k), generator=g)
        scale = (torch.rand(n, k // 32, generator=g) * 0.05).half()
        zero = -(torch.rand(n, k // 32, generator=g) * 0.2).half() if bits == 4 else None
        return cpu.tile(codes, scale, zero, bits)

    width = (heads + 2 * kv_heads) * d
    weights = []
    for layer in range(layers):
        bits = 4 if layer % 2 == 0 else 8
        m = [matrix(width, hidden, bits), matrix(hidden, heads * d, bits), matrix(2 * inner, hidden, bits),
             matrix(hidden, inner, bits)]
        weights += [1 + 0.1 * torch.randn(hidden, generator=g), m[0], torch.randn(width, generator=g), m[1],
                    1 + 0.1 * torch.randn(hidden, generator=g), m[2], m[3]]
    weights.append(1 + 0.1 * torch.randn(hidden, generator=g))
    pools = [[ref.encode_kv(torch.randn(kv_heads, slots, d, generator=g), dtype) for _ in range(layers)] for _ in range(2)]
    freqs = torch.outer(torch.arange(128).float(), 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))
    cos2, sin2 = torch.cat([freqs.cos()] * 2, -1), torch.cat([freqs.sin()] * 2, -1)
    return weights, pools, cos2, sin2, (heads, kv_heads, d)


def _decoder(weights, pools, cos2, sin2, dims, window=0, exact=True):
    """torch.classes.radixlm.Decoder over `weights` (tiled matrices as their tiles and formats)."""
    tensors = [w.tiles if isinstance(w, cpu.Tiled) else w for w in weights]
    formats = [f for w in weights if isinstance(w, cpu.Tiled) for f in w.format]
    return torch.classes.radixlm.Decoder(tensors, formats, pools[0], pools[1], cos2, sin2, *dims, 1e-5, dims[2] ** -0.5,
                                         window, exact)


def _decoder_by_ops(weights, pools, cos2, sin2, dims, h, positions, out_slots, table, rows, lens, isa, window=0,
                    exact=True):
    """The decoder's step composed of the library's ops, in the model's order (layers.py, llama.py)."""
    heads, kv_heads, d = dims
    eps, scale = 1e-5, d ** -0.5

    def linear(x, w, bias=None):
        y = cpu.quant_matmul(x, w, isa=isa)
        return y if bias is None else y + bias

    residual = h.clone()
    x = cpu.rms_norm(residual, weights[0], eps, isa=isa)
    for layer in range(len(pools[0])):
        w = weights[7 * layer : 7 * layer + 7]
        if layer:
            x = cpu.rms_norm(y, w[0], eps, residual, isa=isa)
        qkv = linear(x, w[1], w[2])
        cpu.rope_store(qkv, positions, cos2, sin2, pools[0][layer], pools[1][layer], out_slots, heads, kv_heads, isa=isa)
        attn = cpu.decode_attention(qkv[:, : heads * d], pools[0][layer], pools[1][layer], table, rows, lens, scale, isa=isa,
                                    window=window, exact=exact)
        y = linear(attn, w[3])
        x = cpu.rms_norm(y, w[4], eps, residual, isa=isa)
        y = linear(cpu.silu_mul(linear(x, w[5]), isa=isa), w[6])
    return cpu.rms_norm(y, weights[-1], eps, residual, isa=isa)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("rows,window,exact,dtype", [(1, 0, True, torch.float32), (3, 0, True, torch.float32),
                                                     (3, 6, True, torch.float32), (4, 0, False, torch.float32),
                                                     (3, 0, True, torch.float16), (4, 0, False, torch.bfloat16),
                                                     (3, 6, True, torch.int8), (4, 0, False, torch.int8)])
def test_the_decoder_is_its_ops_in_order(isa, rows, window, exact, dtype):
    """torch.classes.radixlm.Decoder (one call for a decode step's layers) against the same step
    composed of the ops, each tested above: the output and the pools it writes, bit for bit (and
    with a window for every layer, as a Mistral has), on pools of each KV type. The cases with
    four rows: on one 70-key prompt, outside --deterministic (`exact` False), where their
    attention may share key blocks."""
    cpu.load()
    weights, pools, cos2, sin2, dims = _random_decoder(rows, slots=512, dtype=dtype)
    table = torch.randperm(512).view(4, 128)
    table[:, :70] = table[0, :70]  # every row's first 70 keys: one cached prompt
    req_rows = torch.tensor([2, 0, 3, 1][:rows])
    lens = torch.tensor([9, 16, 5][:rows]) if exact else torch.tensor([90, 71, 128, 100])
    positions = lens - 1
    out_slots = table[req_rows, positions]
    h = torch.randn(rows, 64)
    mine = [[p.clone() for p in pools[0]], [p.clone() for p in pools[1]]]
    decoder = _decoder(weights, mine, cos2, sin2, dims, window, exact)
    got = decoder.forward(h, positions, out_slots, table, req_rows, lens, isa)
    want = _decoder_by_ops(weights, pools, cos2, sin2, dims, h, positions, out_slots, table, req_rows, lens, isa, window,
                           exact)
    assert torch.equal(got, want)
    for a, b in zip(mine[0] + mine[1], pools[0] + pools[1]):
        assert torch.equal(a, b)


def test_the_decoder_names_bad_arguments():
    cpu.load()
    weights, pools, cos2, sin2, dims = _random_decoder(0)
    with pytest.raises(RuntimeError, match="whole layers"):
        _decoder(weights[:-1], pools, cos2, sin2, dims)
    with pytest.raises(RuntimeError, match="qkv must have 128 rows"):
        _decoder([weights[0], weights[5]] + weights[2:], pools, cos2, sin2, dims)
    decoder = _decoder(weights, pools, cos2, sin2, dims)
    table = torch.arange(64).view(4, 16)
    one = torch.tensor([0])
    with pytest.raises(RuntimeError, match="outside the rotary tables"):
        decoder.forward(torch.randn(1, 64), torch.tensor([500]), one, table, one, torch.tensor([1]), -1)
    with pytest.raises(RuntimeError, match="outside the pool"):
        decoder.forward(torch.randn(1, 64), one, torch.tensor([64]), table, one, torch.tensor([1]), -1)
    with pytest.raises(RuntimeError, match="no valid token-table row"):
        decoder.forward(torch.randn(1, 64), one, one, table, one, torch.tensor([17]), -1)
    with pytest.raises(RuntimeError, match="h must have 64 columns"):
        decoder.forward(torch.randn(1, 32), one, one, table, one, torch.tensor([1]), -1)
