"""The step's token budget (scheduler/admission.py) on each device."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from radixlm.runtime.args import ServerArgs
from radixlm.runtime.scheduler.admission import step_budget


def pool_on(device: str) -> SimpleNamespace:
    """What step_budget reads of a KV manager with no running requests: its device and free pages."""
    return SimpleNamespace(device=torch.device(device), available_pages=100_000, page_size=1)


def test_the_step_budget_follows_the_pools_device():
    """--chunked-prefill-size unset: 256 tokens a step on a CPU (benchmarks/step_cost.py: more buys
    no throughput there), 8192 on CUDA (SGLang's on large GPUs: a 256-token step of an 8B model
    leaves the GPU idle); given, it holds on either; 0 and -1: no chunking, whole prompts up to
    --max-prefill-tokens."""
    for device, default in (("cpu", 256), ("cuda", 8192)):
        budget = step_budget(ServerArgs(), pool_on(device), [], None, 0.0)
        assert (budget.tokens, budget.chunk) == (default, default), device
        budget = step_budget(ServerArgs(chunked_prefill_size=64), pool_on(device), [], None, 0.0)
        assert (budget.tokens, budget.chunk) == (64, 64), device
        for off in (0, -1):
            budget = step_budget(ServerArgs(chunked_prefill_size=off, max_prefill_tokens=5000), pool_on(device), [],
                                 None, 0.0)
            assert (budget.tokens, budget.chunk) == (5000, None), (device, off)
