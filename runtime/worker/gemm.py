"""The matmuls over a step's tokens: which CPU kernel runs them, and the batch-invariant mode.

Two fp32 kernels are available in every torch build for CPUs: `F.linear` (MKL's sgemm where
torch was built with it) and oneDNN's inner product (`mkldnn._linear_pointwise`) on weights laid
out for it once (`packed`). oneDNN ran SmolLM2's weight pass 2-3x faster than MKL at 1-256 rows on
an AMD EPYC with AVX-512 (benchmarks/linear_batch.py) and 1.9x on an AVX2-only one, so it is the
default wherever torch has it (`default_kernel`: a fact of the build and the CPU, never a timing,
so a model is served with the same bits every run); `--linear-kernel` forces one. They sum in
different orders, so results differ in the last bits (the HF oracle's tolerance covers it).

Under `--deterministic`, every call on dense weights runs in tiles of exactly INVARIANT_ROWS rows
(the last one zero-padded): one GEMM of one shape per tile, so the kernel, and so its summation
order, never changes with how many tokens share the step. Quantized weights need no tiles: their
native kernel sums each output in one order whatever the batch (quant.py).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, NamedTuple

import torch
import torch.nn.functional as F

from radixlm.runtime.worker.quant import QuantizedMatrix

log = logging.getLogger(__name__)

KERNELS = ("torch", "onednn")
INVARIANT_ROWS = 16


class LinearMode(NamedTuple):
    kernel: str = "torch"  # dense weights' kernel
    invariant: bool = False


_mode: ContextVar[LinearMode] = ContextVar("linear_mode", default=LinearMode())


@contextmanager
def linear_mode(mode: LinearMode) -> Iterator[None]:
    """Within this block `linear` runs as `mode` says (the worker's forward sets it per step)."""
    token = _mode.set(mode)
    try:
        yield
    finally:
        _mode.reset(token)


def current_mode() -> LinearMode:
    return _mode.get()


# the batch size oneDNN is told to expect when it lays a weight out; any other batch size runs on
# the same layout, bitwise as on the plain weight (16 and 64 ran alike: benchmarks/linear_batch.py)
PACK_ROWS = 16


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed(weight), bias, "none", [], "")


def packed(weight: torch.Tensor) -> torch.Tensor:
    """`weight` in oneDNN's own blocked layout, made on first use and kept on the tensor: without it
    oneDNN lays the weight out again on every call, which at decode's few rows costs as much as the
    product (a weight pass at 16 rows: 28 ms plain, 16.5 ms packed). Costs the weight's size again
    in memory (the plain weight stays: embeddings and other kernels read it)."""
    pack = getattr(weight, "_onednn_packed", None)
    if pack is None:
        pack = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
        weight._onednn_packed = pack  # type: ignore[attr-defined]
    return pack


_RUN = {"torch": F.linear, "onednn": _onednn}


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedMatrix, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b for x [rows, in], with the current mode's kernel."""
    mode = _mode.get()
    if isinstance(weight, QuantizedMatrix):  # batch invariant on its codes
        return weight.matmul(x, bias)
    run = _RUN[mode.kernel]
    if not mode.invariant:
        return run(x, weight, bias)
    rows = x.shape[0]
    tiles = -(-rows // INVARIANT_ROWS)
    padded = x.new_zeros(tiles * INVARIANT_ROWS, x.shape[1])
    padded[:rows] = x
    out = x.new_empty(tiles * INVARIANT_ROWS, weight.shape[0])
    for t in range(tiles):
        part = slice(t * INVARIANT_ROWS, (t + 1) * INVARIANT_ROWS)
        out[part] = run(padded[part], weight, bias)
    return out[:rows]


def available(device: torch.device) -> list[str]:
    if device.type == "cpu" and torch.backends.mkldnn.is_available():
        return list(KERNELS)
    return ["torch"]


def default_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """The dense weights' kernel, decided by facts, never by a timing (a race at start would serve
    the same model with other bits from one run to the next): oneDNN on a CPU wherever torch has it,
    for bf16 only where oneDNN multiplies bf16 natively (AVX-512 bf16, AMX); else F.linear."""
    if "onednn" not in available(device) or dtype not in (torch.float32, torch.bfloat16):
        return "torch"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "torch"
    return "onednn"
