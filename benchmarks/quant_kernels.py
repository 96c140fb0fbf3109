"""The native quantized matmuls (kernels/cpu) on this CPU, each ISA path it runs, against the fp32
kernels: the measurement behind quant.py's choice of codes for decode-sized batches.

One pass over SmolLM2-135M's 121 weight matrices (random values: int4 asymmetric in groups of
32, as Q4_1 is; int8 symmetric in groups of 32, as Q8_0 is), best of 3, at a few batch sizes,
for fp32 `F.linear`, oneDNN on weights laid out once (`runtime/worker/gemm.py`), and the codes on
every ISA path of `radixlm.kernels.cpu.quant_matmul`.

Printed: ms per pass, the bytes each kernel reads per pass and its GB/s, and each kernel's
largest error on one layer against the same quantized weights in fp32 (the kernel's own
arithmetic, not the quantization's).

    python benchmarks/quant_kernels.py            # about a minute
    python benchmarks/quant_kernels.py --quick    # two batch sizes, fewer layers (CI)
"""

from __future__ import annotations

import os
import sys
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after site-packages: kernels/ must not shadow the installed `kernels`
from benchmarks.machine import HIDDEN, INTER, best_of, kernel_bench_args, smollm2_shapes  # noqa: E402
from radixlm.kernels import cpu  # noqa: E402
from radixlm.runtime.worker import gemm, quant  # noqa: E402

GROUP = 32


def codes(w: torch.Tensor, bits: int) -> quant.QuantizedMatrix:
    b = quant.Blocks.int4_from(w, GROUP) if bits == 4 else quant.Blocks.int8_from(w, GROUP)
    return quant.QuantizedMatrix(b)


def main() -> None:
    args = kernel_bench_args()
    layers = 2 if args.quick else 30
    weights = [torch.randn(o, i) * 0.02 for o, i in smollm2_shapes(layers)]
    served = {bits: [codes(w, bits) for w in weights] for bits in (4, 8)}
    fp32_bytes = sum(w.numel() * 4 for w in weights)
    print(f"{len(weights)} matrices ({layers} layers + LM head): fp32 {fp32_bytes / 1e6:.0f} MB, "
          + ", ".join(f"int{bits} {sum(q.code_bytes for q in qs) / 1e6:.0f} MB" for bits, qs in served.items()) + "\n")

    def fp32(kernel: str) -> Callable[[torch.Tensor, int], torch.Tensor]:
        def run(x: torch.Tensor, i: int) -> torch.Tensor:
            with gemm.linear_mode(gemm.LinearMode(kernel)):
                return gemm.linear(x, weights[i])
        return run

    def on_codes(bits: int, isa: int) -> Callable[[torch.Tensor, int], torch.Tensor]:
        def run(x: torch.Tensor, i: int) -> torch.Tensor:
            return cpu.quant_matmul(x, served[bits][i].tiled, isa)
        return run

    paths: dict[str, tuple[Callable[[torch.Tensor, int], torch.Tensor], int, list[torch.Tensor]]] = {
        "fp32 F.linear": (lambda x, i: F.linear(x, weights[i]), fp32_bytes, weights)}
    if "onednn" in gemm.available(torch.device("cpu")):
        paths["fp32 oneDNN"] = (fp32("onednn"), fp32_bytes, weights)
    for bits, qs in served.items():
        for isa in range(cpu.best_isa() + 1):
            paths[f"int{bits} codes {cpu.ISA_NAMES[isa]}"] = (on_codes(bits, isa), sum(q.code_bytes for q in qs),
                                                              [q.dequantize() for q in qs[:3]])
    batches = [1, 8] if args.quick else [1, 8, 32]
    print("| kernel | " + " | ".join(f"batch {b} ms | GB/s" for b in batches) + " | max error |")
    print("|---|" + "---|---|" * len(batches) + "---|")
    for name, (run, nbytes, reference) in paths.items():
        cells = []
        for b in batches:
            xs = {k: torch.randn(b, k) for k in (HIDDEN, INTER)}
            def one_pass() -> None:
                for i, w in enumerate(weights):
                    run(xs[w.shape[1]], i)

            one_pass()  # warm: first calls build kernels
            t = best_of(3, one_pass)
            cells.append(f"{t * 1e3:.3g} | {nbytes / t / 1e9:.3g}")  # 3 figures: a slow kernel never shows 0.0
        x = torch.randn(4, HIDDEN)
        error = (run(x, 2) - x @ reference[2].t()).abs().max().item()
        print(f"| {name} | " + " | ".join(cells) + f" | {error:.1e} |")


if __name__ == "__main__":
    main()
