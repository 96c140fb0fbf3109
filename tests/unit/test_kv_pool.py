"""The KV pool's memory on a CPU: zero wherever it has not been written, and resident only where it has."""

from __future__ import annotations

import torch

from radixlm.runtime.cache.kv_pool import KVPool


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_cpu_pool_is_zero_and_costs_memory_only_where_written():
    before = _resident_bytes()
    layers, slots, heads, dim = 8, 1 << 17, 4, 64  # 8 x 2 x 128 MiB = 2 GiB of fp32 K and V
    pool = KVPool(layers, slots, heads, dim, torch.float32, "cpu")
    assert _resident_bytes() - before < 64 << 20  # torch.zeros would have written all 2 GiB
    k, v = torch.randn(3, heads, dim), torch.randn(3, heads, dim)
    written = torch.tensor([5, 77, slots - 1])
    pool.store(2, written, k, v)
    assert torch.equal(pool.k[2][written], k) and torch.equal(pool.v[2][written], v)
    assert int(torch.count_nonzero(pool.k_heads[2])) == int(torch.count_nonzero(k))  # the rest reads zero
    assert int(torch.count_nonzero(pool.v_heads[0])) == 0
    assert _resident_bytes() - before < 128 << 20


def test_a_bf16_pool_keeps_its_dtype_and_layout():
    pool = KVPool(2, 64, 3, 16, torch.bfloat16, "cpu")
    assert pool.k_heads[0].dtype == torch.bfloat16 and pool.k_heads[0].shape == (3, 64, 16)
    assert pool.k[1].shape == (64, 3, 16) and pool.k_heads[0].is_contiguous()
    assert pool.k_heads[0].data_ptr() != pool.k_heads[1].data_ptr() != pool.v_heads[0].data_ptr()
    pool.store(1, torch.tensor([9]), torch.ones(1, 3, 16, dtype=torch.bfloat16), torch.full((1, 3, 16), 2.0, dtype=torch.bfloat16))
    assert float(pool.v[1][9].sum()) == 96.0 and float(pool.k_heads[1].sum()) == 48.0
