"""Attention over the paged KV pool in torch ops, ragged: no row is padded to the batch's longest.

A step's packed batch has its one-token rows first (decodes, and prompts whose last token is
all that is left) and then its extend rows (prefill chunks, jump-forward text); the two take
different paths, and everything either path indexes is built once per step (`prepare`) and
reused by every layer.

Decode rows. The query heads that share a KV head attend as one [group, d] block, so K/V are
never repeated per head. Rows whose contexts begin with the same slots (the radix cache hands
requests with a common prompt the same pages) form a group: the group's shared prefix is read
once, all its queries against it in one matmul, and each row gathers only its own suffix;
the two partial softmaxes are merged by their log-sum-exp ("cascade" attention, per group:
four system prompts in one batch are four groups). The suffixes are split into length buckets,
each padded only to its own longest (a 20-token chat next to a 1,500-token document), choosing
the split that minimizes the keys gathered plus a fixed cost per bucket. When no row shares a
prefix (no log-sum-exp to merge), each bucket goes to torch's fused attention instead, and a lone
row whose slots are consecutive (one stream) reads its keys in place: at batch 1 that took
SmolLM2's attention from 80 to 40 us a layer.

Extend rows go to torch's scaled_dot_product_attention with a causal mask, in length buckets
chosen the same way, each padded to its own longest query and context.

Rows are read in the pool's type (`--kv-cache-dtype`) and converted to the compute dtype once
gathered (`KVDtype.decode`: a 16-bit pool's rows upcast, an int8 row's codes times its scale); a
pool of the compute dtype is read as it lies, with no copy.

Sliding layers (Gemma, Mistral) get their own plan, built at the first such layer of a step and
kept in fb.window_meta: a decode row's keys start `window` before its end (no shared-prefix pass:
a prefix leaves every long row's window), an extend row's mask also hides keys a window or more
behind each query. Soft-capped scores (Gemma 2) and sinks (gpt-oss: a logit per head in every
softmax's denominator) take the same steps in plain ops, as torch's fused attention has neither;
under the cascade a sink rescales each merged row by its share, sigmoid(lse - sink).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from radixlm.runtime.cache.kv_pool import KVDtype
from radixlm.runtime.utils import ragged_arange
from radixlm.runtime.worker.attention.base import AttentionBackend
from radixlm.runtime.worker.forward_batch import ForwardBatch

# Shortest common prefix worth the cascade's second pass (tokens).
CASCADE_MIN_PREFIX = 32
# What one more bucket costs, in padded keys: its own gathers, mask and attention call per layer.
BUCKET_COST_KEYS = 512
# Candidate bucket edges: where the sorted context lengths cross a power of this ratio.
BUCKET_GRID = 1.25


class DecodeBucket(NamedTuple):
    rows: torch.Tensor  # [b] positions among the decode rows
    kv_slots: torch.Tensor  # [b, K] slots of each row's own keys (padding points at a real, masked slot)
    mask: torch.Tensor | None  # [b, 1, K] True where the key is the row's (None: every key is)
    index: torch.Tensor  # head_index(kv_slots)
    first: int | None  # a lone row's first slot when its slots are consecutive: read in place


class SharedPrefix(NamedTuple):
    rows: torch.Tensor  # [n] positions among the decode rows
    slots: torch.Tensor  # [L] the slots every one of them starts with
    index: torch.Tensor  # head_index(slots)
    first: int | None  # the first slot when they are consecutive (a prompt prefilled at once): read in place


class ExtendBucket(NamedTuple):
    tokens: torch.Tensor  # [t] packed indices of the bucket's new tokens
    query_dest: torch.Tensor  # [t] where each sits in the bucket's [b * Qmax] padded queries
    kv_slots: torch.Tensor  # [b, K]
    mask: torch.Tensor  # [b, 1, Qmax, K] True where attention is allowed
    max_query: int
    index: torch.Tensor  # head_index(kv_slots)


class TorchAttnMeta(NamedTuple):
    num_decode: int
    decode: list[DecodeBucket]
    shared: list[SharedPrefix]
    extend: list[ExtendBucket]


class TorchAttention(AttentionBackend):
    def prepare(self, fb: ForwardBatch) -> None:
        table, d = fb.req_to_token.table, fb.num_decode
        heads = fb.kv_pool.k_heads[0].shape[0], fb.kv_pool.num_slots
        decode, shared = _prepare_decode(table, fb.req_rows[:d], fb.seq_lens[:d], heads) if d else ([], [])
        extend = prepare_extend(table, fb, d, heads) if d < fb.batch_size else []
        fb.attn_meta = TorchAttnMeta(d, decode, shared, extend)

    def _window_meta(self, fb: ForwardBatch, window: int) -> TorchAttnMeta:
        if window not in fb.window_meta:
            table, d = fb.kv_layout(window)[0], fb.num_decode
            heads = fb.kv_pool.k_heads[0].shape[0], fb.kv_pool.num_slots
            decode = _prepare_decode(table, fb.req_rows[:d], fb.seq_lens[:d], heads, window)[0] if d else []
            extend = prepare_extend(table, fb, d, heads, window) if d < fb.batch_size else []
            fb.window_meta[window] = TorchAttnMeta(d, decode, [], extend)
        return fb.window_meta[window]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
                fb: ForwardBatch, window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        fb.kv_pool.store(layer, fb.kv_layout(window)[1], k, v)
        meta: TorchAttnMeta = fb.attn_meta if window is None else self._window_meta(fb, window)
        pools = Pools(fb.kv_pool.k_heads[layer], fb.kv_pool.v_heads[layer], fb.kv_pool.dtype)
        d = meta.num_decode
        if not meta.extend:
            return _decode(q, pools, scale, meta, softcap, sinks)
        out = torch.empty_like(q)
        if d:
            out[:d] = _decode(q[:d], pools, scale, meta, softcap, sinks)
        extend_attention(q, pools, scale, meta.extend, out, softcap, sinks)
        return out


class Pools(NamedTuple):
    """A layer's head-major K and V pools [kv_heads, slots, row] and their type."""

    k: torch.Tensor
    v: torch.Tensor
    dtype: KVDtype

    def heads(self, index: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V rows at `index` (head_index of slots of `shape`) as `dtype`: [kv_heads, *shape, d] each."""
        return (self.dtype.decode(gather_heads(self.k, index, shape), dtype),
                self.dtype.decode(gather_heads(self.v, index, shape), dtype))

    def span(self, first: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots first..first + n - 1 of every KV head, read in place where the pool holds `dtype`:
        [kv_heads, n, d] each."""
        return (self.dtype.decode(self.k[:, first : first + n], dtype),
                self.dtype.decode(self.v[:, first : first + n], dtype))


def attend(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float,
           softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of [b, heads, Q, d] queries over [b, kv_heads, K, d] keys (mask: True where
    allowed, broadcast to [b, heads, Q, K]): torch's fused attention, or with soft-capped scores
    or sinks ([heads]: one more logit in each softmax, with no value) the same steps in plain ops."""
    gqa = queries.shape[1] != keys.shape[1]
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if gqa:
        group = queries.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = soft_cap(torch.matmul(queries, keys.transpose(-1, -2)) * scale, softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), values)
    b, heads, q_len, _ = scores.shape
    sink = sinks.to(scores.dtype).view(1, heads, 1, 1).expand(b, heads, q_len, 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, values)


def extend_attention(q: torch.Tensor, pools: Pools, scale: float, buckets: list[ExtendBucket], out: torch.Tensor,
                     softcap: float | None = None, sinks: torch.Tensor | None = None) -> None:
    """The extend rows' attention (their K/V already in the pool), into out [T, heads, d]: torch's
    fused attention per length bucket, causal within the new tokens."""
    heads, dim = q.shape[1], q.shape[2]
    for b in buckets:
        rows = b.kv_slots.shape[0]
        keys, values = (t.transpose(0, 1) for t in pools.heads(b.index, b.kv_slots.shape, q.dtype))
        padded = q.new_zeros(rows * b.max_query, heads, dim)
        padded[b.query_dest] = q[b.tokens]
        queries = padded.view(rows, b.max_query, heads, dim).transpose(1, 2)
        o = attend(queries, keys, values, b.mask, scale, softcap, sinks)
        out[b.tokens] = o.transpose(1, 2).reshape(-1, heads, dim)[b.query_dest]


def _decode(q: torch.Tensor, pools: Pools, scale: float, meta: TorchAttnMeta, softcap: float | None = None,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [D, heads, d]: each decode row's one query over its whole context. The pools are
    head-major [kv_heads, slots, row]; every product below is a bmm over (KV head, row) pairs
    that reads the gathered keys as they lie."""
    if not meta.shared:
        return _decode_own(q, pools, scale, meta.decode, softcap, sinks)
    rows, heads, dim = q.shape
    kv_heads = pools.k.shape[0]
    group = heads // kv_heads
    qg = q.float().view(rows, kv_heads, group, dim).transpose(0, 1) * scale  # [kv_heads, D, g, d]
    out = qg.new_empty(kv_heads, rows, group, dim)
    lse = qg.new_empty(kv_heads, rows, group, 1) if meta.shared else None
    for b in meta.decode:  # each row's own keys (all of them, for rows in no shared group)
        n, width = b.kv_slots.shape
        keys, values = pools.heads(b.index, b.kv_slots.shape, torch.float32)
        keys, values = keys.reshape(kv_heads * n, width, dim), values.reshape(kv_heads * n, width, dim)
        queries = qg[:, b.rows].reshape(kv_heads * n, group, dim)
        scores = soft_cap(torch.bmm(queries, keys.transpose(1, 2)), softcap).view(kv_heads, n, group, width)
        if b.mask is not None:
            scores = scores.masked_fill_(~b.mask, float("-inf"))
        o, m, l = _partial_softmax(scores.view(kv_heads * n, group, width), values)
        out[:, b.rows] = o.view(kv_heads, n, group, dim)
        if lse is not None:
            lse[:, b.rows] = (m + l.log()).view(kv_heads, n, group, 1)
    for s in meta.shared:  # a group's common prefix, once for all its queries
        n = s.rows.shape[0]
        if s.first is not None:  # a view of the pool: no copy of the prefix at all (in its type)
            keys, values = pools.span(s.first, s.slots.shape[0], torch.float32)  # [kv_heads, L, d]
        else:
            keys, values = pools.heads(s.index, s.slots.shape, torch.float32)
        queries = qg[:, s.rows].reshape(kv_heads, n * group, dim)
        o, m, l = _partial_softmax(soft_cap(torch.bmm(queries, keys.transpose(1, 2)), softcap), values)  # [kv_heads, n g, L]
        o, m, l = (t.view(kv_heads, n, group, -1) for t in (o, m, l))
        own_lse = lse[:, s.rows]
        top = torch.maximum(own_lse, m)
        w_own, w_shared = torch.exp(own_lse - top), torch.exp(m - top) * l
        out[:, s.rows] = (out[:, s.rows] * w_own + o * w_shared) / (w_own + w_shared)
        lse[:, s.rows] = top + torch.log(w_own + w_shared)
    if sinks is not None:  # each row's output scaled by the share of its softmax the keys hold
        out *= torch.sigmoid(lse - sinks.float().view(kv_heads, 1, group, 1))
    return out.transpose(0, 1).reshape(rows, heads, dim).to(q.dtype)


def soft_cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2's cap on attention scores: softcap * tanh(score / softcap) (None: none)."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def _decode_own(q: torch.Tensor, pools: Pools, scale: float, buckets: list[DecodeBucket],
                softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode rows in no shared group: torch's fused attention per bucket, on keys gathered
    once (or, for a lone row whose slots are consecutive, on a view of the pool: no copy)."""
    rows, heads, dim = q.shape
    out = None if rows == 1 else torch.empty_like(q)  # one row: its bucket's output is the answer
    for b in buckets:
        n, width = b.kv_slots.shape
        if b.first is not None:
            keys, values = (t[None] for t in pools.span(b.first, width, q.dtype))  # [1, kv_heads, K, d]
        else:
            keys, values = (t.transpose(0, 1) for t in pools.heads(b.index, b.kv_slots.shape, q.dtype))
        queries = (q if out is None else q[b.rows]).view(n, heads, 1, dim)
        mask = None if b.mask is None else b.mask[:, None]
        o = attend(queries, keys, values, mask, scale, softcap, sinks).view(n, heads, dim)
        if out is None:
            return o
        out[b.rows] = o
    return out


def _partial_softmax(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax-weighted values over the last axis of `scores`, with the running max and
    normaliser that let two such partial results be merged exactly."""
    m = scores.amax(dim=-1, keepdim=True)
    p = torch.exp(scores - m)
    denom = p.sum(dim=-1, keepdim=True)
    return torch.matmul(p, values) / denom, m, denom


def gather(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows `slots` (any shape) of one layer's pool [slots, kv_heads, row]: index_select on the
    flat indices, about 4x faster on CPU than advanced indexing (`pool[slots]`)."""
    return torch.index_select(pool, 0, slots.reshape(-1)).view(*slots.shape, *pool.shape[1:])


def head_index(slots: torch.Tensor, kv_heads: int, num_slots: int) -> torch.Tensor:
    """Flat row indices of `slots` in every KV head of a head-major pool viewed as [kv_heads * slots, d]."""
    return (torch.arange(kv_heads, device=slots.device)[:, None] * num_slots + slots.reshape(1, -1)).reshape(-1)


def gather_heads(pool: torch.Tensor, index: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Rows of a head-major pool [kv_heads, slots, row] at `index` (head_index of slots of `shape`):
    [kv_heads, *shape, row]. One index_select over the flat view, several times faster on CPU than
    selecting along the slot dimension."""
    return torch.index_select(pool.view(-1, pool.shape[2]), 0, index).view(pool.shape[0], *shape, pool.shape[2])


# ---- per-step plans ----------------------------------------------------------------------------

def _prepare_decode(table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, heads: tuple[int, int],
                    window: int | None = None) -> tuple[list[DecodeBucket], list[SharedPrefix]]:
    """`heads`: the pool's (KV heads, slots), for the gathers' flat indices. `window`: each row's
    keys are its last `window` (a sliding layer's)."""
    if window is not None:
        starts, shared = (seq_lens - window).clamp(min=0), []
    else:
        starts = torch.zeros_like(seq_lens)
        shared = _shared_prefixes(table, rows, seq_lens, heads) if rows.shape[0] > 1 else []
    for s in shared:
        starts[s.rows] = s.slots.shape[0]
    own = (seq_lens - starts).tolist()
    buckets = []
    for positions in _length_buckets(own):
        index = torch.tensor(positions, device=rows.device)
        longest = max(own[i] for i in positions)
        key_pos = starts[index, None] + torch.arange(longest, device=rows.device)[None, :]
        visible = key_pos < seq_lens[index, None]
        slots = table[rows[index, None], key_pos.clamp(max=table.shape[1] - 1)]
        slots = torch.where(visible, slots, slots[:, :1])  # padding reads the row's first own key, masked
        first = None
        if len(positions) == 1 and bool((slots[0, 1:] - slots[0, :-1] == 1).all()):
            first = int(slots[0, 0])
        mask = None if len(positions) == 1 or bool(visible.all()) else visible[:, None, :]
        buckets.append(DecodeBucket(index, slots, mask, head_index(slots, *heads), first))
    return buckets, shared


def _shared_prefixes(table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                     heads: tuple[int, int]) -> list[SharedPrefix]:
    """Groups of decode rows that start with the same slot, and the prefix each group shares
    (capped so that every row keeps at least its last key as its own)."""
    first = table[rows, 0]
    _, group_of, counts = torch.unique(first, return_inverse=True, return_counts=True)
    out = []
    for g in torch.nonzero(counts > 1).flatten().tolist():
        members = torch.nonzero(group_of == g).flatten()
        length = _common_prefix_len(table, rows[members], seq_lens[members])
        if length >= CASCADE_MIN_PREFIX:
            slots = table[rows[members[0]], :length]
            consecutive = bool((slots[1:] - slots[:-1] == 1).all())
            out.append(SharedPrefix(members, slots, head_index(slots, *heads), int(slots[0]) if consecutive else None))
    return out


def _common_prefix_len(table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor) -> int:
    """How many leading KV slots all `rows` share, leaving each at least one key of its own."""
    limit = int(seq_lens.min()) - 1
    if limit <= 0:
        return 0
    slots = table[rows, :limit]
    differs = (slots != slots[:1]).any(dim=0)
    return int(differs.to(torch.int8).argmax()) if bool(differs.any()) else limit


def prepare_extend(table: torch.Tensor, fb: ForwardBatch, first: int, heads: tuple[int, int],
                   window: int | None = None) -> list[ExtendBucket]:
    """Length buckets over the extend rows (batch positions first..B-1); `window`: a sliding
    layer's, each query seeing only the keys less than `window` behind it."""
    device = fb.seq_lens.device
    seq_lens = fb.seq_lens[first:].tolist()
    ext = fb.extend_lens[first:]
    token_starts = (torch.cumsum(fb.extend_lens, 0) - fb.extend_lens)[first:]
    buckets = []
    for positions in _length_buckets(seq_lens):
        index = torch.tensor(positions, device=device)
        lens, prefix = ext[index], fb.prefix_lens[first:][index]
        kmax, qmax = max(seq_lens[i] for i in positions), int(lens.max())
        key_pos = torch.arange(kmax, device=device)
        q_idx = torch.arange(qmax, device=device)
        # token j of a row sits at absolute position prefix + j and sees keys 0..prefix + j
        query_pos = (prefix[:, None] + q_idx[None, :])[:, :, None]
        mask = key_pos[None, None, :] <= query_pos
        if window is not None:
            mask &= key_pos[None, None, :] > query_pos - window
        # padded query rows attend to key 0 only, so softmax never sees an all-masked row
        valid_q = (q_idx[None, :] < lens[:, None])[:, :, None]
        mask = mask & valid_q | (~valid_q & (key_pos == 0)[None, None, :])
        dest = torch.repeat_interleave(torch.arange(len(positions), device=device) * qmax, lens) + ragged_arange(lens)
        tokens = torch.repeat_interleave(token_starts[index], lens) + ragged_arange(lens)
        slots = table[fb.req_rows[first:][index], :kmax]
        buckets.append(ExtendBucket(tokens, dest, slots, mask[:, None], qmax, head_index(slots, *heads)))
    return buckets


def _length_buckets(lengths: list[int]) -> list[list[int]]:
    """Positions grouped so that padding each group to its longest is cheapest: minimize
    sum(size x longest) + BUCKET_COST_KEYS per group. Rows are sorted by length and the edges
    chosen (exactly, by dynamic programming) among the points where the length crosses a
    power of BUCKET_GRID, so the work is small whatever the batch size."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    lens = [max(lengths[i], 1) for i in order]
    edges = [0] + [i for i in range(1, len(lens))
                   if math.floor(math.log(lens[i], BUCKET_GRID)) != math.floor(math.log(lens[i - 1], BUCKET_GRID))]
    edges.append(len(lens))
    best = [0.0] + [math.inf] * (len(edges) - 1)  # best[j]: cheapest split of lens[:edges[j]]
    cut = [0] * len(edges)
    for j in range(1, len(edges)):
        for i in range(j):
            cost = best[i] + BUCKET_COST_KEYS + (edges[j] - edges[i]) * lens[edges[j] - 1]
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], len(edges) - 1
    while j > 0:
        groups.append(order[edges[cut[j]]:edges[j]])
        j = cut[j]
    return groups[::-1]
