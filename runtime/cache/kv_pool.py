"""The KV pool: per-layer K and V tensors indexed by slot, and the request -> slot table."""

from __future__ import annotations

import math
import mmap

import torch


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor. On a CPU it lives in its own anonymous mapping, whose pages the kernel
    zeroes when first touched: a pool of gigabytes costs resident memory only for the slots
    written, where torch.zeros would write (commit) every page up front. (Not calloc: it may hand
    back freed heap memory, which it must then clear, page by page.)"""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    pages = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


class KVPool:
    """K/V of every cached token: k[layer][slot] is [kv_heads, head_dim].

    Stored head-major (`k_heads[layer]` is [kv_heads, slots, head_dim]) so that one KV head's
    keys of a request are contiguous rows once gathered: attention reads them in a batched
    matmul as they lie, with no copy into another layout. `k[layer]` is the slot-major view of
    the same memory.
    """

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.num_slots = num_slots
        # Zeroed, not empty: padded gathers read unused slots, and garbage could hold NaNs
        # that a masked-out attention weight of 0 would still turn into NaN. On a CPU the zeros
        # are lazy (`zeroed`): the pool is resident only as far as it has been written.
        shape = (num_kv_heads, num_slots, head_dim)
        self.k_heads = [zeroed(shape, dtype, device) for _ in range(num_layers)]
        self.v_heads = [zeroed(shape, dtype, device) for _ in range(num_layers)]
        self.k = [t.transpose(0, 1) for t in self.k_heads]
        self.v = [t.transpose(0, 1) for t in self.v_heads]

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer][slots] = k
        self.v[layer][slots] = v

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """The K and V of `slots` in every layer, copied out: [2 * layers, kv_heads, len(slots),
        head_dim], layer by layer, K then V (what `scatter` takes back)."""
        return torch.stack([t[:, slots] for k, v in zip(self.k_heads, self.v_heads) for t in (k, v)])

    def scatter(self, slots: torch.Tensor, data: torch.Tensor) -> None:
        """Write `gather`'s layout (for as many tokens as `slots`) into `slots`."""
        for i, (k, v) in enumerate(zip(self.k_heads, self.v_heads)):
            k[:, slots] = data[2 * i]
            v[:, slots] = data[2 * i + 1]

    def token_shape(self) -> tuple[int, int, int]:
        """`gather`'s shape but for the token axis: (2 * layers, kv_heads, head_dim)."""
        return 2 * len(self.k_heads), self.k_heads[0].shape[0], self.k_heads[0].shape[2]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


class ReqToTokenTable:
    """Row r, column p holds the KV slot of position p of the request that owns row r.

    `window_table` (models with sliding-window layers, allocator.WindowedPageAllocator): the same
    for the sliding layers' slot space, valid for the positions a request's next queries can see.
    """

    def __init__(self, num_rows: int, max_context: int, device: torch.device | str, windowed: bool = False) -> None:
        # lazily zeroed on a CPU: resident only as far as requests have written it
        self.table = zeroed((num_rows, max_context), torch.int64, device)
        self.window_table = zeroed((num_rows, max_context), torch.int64, device) if windowed else None
        self._free_rows = list(range(num_rows - 1, -1, -1))

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int:
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)
