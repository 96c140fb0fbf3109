"""Tensor parallelism across processes: the group, each step's batch sent from rank 0, and the
follower ranks' process.

Rank 0 is the scheduler process's ModelWorker; ranks 1..N-1 are follower processes holding the
other shards. Each step rank 0 broadcasts the batch as two int64 tensors (a fixed header, then
one payload of every field and the batch's rows of the req-to-token table), so nothing but
tensors crosses the group; then every rank runs the same forward pass, whose collectives
(all-reduce after row-parallel layers, all-gather of vocab-parallel logits) line up. Only rank 0
samples.
"""

from __future__ import annotations

import logging
import os
import signal
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from radixlm.runtime.args import ServerArgs
from radixlm.runtime.worker.forward_batch import ForwardMode
from radixlm.runtime.worker.parallel import SINGLE, TPContext

log = logging.getLogger("radixlm.tp")

_MODES = [ForwardMode.EXTEND, ForwardMode.DECODE]
_HEADER = 8  # mode, tokens, requests, sampled rows, prompt rows, table columns, max extend length, decode rows


def init_group(args: ServerArgs, rank: int) -> TPContext:
    """Join the tensor-parallel group as `rank` (gloo on CPUs, NCCL on GPUs); SINGLE for tp size 1."""
    if args.tp_size == 1:
        return SINGLE
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{args.dist_init_addr}",
                            world_size=args.tp_size, rank=rank, timeout=timedelta(seconds=args.dist_timeout))
    return TPContext(rank, args.tp_size, dist.group.WORLD)


def send_batch(b, table: torch.Tensor, tp: TPContext) -> None:
    """Rank 0: broadcast what the other ranks need to run `b` (ModelWorker.forward calls this)."""
    cols = b.max_seq_len
    prompt_rows = b.prompt_rows if b.prompt_rows is not None else b.sample_rows[:0]
    header = torch.tensor([_MODES.index(b.mode), b.input_ids.numel(), b.req_rows.numel(), b.sample_rows.numel(),
                           prompt_rows.numel(), cols, b.max_extend_len, b.num_decode], dtype=torch.int64, device=table.device)
    payload = torch.cat([b.input_ids, b.positions, b.out_slots, b.req_rows, b.prefix_lens, b.extend_lens, b.seq_lens,
                         b.sample_rows, prompt_rows, table[b.req_rows, :cols].reshape(-1)])
    dist.broadcast(header, 0, group=tp.group)
    dist.broadcast(payload, 0, group=tp.group)


def receive_batch(table: torch.Tensor, tp: TPContext):
    """Ranks 1..N-1: the next step's batch (without sampling: rank 0 samples); its rows of the
    req-to-token table are written into `table`."""
    from radixlm.runtime.worker.model_worker import WorkerBatch

    header = torch.empty(_HEADER, dtype=torch.int64, device=table.device)
    dist.broadcast(header, 0, group=tp.group)
    mode, tokens, reqs, sampled, prompt, cols, max_extend, num_decode = header.tolist()
    sizes = [tokens] * 3 + [reqs] * 4 + [sampled, prompt, reqs * cols]
    payload = torch.empty(sum(sizes), dtype=torch.int64, device=table.device)
    dist.broadcast(payload, 0, group=tp.group)
    ids, positions, slots, rows, prefix, ext, seq, sample_rows, prompt_rows, rows_table = payload.split(sizes)
    table[rows, :cols] = rows_table.view(reqs, cols)
    return WorkerBatch(mode=_MODES[mode], input_ids=ids, positions=positions, out_slots=slots, req_rows=rows,
                       prefix_lens=prefix, extend_lens=ext, seq_lens=seq, max_extend_len=max_extend,
                       max_seq_len=cols, sample_rows=sample_rows, sampling=None, prompt_rows=prompt_rows,
                       num_decode=num_decode)


def run_follower(args: ServerArgs, rank: int, ready: Connection) -> None:
    """Entry point of a follower rank's process: load this rank's shards, then run every step rank 0
    sends until the group goes away."""
    from radixlm.runtime import ipc
    from radixlm.runtime.worker.loader import resolve_model
    from radixlm.runtime.worker.model_worker import ModelWorker

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    ipc.die_with_parent(f"radixlm-tp{rank}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        worker = ModelWorker(args, resolve_model(args.model_path), tp=init_group(args, rank))
    except Exception as e:  # noqa: BLE001 - reported to the parent, which exits with it
        log.exception("tensor-parallel rank %d failed to start", rank)
        ready.send({"error": f"{type(e).__name__}: {e}"})
        return
    ready.send({"ok": True})
    try:
        worker.follow()
    except (RuntimeError, dist.DistBackendError) as e:  # rank 0 went away: the group is over
        log.error("tensor-parallel rank %d stops: %s", rank, e)
        os._exit(1)
