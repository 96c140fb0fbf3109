"""The torch attention backend against a naive per-request softmax over the same paged KV."""

from __future__ import annotations

import pytest
import torch

from runtime.cache.kv_pool import KVPool, ReqToTokenTable
from runtime.worker.attention import torch_backend
from runtime.worker.attention.torch_backend import TorchAttention
from runtime.worker.forward_batch import ForwardBatch, ForwardMode

HEADS, KV_HEADS, DIM, SLOTS = 6, 2, 16, 4096


def _naive(q, pool, layer, table, rows, prefix_lens, extend_lens, scale):
    """Each new token attends to its request's keys 0..its own position, one request at a time."""
    outs, at = [], 0
    group = HEADS // KV_HEADS
    for row, pre, ext in zip(rows.tolist(), prefix_lens.tolist(), extend_lens.tolist()):
        slots = table[row, : pre + ext]
        k = pool.k[layer][slots].repeat_interleave(group, dim=1)  # [S, H, d]
        v = pool.v[layer][slots].repeat_interleave(group, dim=1)
        for j in range(ext):
            s = torch.einsum("hd,shd->hs", q[at + j], k[: pre + j + 1]) * scale
            outs.append(torch.einsum("hs,shd->hd", s.softmax(-1), v[: pre + j + 1]))
        at += ext
    return torch.stack(outs)


def _batch(prefix_lens, extend_lens, shared_prefix, seed=0):
    """A pool whose requests' rows start with `shared_prefix` common slots, the rest random."""
    g = torch.Generator().manual_seed(seed)
    pool = KVPool(1, SLOTS, KV_HEADS, DIM, torch.float32, "cpu")
    table = ReqToTokenTable(len(prefix_lens) + 1, 512, "cpu")
    free = torch.randperm(SLOTS, generator=g)
    common, free = free[:shared_prefix], free[shared_prefix:]
    rows = []
    for pre, ext in zip(prefix_lens, extend_lens):
        row = table.alloc_row()
        own = pre + ext - shared_prefix
        table.table[row, : pre + ext] = torch.cat([common, free[:own]])
        free = free[own:]
        rows.append(row)
    # cached prefix K/V already in the pool; the new tokens' K/V come with the step
    pool.k[0].copy_(torch.randn(SLOTS, KV_HEADS, DIM, generator=g))
    pool.v[0].copy_(torch.randn(SLOTS, KV_HEADS, DIM, generator=g))
    rows_t = torch.tensor(rows)
    pre_t, ext_t = torch.tensor(prefix_lens), torch.tensor(extend_lens)
    out_slots = torch.cat([table.table[r, p : p + e] for r, p, e in zip(rows, prefix_lens, extend_lens)])
    total = int(ext_t.sum())
    q = torch.randn(total, HEADS, DIM, generator=g)
    k, v = torch.randn(total, KV_HEADS, DIM, generator=g), torch.randn(total, KV_HEADS, DIM, generator=g)
    mode = ForwardMode.DECODE if all(e == 1 for e in extend_lens) else ForwardMode.EXTEND
    fb = ForwardBatch(mode, torch.zeros(total, dtype=torch.int64), torch.zeros(total, dtype=torch.int64), out_slots,
                      rows_t, pre_t, ext_t, pre_t + ext_t, max(extend_lens), max(p + e for p, e in zip(prefix_lens, extend_lens)),
                      pool, table, TorchAttention())
    return fb, q, k, v


@pytest.mark.parametrize("prefix_lens,extend_lens", [
    ([0, 5, 17], [7, 1, 30]),  # fresh prompt, a one-token extend, a chunk after a prefix
    ([40, 40], [3, 9]),
    ([0], [64]),
])
def test_extend_matches_naive(prefix_lens, extend_lens):
    fb, q, k, v = _batch(prefix_lens, extend_lens, shared_prefix=0)
    fb.attn_backend.prepare(fb)
    out = fb.attn_backend.forward(q, k, v, 0, 0.25, fb)
    ref = _naive(q, fb.kv_pool, 0, fb.req_to_token.table, fb.req_rows, fb.prefix_lens, fb.extend_lens, 0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shared", [0, 40, 99])
def test_decode_with_and_without_cascade_matches_naive(shared, monkeypatch):
    prefix_lens = [100, 120, 99 if shared == 99 else 150, 180]
    fb, q, k, v = _batch(prefix_lens, [1] * 4, shared_prefix=shared)
    fb.attn_backend.prepare(fb)
    expect_cascade = shared >= torch_backend.CASCADE_MIN_PREFIX
    assert (fb.attn_meta.shared_slots is not None) == expect_cascade
    if expect_cascade:
        # the common prefix is capped so the shortest request keeps its own last key
        assert fb.attn_meta.shared_slots.numel() == min(shared, min(prefix_lens))
    out = fb.attn_backend.forward(q, k, v, 0, 0.25, fb)
    ref = _naive(q, fb.kv_pool, 0, fb.req_to_token.table, fb.req_rows, fb.prefix_lens, fb.extend_lens, 0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if expect_cascade:  # and the plain path agrees with it
        monkeypatch.setattr(torch_backend, "CASCADE_MIN_PREFIX", 10**9)
        fb.attn_backend.prepare(fb)
        assert fb.attn_meta.shared_slots is None
        plain = fb.attn_backend.forward(q, k, v, 0, 0.25, fb)
        torch.testing.assert_close(out, plain, atol=1e-5, rtol=1e-5)
