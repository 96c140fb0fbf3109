"""`radixlm serve` with faults a request can trigger by the tokens it feeds, stand-ins for bugs and
broken hardware:

- FAULT_TOKEN: the model raises on the batch (a worker fault: that batch fails, the server serves on);
- BUILD_FAULT_TOKEN: building the batch's sampling tensors raises (the same, before the forward pass);
- DEVICE_FAULT_TOKEN: the model raises and the device fails its probe (the scheduler must exit).

The patches are applied at import when this file runs as the program, so the scheduler process,
which multiprocessing's spawn starts by re-running it (as __mp_main__, asked for below: the
runtime's launcher otherwise keeps children from re-running the main script), gets them too; a
plain import (tests reading the tokens) patches nothing."""

from __future__ import annotations

import sys

from radixlm.runtime.worker.model_worker import ModelWorker
from radixlm.runtime.worker.sampler import SamplingBatch

RADIXLM_CHILDREN_RUN_MAIN = True  # runtime/launch.py: the spawned processes run this file first

FAULT_TOKEN = 4242
BUILD_FAULT_TOKEN = 4243
DEVICE_FAULT_TOKEN = 4244
_forward = ModelWorker.forward
_build = SamplingBatch.build


def _faulty_forward(self, batch):
    if bool((batch.input_ids == DEVICE_FAULT_TOKEN).any()):
        self.usable_after_fault = lambda: False
        raise RuntimeError("injected device fault")
    if bool((batch.input_ids == FAULT_TOKEN).any()):
        raise RuntimeError("injected fault")
    return _forward(self, batch)


def _faulty_build(params, prompt_ids, *args, **kwargs):
    if any(BUILD_FAULT_TOKEN in ids for ids in prompt_ids):
        raise RuntimeError("injected build fault")
    return _build(params, prompt_ids, *args, **kwargs)


if __name__ in ("__main__", "__mp_main__"):
    ModelWorker.forward = _faulty_forward
    SamplingBatch.build = staticmethod(_faulty_build)

if __name__ == "__main__":
    from radixlm.runtime.cli import main

    sys.exit(main())
