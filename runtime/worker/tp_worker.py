"""The follower ranks' process: ranks 1..N-1 of a tensor-parallel group (`parallel.py`), each
holding its shards and running every step rank 0 broadcasts; only rank 0 samples."""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

from radixlm.runtime.args import ServerArgs
from radixlm.runtime.worker.parallel import init_group, place_rank, placement

log = logging.getLogger("radixlm.tp")


class Follower:
    """A follower rank's process (launch.run_child starts it): this rank's shards loaded, then every
    step rank 0 sends, until the group goes away."""

    def __init__(self, args: ServerArgs, rank: int, cpus: list[int] | None = None) -> None:
        """`cpus`: this rank's share of the machine's cores (launch.start_processes), or None."""
        from radixlm.runtime.model_config import resolve_model
        from radixlm.runtime.worker.model_worker import ModelWorker

        place_rank(args, cpus)
        self.rank = rank
        self.worker = ModelWorker(args, resolve_model(args.model_path), tp=init_group(args, rank))

    def ready_info(self) -> dict:
        return {"placement": placement()}

    def run_forever(self) -> None:
        try:
            self.worker.follow()
        except (RuntimeError, dist.DistBackendError) as e:  # rank 0 went away: the group is over
            log.error("tensor-parallel rank %d stops: %s", self.rank, e)
            os._exit(1)
