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
from radixlm.runtime.worker import gemm, quant  # noqa: E402

GROUP = 32


class Kernel:
    """One of the runtime's quantized matrices (runtime/worker/quant.py), run with activations in
    whatever dtype they come (the runtime always casts them to bf16; fp32 is measured here), and
    the values it multiplies by, in fp32."""

    def __init__(self, matrix: quant.QuantizedMatrix, dequantized: torch.Tensor) -> None:
        self.matrix, self.dequantized, self.bytes = matrix, dequantized, matrix.code_bytes

    def run(self, x: torch.Tensor) -> torch.Tensor:
        m = self.matrix
        if isinstance(m, quant.Int4Matrix):
            return quant._INT4_MM(x, m.packed, m.group, m.scales_zeros.to(x.dtype))
        return quant._INT8_MM(x, m.codes, m.scale.to(x.dtype))


def int4(w: torch.Tensor) -> Kernel:
    """int4 asymmetric in groups of GROUP, as Q4_1 is; the kernel's scale and zero are bf16."""
    b = quant.Blocks.int4_from(w, GROUP)
    scale = b.scale.to(torch.bfloat16).float()
    zero = (b.zero + 8 * b.scale).to(torch.bfloat16).float() - 8 * scale  # the kernel's (code - 8) * s + z
    return Kernel(quant.Int4Matrix(b), b._replace(scale=scale, zero=zero).dequantize())


def int8(w: torch.Tensor) -> Kernel:
    """int8 with one scale per output row."""
    m = quant.Int8Matrix(w)
    return Kernel(m, m.source)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layers = 2 if args.quick else 30
    weights = [torch.randn(o, i) * 0.02 for o, i in smollm2_shapes(layers)]
    int4s = [int4(w) for w in weights]
    int8s = [int8(w) for w in weights]
    fp32_bytes = sum(w.numel() * 4 for w in weights)
    model, features = cpu_info()
    print(f"CPU: {model}, {os.cpu_count()} cores, {args.threads} threads, features: {' '.join(features) or '-'}")
    print(f"{len(weights)} matrices ({layers} layers + LM head): fp32 {fp32_bytes / 1e6:.0f} MB, "
          f"int4 {sum(q.bytes for q in int4s) / 1e6:.0f} MB, int8 {sum(q.bytes for q in int8s) / 1e6:.0f} MB\n")

    def fp32(kernel: str) -> Callable[[torch.Tensor, int], torch.Tensor]:
        def run(x: torch.Tensor, i: int) -> torch.Tensor:
            with gemm.linear_mode(gemm.LinearMode(kernel)):
                return gemm.linear(x, weights[i])
        return run

    paths: dict[str, tuple[Callable[[torch.Tensor, int], torch.Tensor], torch.dtype, int, list[torch.Tensor]]] = {
        "fp32 F.linear": (lambda x, i: F.linear(x, weights[i]), torch.float32, fp32_bytes, weights),
        "int4 bf16": (lambda x, i: int4s[i].run(x), torch.bfloat16, sum(q.bytes for q in int4s),
                      [q.dequantized for q in int4s]),
        "int4 fp32": (lambda x, i: int4s[i].run(x), torch.float32, sum(q.bytes for q in int4s),
                      [q.dequantized for q in int4s]),
        "int8 bf16": (lambda x, i: int8s[i].run(x), torch.bfloat16, sum(q.bytes for q in int8s),
                      [q.dequantized for q in int8s]),
        "int8 fp32": (lambda x, i: int8s[i].run(x), torch.float32, sum(q.bytes for q in int8s),
                      [q.dequantized for q in int8s]),
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
            cells.append(f"{t * 1e3:.3g} | {nbytes / t / 1e9:.3g}")  # 3 figures: a slow kernel never shows 0.0
        x = torch.randn(4, HIDDEN)
        error = (run(x.to(dtype), 2).float() - x.to(dtype).float() @ reference[2].t()).abs().max().item()
        print(f"| {name} | " + " | ".join(cells) + f" | {error:.1e} |")


if __name__ == "__main__":
    main()
