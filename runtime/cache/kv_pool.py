"""The KV pool: per-layer K and V tensors indexed by slot, in the pool's element type
(`--kv-cache-dtype`: `KVDtype`), and the request -> slot table."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

HALF_MAX = 65504.0  # fp16's largest: fp16 rows saturate there (an inf would make a score or a value NaN)
FP8_MAX = 448.0  # e4m3's largest (it has no inf)


@dataclass(frozen=True)
class KVDtype:
    """How the pool stores one (slot, KV head)'s K or V row of head_dim values.

    fp32, fp16, bf16 and fp8_e4m3 rows are the values in that type, rounded to nearest even
    (fp16 and fp8 saturated at their largest); an int8 row is head_dim codes followed by the row's
    fp32 scale in 4 bytes (symmetric: code = round(x * 127 / max|x|), scale = max|x| / 127; a row
    whose 127 / max|x| overflows is zeros), a scale per row and not per page, since a page is
    written over many steps. Every reader of a pool (the native kernels, the torch and Triton
    backends) converts rows to the compute dtype as it reads them; the native kernels write rows
    bitwise as `encode` does (kernels/cpu/csrc/kv_types.h)."""

    name: str  # fp32, fp16, bf16, int8, fp8_e4m3
    storage: torch.dtype  # the pool tensors' dtype
    scaled: bool = False  # int8: each row its codes, then its scale

    def row(self, head_dim: int) -> int:
        """A row's elements of `storage`: head_dim, and for int8 its scale's 4 bytes."""
        return head_dim + 4 if self.scaled else head_dim

    def head_dim(self, row: int) -> int:
        return row - 4 if self.scaled else row

    def row_bytes(self, head_dim: int) -> int:
        return self.row(head_dim) * self.storage.itemsize

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Rows x [..., head_dim] (any float dtype) as the pool stores them: [..., row] of `storage`."""
        if self.scaled:
            x = x.float()
            amax = x.abs().amax(-1, keepdim=True)
            inv = torch.full_like(amax, 127) / amax
            finite = inv.isfinite()  # not where max|x| is 0 or below ~4e-37: a row of zeros, codes and scale
            codes = torch.round(x * torch.where(finite, inv, 0.0)).to(torch.int8)
            return torch.cat([codes, torch.where(finite, amax / 127, 0.0).contiguous().view(torch.int8)], -1)
        if self.name == "fp16":
            x = x.clamp(-HALF_MAX, HALF_MAX)
        elif self.name == "fp8_e4m3":
            x = x.clamp(-FP8_MAX, FP8_MAX)
        return x.to(self.storage)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored rows [..., row] as `dtype` [..., head_dim] (rows themselves where no conversion is due)."""
        if self.scaled:
            d = self.head_dim(rows.shape[-1])
            return (rows[..., :d].float() * rows[..., d:].contiguous().view(torch.float32)).to(dtype)
        return rows if rows.dtype == dtype else rows.to(dtype)


KV_DTYPES = {k.name: k for k in (KVDtype("fp32", torch.float32), KVDtype("fp16", torch.float16),
                                 KVDtype("bf16", torch.bfloat16), KVDtype("int8", torch.int8, scaled=True),
                                 KVDtype("fp8_e4m3", torch.float8_e4m3fn))}
_OF_TORCH = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def kv_dtype(of: KVDtype | str | torch.dtype) -> KVDtype:
    """The KV type named, or the float type whose values a torch dtype holds."""
    if isinstance(of, KVDtype):
        return of
    if isinstance(of, torch.dtype):
        if of not in _OF_TORCH:
            raise ValueError(f"a KV pool of {of} values is not supported: {', '.join(KV_DTYPES)}")
        return KV_DTYPES[_OF_TORCH[of]]
    if of not in KV_DTYPES:
        raise ValueError(f"kv cache dtype must be one of {', '.join(KV_DTYPES)}, got {of!r}")
    return KV_DTYPES[of]


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
    """K/V of every cached token: k[layer][slot] is [kv_heads, row], a row being head_dim values
    in the pool's `dtype` (a `KVDtype`; an int8 row also holds its scale).

    Stored head-major (`k_heads[layer]` is [kv_heads, slots, row]) so that one KV head's
    keys of a request are contiguous rows once gathered: attention reads them in a batched
    matmul as they lie, with no copy into another layout. `k[layer]` is the slot-major view of
    the same memory. Rows go in through `store` (converted) and come out of a gather through
    `dtype.decode`.
    """

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: KVDtype | str | torch.dtype, device: torch.device | str) -> None:
        self.num_slots = num_slots
        self.head_dim = head_dim
        self.dtype = kv_dtype(dtype)
        # Zeroed, not empty: padded gathers read unused slots, and garbage could hold NaNs
        # that a masked-out attention weight of 0 would still turn into NaN (an int8 row of zeros
        # is zeros: its scale is 0 too). On a CPU the zeros are lazy (`zeroed`): the pool is
        # resident only as far as it has been written.
        shape = (num_kv_heads, num_slots, self.dtype.row(head_dim))
        self.k_heads = [zeroed(shape, self.dtype.storage, device) for _ in range(num_layers)]
        self.v_heads = [zeroed(shape, self.dtype.storage, device) for _ in range(num_layers)]
        self.k = [t.transpose(0, 1) for t in self.k_heads]
        self.v = [t.transpose(0, 1) for t in self.v_heads]

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, kv_heads, head_dim] into `slots`, converted to the pool's type."""
        self.k[layer][slots] = self.dtype.encode(k)
        self.v[layer][slots] = self.dtype.encode(v)

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
        """`gather`'s shape but for the token axis: (2 * layers, kv_heads, row)."""
        return 2 * len(self.k_heads), self.k_heads[0].shape[0], self.k_heads[0].shape[2]

    @property
    def token_bytes(self) -> int:
        """What one token's K and V take in this pool: every layer and KV head, scales included."""
        return 2 * len(self.k_heads) * self.k_heads[0].shape[0] * self.k_heads[0].shape[2] * self.dtype.storage.itemsize

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: KVDtype | str | torch.dtype) -> int:
        """A token's K and V in every layer and KV head, scales included."""
        return 2 * num_layers * num_kv_heads * kv_dtype(dtype).row_bytes(head_dim)


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
