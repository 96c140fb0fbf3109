"""The torch attention backend against a naive per-request softmax over the same paged KV."""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime.cache.kv_pool import KVPool, ReqToTokenTable
from radixlm.runtime.worker.attention import torch_backend
from radixlm.runtime.worker.attention.torch_backend import TorchAttention
from radixlm.runtime.worker.forward_batch import ForwardBatch, ForwardMode

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


def _batch(prefix_lens, extend_lens, shared_prefix=0, groups=None, seed=0, consecutive=False):
    """A pool whose requests' rows start with common slots: request i belongs to group groups[i]
    (default: all to group 0), and each group's rows share their first `shared_prefix` slots
    (an int, or one per group); the rest are the row's own, random. One-token rows must come
    first, as the scheduler packs them."""
    groups = groups or [0] * len(prefix_lens)
    shared_lens = shared_prefix if isinstance(shared_prefix, list) else [shared_prefix] * (max(groups) + 1)
    g = torch.Generator().manual_seed(seed)
    pool = KVPool(1, SLOTS, KV_HEADS, DIM, torch.float32, "cpu")
    table = ReqToTokenTable(len(prefix_lens) + 1, 2048, "cpu")
    free = torch.arange(SLOTS) if consecutive else torch.randperm(SLOTS, generator=g)
    commons = []
    for length in shared_lens:
        commons.append(free[:length])
        free = free[length:]
    rows = []
    for pre, ext, grp in zip(prefix_lens, extend_lens, groups):
        row = table.alloc_row()
        own = pre + ext - shared_lens[grp]
        table.table[row, : pre + ext] = torch.cat([commons[grp], free[:own]])
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
    num_decode = next((i for i, e in enumerate(extend_lens) if e != 1), len(extend_lens))
    assert all(e != 1 for e in extend_lens[num_decode:]), "one-token rows come first"
    mode = ForwardMode.DECODE if num_decode == len(extend_lens) else ForwardMode.EXTEND
    fb = ForwardBatch(mode, torch.zeros(total, dtype=torch.int64), torch.zeros(total, dtype=torch.int64), out_slots,
                      rows_t, pre_t, ext_t, pre_t + ext_t, max(extend_lens), max(p + e for p, e in zip(prefix_lens, extend_lens)),
                      num_decode, pool, table, TorchAttention())
    return fb, q, k, v


def _check(fb, q, k, v):
    fb.attn_backend.prepare(fb)
    out = fb.attn_backend.forward(q, k, v, 0, 0.25, fb)
    ref = _naive(q, fb.kv_pool, 0, fb.req_to_token.table, fb.req_rows, fb.prefix_lens, fb.extend_lens, 0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    return out


@pytest.mark.parametrize("prefix_lens,extend_lens", [
    ([5, 0, 17], [1, 7, 30]),  # a one-token row, a fresh prompt, a chunk after a prefix
    ([40, 40], [3, 9]),
    ([0], [64]),
])
def test_extend_matches_naive(prefix_lens, extend_lens):
    _check(*_batch(prefix_lens, extend_lens))


@pytest.mark.parametrize("shared", [0, 40, 99])
def test_decode_with_and_without_cascade_matches_naive(shared, monkeypatch):
    prefix_lens = [100, 120, 99 if shared == 99 else 150, 180]
    fb, q, k, v = _batch(prefix_lens, [1] * 4, shared_prefix=shared)
    out = _check(fb, q, k, v)
    expect_cascade = shared >= torch_backend.CASCADE_MIN_PREFIX
    assert len(fb.attn_meta.shared) == expect_cascade
    if expect_cascade:
        # the common prefix is capped so the shortest request keeps its own last key
        assert fb.attn_meta.shared[0].slots.numel() == min(shared, min(prefix_lens))
        monkeypatch.setattr(torch_backend, "CASCADE_MIN_PREFIX", 10**9)  # and the plain path agrees with it
        fb.attn_backend.prepare(fb)
        assert not fb.attn_meta.shared
        plain = fb.attn_backend.forward(q, k, v, 0, 0.25, fb)
        torch.testing.assert_close(out, plain, atol=1e-5, rtol=1e-5)


def test_each_group_reads_its_shared_prefix_once():
    # three system prompts (two long, one too short to be worth a pass) and a request of its own
    groups = [0, 0, 0, 1, 1, 2, 2, 3]
    prefix_lens = [300, 310, 420, 64, 90, 40, 41, 200]
    fb, q, k, v = _batch(prefix_lens, [1] * 8, shared_prefix=[256, 48, 20, 0], groups=groups)
    _check(fb, q, k, v)
    shared = {tuple(s.rows.tolist()): s.slots.numel() for s in fb.attn_meta.shared}
    assert shared == {(0, 1, 2): 256, (3, 4): 48}
    assert all(s.first is None for s in fb.attn_meta.shared), "scattered slots are gathered, not viewed"
    own_keys = sum(int(b.mask.sum()) for b in fb.attn_meta.decode)
    assert own_keys == sum(p + 1 for p in prefix_lens) - 3 * 256 - 2 * 48  # each prefix read once, not per row


def test_a_shared_prefix_in_consecutive_slots_is_read_in_place():
    fb, q, k, v = _batch([100, 130, 170], [1, 1, 1], shared_prefix=96, consecutive=True)
    _check(fb, q, k, v)
    (shared,) = fb.attn_meta.shared
    assert shared.first == int(shared.slots[0]) and shared.slots.numel() == 96


def test_a_mixed_batch_matches_naive():
    # decode rows (two sharing a prefix) packed before a fresh prompt and a chunk after a prefix
    fb, q, k, v = _batch([80, 95, 7, 0, 40], [1, 1, 1, 12, 33], shared_prefix=[64, 0], groups=[0, 0, 1, 1, 1])
    _check(fb, q, k, v)
    assert fb.attn_meta.num_decode == 3 and len(fb.attn_meta.shared) == 1


def test_extend_rows_of_very_different_lengths_are_bucketed():
    fb, q, k, v = _batch([0, 0, 1500], [5, 9, 400])
    _check(fb, q, k, v)
    assert sorted(b.kv_slots.shape[0] for b in fb.attn_meta.extend) == [1, 2]  # not all padded to 1,900 keys
