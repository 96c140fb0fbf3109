"""Overlap scheduling: the scheduler builds step N+1 while the model runs step N.

The worker's steps run on a thread of their own (`StepThread`), one at a time in launch
order, so the scheduler's Python (choosing and building the next batch, taking the last one's
tokens, stop checks, outputs) runs beside the forward pass. A running request's next input is
the token step N is still sampling: the batch carries a placeholder (`future_id`) that the
worker swaps for the sampled token on the device, and the request's output holds the same
placeholder (`Req.awaiting`) until the step's result is taken. A request that step N ends
rode in step N+1 for nothing: that row's token is dropped, and its pages and row are released
only once no launched step holds them (`Req.in_flight`).

The step thread does not wait for a step's tokens: the worker hands them back still on their
way to the host (`model_worker.Readback`: on CUDA a copy into pinned memory and an event), so
the thread goes straight on to launch the next step behind it, and the GPU is never left idle
waiting for the host between overlapped steps; the scheduler waits on the copy only when it
takes the step back (`WorkerOutput.settle`).

A step overlaps the previous one only when nothing in it depends on that step's tokens
beyond the placeholder (`may_overlap`): no constraint masks, penalties or drafts among the
running requests, no prefill rows in the previous step (their KV enters the prefix cache when
the step is taken back), and room in the pool for every running request's next token (no
retraction of a request a step still holds), and running requests (with none, admission
would judge a prompt alone in a pool that requests ended meanwhile still hold). Otherwise the scheduler takes the running step
back first and builds the next one as it would without overlap.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

from radixlm.runtime.scheduler.admission import step_pages
from radixlm.runtime.scheduler.batch import ScheduledBatch
from radixlm.runtime.scheduler.kv_manager import KVManager
from radixlm.runtime.scheduler.req import Req
from radixlm.runtime.worker.forward_batch import WorkerBatch
from radixlm.runtime.worker.model_worker import ModelWorker, WorkerOutput


class StepThread:
    """Runs the worker's steps on one thread, in the order they are launched."""

    def __init__(self, worker: ModelWorker) -> None:
        self._worker = worker
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="radixlm-step")

    def launch(self, batch: WorkerBatch) -> Future[WorkerOutput]:
        return self._pool.submit(self._worker.forward, batch)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


class InFlight(NamedTuple):
    """A launched step: its batch, its result to come, and when it was built."""

    batch: ScheduledBatch
    result: Future[WorkerOutput]
    started: float


def plain(req: Req) -> bool:
    """Whether a running request's next step can be built before its last token is known."""
    return req.guide is None and not req.draft and not req.params.uses_penalties


def may_overlap(previous: ScheduledBatch, running: list[Req], kv: KVManager) -> bool:
    """Whether the next step can be built while `previous` runs (see the module's docstring)."""
    return (bool(running) and not previous.prefilling and all(plain(r) for r in running)
            and step_pages(kv, running) <= kv.available_pages)
