"""The KV pool's memory on a CPU: zero wherever it has not been written, and resident only where it
has; each KV type's rows and bytes."""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime.cache.kv_pool import KV_DTYPES, KVPool, kv_dtype


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


def test_every_kv_type_stores_rows_as_the_native_kernels_do():
    """`KVDtype.encode` (the torch backends' store, the KV tier's and the Triton store's input)
    bitwise the native kernels' conversion (kernels/cpu/reference.encode_kv, which the kernel
    tests hold every path to): ties, fp16's subnormals, values past fp16's range, int8 rows of
    zeros; and a stored row reads back within its type's rounding."""
    from radixlm.kernels.cpu.reference import encode_kv

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 40, generator=g) * torch.exp2(torch.randint(-28, 20, (64, 3, 40), generator=g).float())
    x[0, 0, :8] = torch.tensor([1 + 2 ** -11, 1 + 3 * 2 ** -11, 1 + 2 ** -8, 1.5 * 2 ** -24, 2 ** -25, 7e4, -1e9, 0.0])
    x[1, 2] = 0.0
    for name, tolerance in (("fp16", 2 ** -11), ("bf16", 2 ** -8), ("int8", None)):
        kv = KV_DTYPES[name]
        rows = kv.encode(x)
        assert rows.dtype == kv.storage and rows.shape == (64, 3, kv.row(40))
        assert torch.equal(rows, encode_kv(x, kv.storage)), name
        back = kv.decode(rows, torch.float32)
        if tolerance is None:  # int8: half a step of the row's scale
            bound = x.abs().amax(-1, keepdim=True) / 254 * (1 + 1e-6)
        else:  # relative, within fp16's range and above its subnormals
            bound = x.abs() * tolerance + (2 ** -25 if name == "fp16" else 0)
        inside = x.abs() <= 65504 if name == "fp16" else torch.ones_like(x, dtype=torch.bool)
        assert ((back - x).abs() <= bound)[inside].all(), name
    assert KV_DTYPES["fp16"].decode(KV_DTYPES["fp16"].encode(x), torch.float32).abs().max() == 65504  # saturated
    fp8 = KV_DTYPES["fp8_e4m3"].encode(x)
    assert fp8.dtype == torch.float8_e4m3fn and fp8.float().isfinite().all() and fp8.float().abs().max() == 448


def test_a_token_takes_its_types_bytes_and_the_pool_holds_them():
    """SmolLM2's 30 layers of 3 KV heads of 64: fp32 46,080 bytes a token, fp16 and bf16 half of it,
    int8 each row's 64 codes and 4-byte scale (3.76x fewer than fp32)."""
    sizes = {name: KVPool.bytes_per_token(30, 3, 64, name) for name in KV_DTYPES}
    assert sizes == {"fp32": 46080, "fp16": 23040, "bf16": 23040, "int8": 12240, "fp8_e4m3": 11520}
    for name in ("fp32", "bf16", "int8"):
        pool = KVPool(30, 16, 3, 64, name, "cpu")
        assert pool.token_bytes == sizes[name] and pool.k_heads[0].shape == (3, 16, KV_DTYPES[name].row(64))
        pool.store(4, torch.tensor([3]), torch.ones(1, 3, 64), torch.full((1, 3, 64), -2.0))
        assert torch.equal(pool.dtype.decode(pool.v_heads[4][:, 3], torch.float32), torch.full((3, 64), -2.0))
    with pytest.raises(ValueError, match="one of fp32, fp16, bf16, int8, fp8_e4m3, got 'fp4'"):
        kv_dtype("fp4")


def test_the_option_names_every_pool_type():
    from radixlm.runtime.args import KV_CACHE_DTYPES, ServerArgs

    assert set(KV_CACHE_DTYPES) == {"auto", *KV_DTYPES}
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp32, fp16, bf16, int8, fp8_e4m3"):
        ServerArgs(kv_cache_dtype="float16")
