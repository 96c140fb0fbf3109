"""The weight-only quantized matmuls PyTorch ships for CPUs, on this CPU, against the fp32 path:
the measurement issue 17 (quantized serving) chooses its kernels from.

One pass over SmolLM2-135M's 121 weight matrices (random values, quantized the way each kernel
wants: int4 asymmetric in groups of 32, as Q4_1 is; int8 symmetric per output row), best of 3,
at a few batch sizes, for:

* fp32 `F.linear` and oneDNN on weights laid out once (`runtime/worker/gemm.py`: what runs today);
* `_weight_int4pack_mm_for_cpu` with bf16 and with fp32 activations;
* `_weight_int8pack_mm` with bf16 and with fp32 activations.

Printed: ms per pass, the bytes each kernel reads per pass and its GB/s, and each kernel's
largest error on one layer against the same quantized weights in fp32 (the kernel's own
arithmetic, not the quantization's).

    python benchmarks/quant_kernels.py            # about a minute
    python benchmarks/quant_kernels.py --quick    # two batch sizes, fewer layers (CI)
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.machine import HIDDEN, INTER, best_of, cpu_info, smollm2_shapes  # noqa: E402
from runtime.worker import gemm  # noqa: E402

GROUP = 32


class Int4:
    """A [N, K] weight as int4 in groups of GROUP along K: w ~ (q - 8) * scale + zero."""

    def __init__(self, w: torch.Tensor) -> None:
        n, k = w.shape
        g = w.view(n, k // GROUP, GROUP)
        low, high = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        scale = (high - low).clamp(min=1e-8) / 15
        q = ((g - low) / scale).round().clamp(0, 15)
        zero = low + 8 * scale
        self.dequantized = ((q - 8) * scale + zero).view(n, k)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).view(n, k), 1)
        self.scales = torch.stack([scale.squeeze(-1), zero.squeeze(-1)], -1).transpose(0, 1).contiguous()
        self.bytes = n * k // 2 + self.scales.numel() * 2  # the scales as bf16

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales.to(x.dtype))


class Int8:
    """A [N, K] weight as int8 with one scale per output row."""

    def __init__(self, w: torch.Tensor) -> None:
        self.scales = w.abs().amax(1).clamp(min=1e-8) / 127
        self.q = (w / self.scales[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.dequantized = self.q.float() * self.scales[:, None]
        self.bytes = self.q.numel() + self.scales.numel() * 2

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scales.to(x.dtype))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layers = 2 if args.quick else 30
    weights = [torch.randn(o, i) * 0.02 for o, i in smollm2_shapes(layers)]
    int4 = [Int4(w) for w in weights]
    int8 = [Int8(w) for w in weights]
    fp32_bytes = sum(w.numel() * 4 for w in weights)
    model, features = cpu_info()
    print(f"CPU: {model}, {os.cpu_count()} cores, {args.threads} threads, features: {' '.join(features) or '-'}")
    print(f"{len(weights)} matrices ({layers} layers + LM head): fp32 {fp32_bytes / 1e6:.0f} MB, "
          f"int4 {sum(q.bytes for q in int4) / 1e6:.0f} MB, int8 {sum(q.bytes for q in int8) / 1e6:.0f} MB\n")

    def fp32(kernel: str) -> Callable[[torch.Tensor, int], torch.Tensor]:
        def run(x: torch.Tensor, i: int) -> torch.Tensor:
            with gemm.linear_mode(gemm.LinearMode(kernel)):
                return gemm.linear(x, weights[i])
        return run

    paths: dict[str, tuple[Callable[[torch.Tensor, int], torch.Tensor], torch.dtype, int, list[torch.Tensor]]] = {
        "fp32 F.linear": (lambda x, i: F.linear(x, weights[i]), torch.float32, fp32_bytes, weights),
        "int4 bf16": (lambda x, i: int4[i].run(x), torch.bfloat16, sum(q.bytes for q in int4),
                      [q.dequantized for q in int4]),
        "int4 fp32": (lambda x, i: int4[i].run(x), torch.float32, sum(q.bytes for q in int4),
                      [q.dequantized for q in int4]),
        "int8 bf16": (lambda x, i: int8[i].run(x), torch.bfloat16, sum(q.bytes for q in int8),
                      [q.dequantized for q in int8]),
        "int8 fp32": (lambda x, i: int8[i].run(x), torch.float32, sum(q.bytes for q in int8),
                      [q.dequantized for q in int8]),
    }
    if "onednn" in gemm.available(torch.device("cpu")):
        paths = {"fp32 oneDNN (today)": (fp32("onednn"), torch.float32, fp32_bytes, weights), **paths}
    batches = [1, 8] if args.quick else [1, 8, 32]
    print("| kernel | " + " | ".join(f"batch {b} ms | GB/s" for b in batches) + " | max error |")
    print("|---|" + "---|---|" * len(batches) + "---|")
    for name, (run, dtype, nbytes, reference) in paths.items():
        cells = []
        for b in batches:
            xs = {k: torch.randn(b, k).to(dtype) for k in (HIDDEN, INTER)}
            def one_pass() -> None:
                for i, w in enumerate(weights):
                    run(xs[w.shape[1]], i)

            one_pass()  # warm: first calls build kernels
            t = best_of(3, one_pass)
            cells.append(f"{t * 1e3:.1f} | {nbytes / t / 1e9:.1f}")
        x = torch.randn(4, HIDDEN)
        error = (run(x.to(dtype), 2).float() - x.to(dtype).float() @ reference[2].t()).abs().max().item()
        print(f"| {name} | " + " | ".join(cells) + f" | {error:.1e} |")


if __name__ == "__main__":
    main()
