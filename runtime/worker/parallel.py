"""Tensor parallelism: this rank's place in the group (`TPContext`), the two collectives layers
need, joining the group, and each step's batch sent from rank 0.

Rank 0 is the scheduler process's ModelWorker; ranks 1..N-1 are follower processes
(`tp_worker.Follower`) holding the other shards. Each step rank 0 broadcasts the batch as two
int64 tensors (a header, then one payload of every `StepTokens` tensor, the sampled and prompt
rows, and the batch's rows of the req-to-token table), so nothing but tensors crosses the
group; then every rank runs the same forward pass, whose collectives (all-reduce after
row-parallel layers, all-gather of vocab-parallel logits) line up. Only rank 0 samples.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from radixlm.runtime import cores
from radixlm.runtime.args import ServerArgs
from radixlm.runtime.worker.forward_batch import ForwardMode, StepTokens, WorkerBatch


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

_MODES = [ForwardMode.EXTEND, ForwardMode.DECODE]
# StepTokens' fields by kind: what every rank receives each step (its int64 tensors and integers)
_TENSORS = [f.name for f in fields(StepTokens) if f.type == "torch.Tensor"]
_INTS = [f.name for f in fields(StepTokens) if f.type == "int"]


def on_cuda(args: ServerArgs) -> bool:
    """Whether the ranks run on CUDA (`--device`, auto: when there is a GPU)."""
    return args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())


def place_rank(args: ServerArgs, cpus: list[int] | None) -> None:
    """Pin this rank's process to its share of the machine's cores (`cores.py`; `launch` gives it)
    with as many torch threads as the share has physical cores, or `--num-threads`. Nothing on
    CUDA, nor without a share (`--cpu-bind none`)."""
    if cpus is None or on_cuda(args):
        return
    cores.pin(cpus)
    torch.set_num_threads(args.num_threads or cores.physical_cores(cpus))


def placement() -> dict[str, Any]:
    """This process's cores and torch threads, as the parent reports them (`/get_server_info`)."""
    return {"cpus": cores.format_cpu_list(sorted(os.sched_getaffinity(0))), "torch_threads": torch.get_num_threads()}


def init_group(args: ServerArgs, rank: int) -> TPContext:
    """Join the tensor-parallel group as `rank` (gloo on CPUs, NCCL on GPUs); SINGLE for tp size 1."""
    if args.tp_size == 1:
        return SINGLE
    cuda = on_cuda(args)
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{args.dist_init_addr}",
                            world_size=args.tp_size, rank=rank, timeout=timedelta(seconds=args.dist_timeout))
    return TPContext(rank, args.tp_size, dist.group.WORLD)


def send_batch(b: WorkerBatch, table: torch.Tensor, tp: TPContext) -> None:
    """Rank 0: broadcast what the other ranks need to run `b` (ModelWorker.forward calls this): a
    header (the mode, the step's integers, each tensor's length), then every tensor and the
    batch's rows of the req-to-token table as one payload."""
    cols = b.max_seq_len
    tensors = [getattr(b, name) for name in _TENSORS] + [b.sample_rows, _or_empty(b.prompt_rows, b.sample_rows)]
    header = torch.tensor([_MODES.index(b.mode), *(getattr(b, name) for name in _INTS), *(t.numel() for t in tensors)],
                          dtype=torch.int64, device=table.device)
    payload = torch.cat([*tensors, table[b.req_rows, :cols].reshape(-1)])
    dist.broadcast(header, 0, group=tp.group)
    dist.broadcast(payload, 0, group=tp.group)


def receive_batch(table: torch.Tensor, tp: TPContext) -> WorkerBatch:
    """Ranks 1..N-1: the next step's batch (without sampling: rank 0 samples); its rows of the
    req-to-token table are written into `table`."""
    header = torch.empty(1 + len(_INTS) + len(_TENSORS) + 2, dtype=torch.int64, device=table.device)
    dist.broadcast(header, 0, group=tp.group)
    mode, *rest = header.tolist()
    ints = dict(zip(_INTS, rest[: len(_INTS)]))
    sizes = rest[len(_INTS):]
    reqs, cols = sizes[_TENSORS.index("req_rows")], ints["max_seq_len"]
    payload = torch.empty(sum(sizes) + reqs * cols, dtype=torch.int64, device=table.device)
    dist.broadcast(payload, 0, group=tp.group)
    *tensors, sample_rows, prompt_rows, rows_table = payload.split(sizes + [reqs * cols])
    step = dict(zip(_TENSORS, tensors))
    table[step["req_rows"], :cols] = rows_table.view(reqs, cols)
    return WorkerBatch(mode=_MODES[mode], **ints, **step, sample_rows=sample_rows, sampling=None,
                       prompt_rows=prompt_rows)


def _or_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return t if t is not None else like[:0]
