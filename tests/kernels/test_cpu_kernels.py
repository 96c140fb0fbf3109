"""The native CPU kernels (kernels/cpu) against their torch references, and every ISA path this
CPU runs against the portable one: bitwise, since each path sums in the same order (extend
attention's vector paths only to rounding: they fold the softmax a block of keys at a time).
The attention kernels on pools of every KV type (fp32, fp16, bf16, int8 with a scale per row):
each stored row bitwise torch's conversion, each read against the reference on the same rows.
The quantized matmul's own tests: test_quant_kernels.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from radixlm.kernels import cpu
from radixlm.kernels.cpu import reference as ref

cpu.load()
PATHS = list(range(cpu.best_isa() + 1))  # every path this CPU runs: portable (0) first
KV_TYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8]  # the pools' element types
SCALE = 0.13  # attention scale of the bitwise tests: no power of two, so that each product's order shows


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


def test_rms_norm_names_bad_arguments():
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="weight must be a contiguous float32 \\[64\\] CPU tensor, got Float \\[64\\] on meta"):
        cpu.rms_norm(x, torch.ones(64, device="meta"), 1e-5)  # (a CUDA weight would be read on the host)
    with pytest.raises(RuntimeError, match="weight must be a contiguous float32 \\[64\\] CPU tensor, got Double"):
        cpu.rms_norm(x, torch.ones(64, dtype=torch.float64), 1e-5)
    with pytest.raises(RuntimeError, match="residual must be a contiguous 2-D float32 CPU tensor"):
        cpu.rms_norm(x, torch.ones(64), 1e-5, torch.zeros(2, 64, device="meta"))


@pytest.mark.parametrize("isa", PATHS)
def test_silu_mul(isa):
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(6, 2 * 1539, generator=gen) * 6  # a ragged tail past the vector width
    g[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    got, want = cpu.silu_mul(g, isa=isa), ref.silu_mul(g)
    assert torch.allclose(got, want, rtol=2e-6, atol=1e-7), (got - want).abs().max()


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
    into the exponent; an int8 row of zeros (scale 0), one too small for 127 / max|x| to be finite
    (zeros too: its codes would be undefined), and rows whose largest value ties."""
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
    rows[4, :d] = torch.linspace(-1e-38, 1e-38, d)  # 127 / max|x| overflows: an int8 row of zeros, scale 0
    qkv = torch.cat([torch.randn(6, heads * d, generator=gen), rows], 1)
    cos2, sin2 = torch.ones(1, d), torch.zeros(1, d)
    positions, slots = torch.zeros(6, dtype=torch.int64), torch.arange(6)
    k, v = _stored(qkv, heads, kv_heads, d)
    for isa in PATHS:
        k_pool, v_pool = (ref.encode_kv(torch.zeros(kv_heads, 6, d), dtype) for _ in range(2))
        cpu.rope_store(qkv.clone(), positions, cos2, sin2, k_pool, v_pool, slots, heads, kv_heads, isa=isa)
        assert torch.equal(k_pool, ref.encode_kv(k, dtype)), cpu.ISA_NAMES[isa]
        assert torch.equal(v_pool, ref.encode_kv(v, dtype)), cpu.ISA_NAMES[isa]
        if dtype == torch.int8:
            assert not k_pool[0, 4].any(), k_pool[0, 4]  # codes and scale's bytes
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
    (row, KV head)); a row alone takes one task a query head. Each head's output is the same bits,
    also with soft-capped scores and sinks (on these kernels too, not the portable one).
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
    sinks = torch.randn(kv_heads * group, generator=gen) * 2
    # all keys, a sliding layer's last 7, Gemma 2's capped scores, gpt-oss's sinks (with a window)
    for window, softcap, sink in ((0, 0.0, None), (7, 0.0, None), (0, 0.5, None), (0, 0.0, sinks), (7, 0.5, sinks)):
        case = dict(window=window, softcap=softcap, sinks=sink)
        batch = cpu.decode_attention(q, k_pool, v_pool, table, table_rows, lens, SCALE, isa=1, **case)
        want = ref.decode_attention(q, k_pool, v_pool, table, table_rows, lens, SCALE, window, softcap, sink)
        assert torch.allclose(batch, want, rtol=1e-5, atol=1e-5), (case, (batch - want).abs().max())
        for r in range(rows):
            alone = cpu.decode_attention(q[r : r + 1].clone(), k_pool, v_pool, table, table_rows[r : r + 1],
                                         lens[r : r + 1], SCALE, isa=1, **case)
            assert torch.equal(alone, batch[r : r + 1]), (case, r)
        # on the vector kernels (their sums in another order than the portable path's: other bits)
        assert not torch.equal(batch, cpu.decode_attention(q, k_pool, v_pool, table, table_rows, lens, SCALE, isa=0,
                                                           **case)), case


@pytest.mark.parametrize("dtype", KV_TYPES)
@pytest.mark.parametrize("group,d,special", [(3, 64, False), (2, 40, True), (5, 16, False), (8, 64, True)])
def test_rows_on_one_prompt_read_it_once_and_get_each_rows_bits(group, d, special, dtype):
    """Rows whose keys begin with the same 100 slots (requests on one cached prompt) are attended
    in sets that read those keys once; each row's output is bitwise its output alone, and near the
    torch reference. Beside them: rows of another prompt, a row that shares only 40 keys (too few
    for a set), rows alone; lengths ragged around the shared part's blocks. `special`: scores capped
    as Gemma 2's and a sink per head as gpt-oss's (its 8 query heads a KV head, 64 dimensions)."""
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
    softcap, sinks = (0.5, torch.randn(kv_heads * group, generator=gen) * 2) if special else (0.0, None)
    case = dict(softcap=softcap, sinks=sinks)
    batch = cpu.decode_attention(q, k_pool, v_pool, table, rows, lens[rows], SCALE, isa=1, **case)
    want = ref.decode_attention(q, k_pool, v_pool, table, rows, lens[rows], SCALE, 0, softcap, sinks)
    assert torch.allclose(batch, want, rtol=1e-5, atol=1e-5), (batch - want).abs().max()
    for i in range(26):
        alone = cpu.decode_attention(q[i : i + 1].clone(), k_pool, v_pool, table, rows[i : i + 1], lens[rows][i : i + 1],
                                     SCALE, isa=1, **case)
        assert torch.equal(alone, batch[i : i + 1]), i
    # outside --deterministic the sets take the blocked kernel (extend_attention's), on every vector
    # path: the same attention to rounding, in another summation order (so not the exact bits)
    for isa in PATHS[1:]:
        blocked = cpu.decode_attention(q, k_pool, v_pool, table, rows, lens[rows], SCALE, isa=isa, exact=False, **case)
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


MISMATCHES = {  # a pool made unlike the other in one way
    "fewer slots": lambda p: p[:, :-1].clone(),
    "another KV head count": lambda p: p[:-1].clone(),
    "another row width": lambda p: p[..., :-1].clone(),
    "another type": lambda p: p.half(),
    "strided": lambda p: p.transpose(0, 1).contiguous().transpose(0, 1),
    "no data (meta)": lambda p: torch.empty_like(p, device="meta"),
}


@pytest.mark.parametrize("pool", ["k_pool", "v_pool"])
@pytest.mark.parametrize("how", MISMATCHES)
def test_every_op_names_a_pool_unlike_the_other(pool, how):
    """A K or V pool of fewer slots (once written and read past its end), other heads or rows,
    another type, strided or without data: each op that reads the pools refuses it by name."""
    gen = torch.Generator().manual_seed(5)
    qkv, k_pool, v_pool = _step(gen, 3, 4, 2, 16, slots=40)
    pools = {"k_pool": k_pool, "v_pool": v_pool}
    pools[pool] = MISMATCHES[how](pools[pool])
    k, v = pools["k_pool"], pools["v_pool"]
    q, table, rows, lens = qkv[:, :64], torch.arange(40).view(2, 20), torch.tensor([0, 1]), torch.tensor([3, 5])
    weights, _, cos2, sin2, dims = _random_decoder(0, layers=1, slots=40)
    ops = {"rope_store": lambda: cpu.rope_store(qkv.clone(), torch.tensor([0, 1, 2]), cos2, sin2, k, v,
                                                torch.tensor([1, 2, 3]), 4, 2),
           "decode_attention": lambda: cpu.decode_attention(q, k, v, table, rows, lens, 0.25),
           "extend_attention": lambda: cpu.extend_attention(q, k, v, table, rows, torch.tensor([0, 4]),
                                                            torch.tensor([1, 2]), 0.25),
           "Decoder": lambda: _decoder(weights, [[k], [v]], cos2, sin2, dims)}
    for name, op in ops.items():
        with pytest.raises(RuntimeError, match="k_pool|v_pool"):
            op()


def _random_decoder(seed: int, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, d: int = 16,
                    inner: int = 96, slots: int = 64, dtype: torch.dtype = torch.float32):
    """A small decoder on random blocks of GGUF's formats (zero points on some, q and k in one format
    beside v in another, a qkv bias), its pools and tables."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)

    def matrix(n: int, k: int, kinds: list[str]) -> cpu.Tiled:
        size = -(-n // len(kinds))
        parts = [cpu.Part(kind, torch.from_numpy(ref.random_blocks(kind, size, k, rng)), torch.arange(min(size, n - i * size)))
                 for i, kind in enumerate(kinds)]
        return cpu.pack(parts, k)

    width = (heads + 2 * kv_heads) * d
    weights = []
    for layer in range(layers):
        kinds = ["Q4_1"] if layer % 2 == 0 else ["Q8_0", "Q4_0"]
        m = [matrix(width, hidden, kinds), matrix(hidden, heads * d, kinds), matrix(2 * inner, hidden, kinds),
             matrix(hidden, inner, kinds)]
        weights += [1 + 0.1 * torch.randn(hidden, generator=g), m[0], torch.randn(width, generator=g), m[1],
                    1 + 0.1 * torch.randn(hidden, generator=g), m[2], m[3]]
    weights.append(1 + 0.1 * torch.randn(hidden, generator=g))
    pools = [[ref.encode_kv(torch.randn(kv_heads, slots, d, generator=g), dtype) for _ in range(layers)] for _ in range(2)]
    freqs = torch.outer(torch.arange(128).float(), 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))
    cos2, sin2 = torch.cat([freqs.cos()] * 2, -1), torch.cat([freqs.sin()] * 2, -1)
    return weights, pools, cos2, sin2, (heads, kv_heads, d)


def _decoder(weights, pools, cos2, sin2, dims, window=0, exact=True):
    """torch.classes.radixlm.Decoder over `weights` (tiled matrices as their tiles and segments)."""
    tensors = [t for w in weights for t in ((w.tiles, w.segments) if isinstance(w, cpu.Tiled) else (w,))]
    rows = [w.rows for w in weights if isinstance(w, cpu.Tiled)]
    return torch.classes.radixlm.Decoder(tensors, rows, pools[0], pools[1], cos2, sin2, *dims, 1e-5, dims[2] ** -0.5,
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
    with pytest.raises(RuntimeError, match="qkv bias must be a contiguous float32 \\[128\\] CPU tensor, got Float "
                                           "\\[128\\] on meta"):
        _decoder(weights[:2] + [weights[2].to("meta")] + weights[3:], pools, cos2, sin2, dims)
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
