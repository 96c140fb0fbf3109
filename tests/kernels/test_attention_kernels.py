"""The Triton kernels against their torch references (on a CPU: Triton's interpreter, small shapes).

Inputs are random (never zeros), the pool is paged with pages scattered at
random, and outputs start as NaN so an element a kernel fails to write fails.
Pools of the queries' dtype, and of every KV type beside fp32 queries.
"""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels.decode_attention import decode_attention, decode_attention_reference
from radixlm.kernels.cpu.reference import encode_kv
from radixlm.kernels.extend_attention import extend_attention, extend_attention_reference
from radixlm.kernels.kv_store import store_kv, store_kv_reference

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # ~ the output's rounding


def paged_table(seq_lens: list[int], page: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A token table whose rows hold each request's positions in pages scattered over the pool,
    rows in shuffled order; returns (table, rows, pool slots)."""
    pages_each = [-(-n // page) for n in seq_lens]
    num_pages = sum(pages_each) + 3  # some pages nobody uses
    order = torch.randperm(num_pages, generator=gen)
    width = max(pages_each) * page
    rows = torch.randperm(len(seq_lens) + 2, generator=gen)[: len(seq_lens)]
    table = torch.zeros(len(seq_lens) + 2, width, dtype=torch.int64)
    used = 0
    for row, n in zip(rows.tolist(), pages_each):
        pages = order[used:used + n]
        used += n
        table[row, : n * page] = (pages[:, None] * page + torch.arange(page)).flatten()
    return table, rows, num_pages * page


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def make_pool(slots: int, kv_heads: int, dim: int, dtype: torch.dtype, gen: torch.Generator):
    """K and V caches [slots, kv_heads, row] of random rows stored as a pool of `dtype` stores them."""
    return tuple(stored(torch.randn(slots, kv_heads, dim, generator=gen), dtype) for _ in range(2))


def stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float8_e4m3fn:  # (saturated at e4m3's largest, 448, as the runtime's pool stores it)
        return x.clamp(-448, 448).to(dtype)
    return encode_kv(x.float(), dtype) if dtype == torch.int8 else x.to(dtype)


# every dtype with each page size, every head shape with each page size and with two dtypes (the
# kernels' paths differ by these one at a time; the whole product ran 24 interpreted cases)
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
PAIRS = [(F32, 1, 0), (F16, 16, 0), (BF16, 1, 1), (F32, 16, 1), (F16, 1, 2), (BF16, 16, 2), (F32, 1, 3), (BF16, 16, 3)]


@pytest.mark.parametrize("dtype,page,group,dim", [(t, p, *[(1, 64), (3, 64), (4, 128), (8, 64)][s]) for t, p, s in PAIRS])
def test_extend_attention_matches_reference(dtype, page, group, dim):
    gen = torch.Generator().manual_seed(group * 100 + dim + page)
    kv_heads = 2
    heads = kv_heads * group
    prefix = [0, 1, page - 1 if page > 1 else 2, page, 40]  # none, one token, page edges, several pages
    extend = [5, 1, 17, 3, 37]  # (the last: query blocks past the first, each with whole key blocks, then its diagonal)
    table, rows, slots = paged_table([p + e for p, e in zip(prefix, extend)], page, gen)
    k_cache, v_cache = make_pool(slots, kv_heads, dim, dtype, gen)
    tokens = sum(extend)
    q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    args = (q, k_cache, v_cache, table, rows, torch.tensor(prefix), torch.tensor(extend), dim ** -0.5)
    out = torch.full_like(q, float("nan"))
    extend_attention(*args, out=out)
    ref = extend_attention_reference(*args)
    assert not out.isnan().any(), "some outputs were never written"
    assert relative_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype,page,group,dim,splits",
                         [(t, p, *[(1, 64, 4), (3, 64, 2), (4, 128, 8), (8, 64, 3)][s]) for t, p, s in PAIRS])
def test_decode_attention_matches_reference(dtype, page, group, dim, splits):
    gen = torch.Generator().manual_seed(group * 100 + dim + page + splits)
    kv_heads = 2
    heads = kv_heads * group
    seq_lens = [1, page, page + 1, 7, 70]  # shorter than the splits, page edges, long
    table, rows, slots = paged_table(seq_lens, page, gen)
    k_cache, v_cache = make_pool(slots, kv_heads, dim, dtype, gen)
    q = torch.randn(len(seq_lens), heads, dim, generator=gen).to(dtype)
    args = (q, k_cache, v_cache, table, rows, torch.tensor(seq_lens), dim ** -0.5)
    out = torch.full_like(q, float("nan"))
    decode_attention(*args, num_splits=splits, out=out)
    ref = decode_attention_reference(*args)
    assert not out.isnan().any(), "some outputs were never written"
    assert relative_error(out, ref) < TOLERANCE[dtype]


# KV types of a pool beside fp32 queries (the CPU's model dtype; on a GPU bf16 queries over an
# fp16 or fp8 pool take the same upcasting loads), with each page size
KV_PAIRS = [(torch.float16, 1), (torch.bfloat16, 16), (torch.int8, 1), (torch.int8, 16), (torch.float8_e4m3fn, 16)]


@pytest.mark.parametrize("kv_dtype,page", KV_PAIRS)
def test_both_kernels_read_pools_of_every_kv_type(kv_dtype, page):
    """fp32 queries over pools of fp16, bf16, int8 (codes, then each row's fp32 scale) and fp8
    e4m3 rows, against the references on the same stored rows: only fp32's rounding apart."""
    gen = torch.Generator().manual_seed(page + 7)
    kv_heads, group, dim = 2, 3, 64
    heads = kv_heads * group
    prefix, extend = [0, 5, 40], [7, 1, 12]
    table, rows, slots = paged_table([p + e for p, e in zip(prefix, extend)], page, gen)
    k_cache, v_cache = make_pool(slots, kv_heads, dim, kv_dtype, gen)
    q = torch.randn(sum(extend), heads, dim, generator=gen)
    args = (q, k_cache, v_cache, table, rows, torch.tensor(prefix), torch.tensor(extend), dim ** -0.5)
    out = extend_attention(*args, out=torch.full_like(q, float("nan")))
    assert relative_error(out, extend_attention_reference(*args)) < 1e-5
    seq_lens = torch.tensor(prefix) + torch.tensor(extend)
    args = (q[: len(prefix)], k_cache, v_cache, table, rows, seq_lens, dim ** -0.5)
    out = decode_attention(*args, num_splits=2, out=torch.full_like(q[: len(prefix)], float("nan")))
    assert relative_error(out, decode_attention_reference(*args)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
def test_store_kv_writes_exactly_the_given_slots(dtype):
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = make_pool(64, 2, 128, dtype, gen)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(64, generator=gen)[:9]
    k, v = (stored(torch.randn(9, 2, 128, generator=gen), dtype) for _ in range(2))  # rows in the pool's type
    store_kv(k_cache, v_cache, slots, k, v)
    store_kv_reference(expected_k, expected_v, slots, k, v)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_a_chunked_prefill_equals_the_whole_prefill():
    """A chunk is an extend whose prefix is the earlier chunks: two chunks give the whole's output."""
    gen = torch.Generator().manual_seed(5)
    n, split, heads, kv_heads, dim = 37, 20, 4, 2, 64
    table, rows, slots = paged_table([n], 16, gen)
    k_cache, v_cache = make_pool(slots, kv_heads, dim, torch.float32, gen)
    q = torch.randn(n, heads, dim, generator=gen)
    whole = extend_attention(q, k_cache, v_cache, table, rows, torch.tensor([0]), torch.tensor([n]), 0.125)
    first = extend_attention(q[:split], k_cache, v_cache, table, rows, torch.tensor([0]), torch.tensor([split]), 0.125)
    second = extend_attention(q[split:], k_cache, v_cache, table, rows, torch.tensor([split]), torch.tensor([n - split]),
                              0.125)
    assert relative_error(torch.cat([first, second]), whole) < 1e-5
