"""`radixlm serve` whose model raises on any batch that feeds the token FAULT_TOKEN: a stand-in for a
worker fault. The patch is applied at import when this file runs as the program, so the scheduler
process, which multiprocessing's spawn starts by re-running it (as __mp_main__), gets it too; a
plain import (tests reading FAULT_TOKEN) patches nothing."""

from __future__ import annotations

import sys

from runtime.worker.model_worker import ModelWorker

FAULT_TOKEN = 4242
_forward = ModelWorker.forward


def _faulty_forward(self, batch):
    if bool((batch.input_ids == FAULT_TOKEN).any()):
        raise RuntimeError("injected fault")
    return _forward(self, batch)


if __name__ in ("__main__", "__mp_main__"):
    ModelWorker.forward = _faulty_forward

if __name__ == "__main__":
    from runtime.cli import main

    sys.exit(main())
