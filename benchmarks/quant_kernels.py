"""The native quantized matmuls (kernels/cpu) on this CPU, each ISA path it runs, against the fp32
kernels: the measurement behind serving every batch on the codes.

One pass over a model's weight matrices (`--shapes`: SmolLM2-135M's 121 by default, or a
Llama-3.2-1B's or Llama-3-8B's, a few of their layers; random blocks of each GGUF format the
kernels serve, `kernels/cpu/reference.random_blocks`), best of 3, at a few batch sizes, for fp32
`F.linear`, oneDNN on weights laid out once (`runtime/worker/gemm.py`), and the codes on every ISA
path of `radixlm.kernels.cpu.quant_matmul`.

Printed: ms per pass, the bytes each kernel reads per pass and its GB/s, and each kernel's
largest error on one layer against the same blocks' values in fp32, relative to the largest
output (the kernel's own arithmetic, not the quantization's).

    python benchmarks/quant_kernels.py            # about a minute
    python benchmarks/quant_kernels.py --quick    # two batch sizes, fewer layers, two formats (CI)
    python benchmarks/quant_kernels.py --shapes llama-8b --layers 1   # one 8B layer and its LM head
"""

from __future__ import annotations

import os
import sys
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after site-packages: kernels/ must not shadow the installed `kernels`
from benchmarks.machine import SHAPES, best_of, copy_bandwidth, kernel_bench_args, model_shapes  # noqa: E402
from radixlm.kernels import cpu  # noqa: E402
from radixlm.kernels.cpu import reference  # noqa: E402
from radixlm.runtime.worker import gemm  # noqa: E402

FORMATS = ("Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q8_0")


def codes(shape: tuple[int, int], kind: str, rng: np.random.Generator) -> tuple[cpu.Tiled, torch.Tensor]:
    """Random `kind` blocks of a matrix of `shape` as served, and their values."""
    rows, cols = shape
    cols_k = -(-cols // 256) * 256 if kind in reference.K_FORMATS else cols  # a K-quant block spans 256 columns
    raw = reference.random_blocks(kind, rows, cols_k, rng)
    tiled = cpu.pack([cpu.Part(kind, torch.from_numpy(raw), torch.arange(rows))], cols_k)
    return tiled, torch.from_numpy(reference.dequantize_blocks(kind, raw, cols_k))


def main() -> None:
    args = kernel_bench_args(("--shapes", {"choices": list(SHAPES), "default": "smollm2"}),
                             ("--layers", {"type": int, "default": 0, "help": "layers to take (default: all; quick: 2)"}))
    layers = 2 if args.quick else (args.layers or None)
    rng = np.random.default_rng(0)
    shapes = model_shapes(args.shapes, layers)
    hidden, inter = SHAPES[args.shapes][:2]
    weights = [torch.randn(o, i) * 0.02 for o, i in shapes]
    formats = ("Q4_1", "Q8_0") if args.quick else FORMATS
    served = {kind: [codes(shape, kind, rng) for shape in shapes] for kind in formats}
    fp32_bytes = sum(w.numel() * 4 for w in weights)
    print(f"{args.shapes}: {len(weights)} matrices ({len(shapes) // 4} layers + LM head): fp32 {fp32_bytes / 1e6:.0f} MB, "
          + ", ".join(f"{kind} {sum(t.nbytes for t, _ in qs) / 1e6:.0f} MB" for kind, qs in served.items())
          + " (K-quants: columns rounded up to 256)")
    bandwidth = copy_bandwidth(args.quick)
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (torch's copy, best of 5); \"of copy\": batch 1's GB/s as a "
          "share of it (the pass of a model too large for the caches)\n")

    def fp32(kernel: str) -> Callable[[torch.Tensor, int], torch.Tensor]:
        def run(x: torch.Tensor, i: int) -> torch.Tensor:
            with gemm.linear_mode(gemm.LinearMode(kernel)):
                return gemm.linear(x, weights[i])
        return run

    def on_codes(kind: str, isa: int) -> Callable[[torch.Tensor, int], torch.Tensor]:
        def run(x: torch.Tensor, i: int) -> torch.Tensor:
            tiled = served[kind][i][0]
            return cpu.quant_matmul(x if x.shape[1] == tiled.cols else F.pad(x, (0, tiled.cols - x.shape[1])), tiled, isa)
        return run

    paths: dict[str, tuple[Callable[[torch.Tensor, int], torch.Tensor], int, list[torch.Tensor]]] = {
        "fp32 F.linear": (lambda x, i: F.linear(x, weights[i]), fp32_bytes, weights)}
    if "onednn" in gemm.available(torch.device("cpu")):
        paths["fp32 oneDNN"] = (fp32("onednn"), fp32_bytes, weights)
    for kind, qs in served.items():
        for isa in range(cpu.best_isa() + 1):
            paths[f"{kind} codes {cpu.ISA_NAMES[isa]}"] = (on_codes(kind, isa), sum(t.nbytes for t, _ in qs),
                                                          [v for _, v in qs[:3]])
    batches = [1, 8] if args.quick else [1, 8, 32, 256]
    print("| kernel | " + " | ".join(f"batch {b} ms | GB/s" for b in batches) + " | of copy | max relative error |")
    print("|---|" + "---|---|" * len(batches) + "---|---|")
    for name, (run, nbytes, reference_values) in paths.items():
        cells, share = [], ""
        for b in batches:
            if "portable" in name and b > 8:  # the reference path: its time at prefill sizes says nothing
                cells.append("- | -")
                continue
            xs = {k: torch.randn(b, k) for k in (hidden, inter)}
            def one_pass() -> None:
                for i, w in enumerate(weights):
                    run(xs[w.shape[1]], i)

            one_pass()  # warm: first calls build kernels
            t = best_of(3, one_pass)
            cells.append(f"{t * 1e3:.3g} | {nbytes / t / 1e9:.3g}")  # 3 figures: a slow kernel never shows 0.0
            share = share or f"{nbytes / t / bandwidth:.0%}"
        x = torch.randn(4, hidden)
        values = reference_values[2]
        y = run(x, 2)
        want = F.pad(x, (0, values.shape[1] - x.shape[1])) @ values.t()
        error = ((y - want).abs().max() / want.abs().max()).item()
        print(f"| {name} | " + " | ".join(cells) + f" | {share} | {error:.1e} |")


if __name__ == "__main__":
    main()
