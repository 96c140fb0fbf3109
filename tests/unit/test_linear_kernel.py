"""The dense weights' matmul kernel is a fact of the torch build and the CPU, never a timing."""

from __future__ import annotations

import torch

from radixlm.runtime.worker import gemm


def test_the_dense_kernel_is_decided_by_facts():
    cpu = torch.device("cpu")
    assert torch.backends.mkldnn.is_available()  # torch's CPU wheels ship oneDNN
    assert gemm.default_kernel(cpu, torch.float32) == "onednn"
    bf16_native = torch.ops.mkldnn._is_mkldnn_bf16_supported()  # AVX-512 bf16 or AMX
    assert gemm.default_kernel(cpu, torch.bfloat16) == ("onednn" if bf16_native else "torch")
    assert gemm.default_kernel(cpu, torch.float16) == "torch"
    assert gemm.default_kernel(torch.device("meta"), torch.float32) == "torch"  # not a CPU: F.linear


def test_a_worker_on_dense_weights_takes_that_kernel_without_timing_anything(tiny_llama, monkeypatch):
    """Building an engine times nothing; two on the same weights run the same kernel."""
    import time

    def no_clock():
        raise AssertionError("the worker timed something to choose a kernel")

    monkeypatch.setattr(time, "perf_counter", no_clock)
    engine, again = tiny_llama.engine(), tiny_llama.engine()  # (the shared weights as earlier tests served them)
    monkeypatch.undo()
    assert engine.worker.linear_mode.kernel == again.worker.linear_mode.kernel == gemm.default_kernel(
        engine.worker.device, engine.worker.dtype)
