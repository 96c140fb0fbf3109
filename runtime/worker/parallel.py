"""Tensor-parallel context: this rank's place in the group and the two collectives layers need."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPContext:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def shard(self, n: int) -> tuple[int, int]:
        """The [start, end) of this rank's even share of n items."""
        if n % self.size:
            raise ValueError(f"{n} is not divisible by tensor-parallel size {self.size}")
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per

    def kv_heads(self, n: int) -> tuple[int, int]:
        """(how many, first) of the n KV heads this rank holds: an even share, or, with fewer KV
        heads than ranks, one head that `size // n` neighbouring ranks replicate."""
        if n >= self.size:
            start, end = self.shard(n)
            return end - start, start
        if self.size % n:
            raise ValueError(f"{n} KV heads cannot be replicated evenly over tensor-parallel size {self.size}")
        return 1, self.rank // (self.size // n)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TPContext()
