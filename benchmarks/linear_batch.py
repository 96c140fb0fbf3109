"""The decode step's linear layers alone, by batch size: how fast this CPU's GEMMs read the weights.

One pass over SmolLM2-135M's 121 weight matrices (30 x qkv, o, gate_up, down, plus the LM
head; random fp32 values, 540 MB, so every pass reads them from memory, as a decode step
does), best of 3, for:

* `F.linear`: what the model runs (MKL sgemm; bit-identical to transformers' fp32 path);
* MKL with weights packed ahead for exactly that batch size (`mkl._mkl_linear`, what
  inductor's freezing uses): it runs the packed kernel only when the rows equal the packed size;
* oneDNN (`mkldnn._linear_pointwise`) on the plain weights, and on weights laid out for it once
  (`mkldnn._reorder_linear_weight`, what `--linear-kernel onednn` runs: runtime/worker/gemm.py).

The last column is the largest difference from `F.linear` on one layer: anything but 0 can
flip a greedy near-tie and break token equality with transformers.

    python benchmarks/linear_batch.py [--batches 1,2,4,8,16,32]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after site-packages: kernels/ must not shadow the installed `kernels`
from benchmarks.machine import HIDDEN, INTER, best_of, smollm2_shapes  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,2,4,8,16,32,64,256")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = [torch.randn(o, i) for o, i in smollm2_shapes()]
    total = sum(w.numel() * 4 for w in weights)
    print(f"{len(weights)} matrices, {total / 1e6:.0f} MB, {args.threads} threads\n")
    print("| batch | F.linear ms | GB/s | MKL packed ms | oneDNN ms | oneDNN packed ms | GB/s | MKL packed max diff | oneDNN max diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    dnn_packed = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights]
    for batch in map(int, args.batches.split(",")):
        xs = {i: torch.randn(batch, i) for i in (HIDDEN, INTER)}
        packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, batch) for w in weights]
        plain = best_of(3, lambda: [F.linear(xs[w.shape[1]], w) for w in weights])
        mkl = best_of(3, lambda: [torch.ops.mkl._mkl_linear(xs[w.shape[1]], p, w, None, batch)
                                  for w, p in zip(weights, packed)])
        onednn = best_of(3, lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], w, None, "none", [], "")
                                     for w in weights])
        onednn_packed = best_of(3, lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                            for w, p in zip(weights, dnn_packed)])
        w, x = weights[2], xs[HIDDEN]
        ref = F.linear(x, w)
        d_mkl = (torch.ops.mkl._mkl_linear(x, packed[2], w, None, batch) - ref).abs().max().item()
        d_dnn = (torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") - ref).abs().max().item()
        print(f"| {batch} | {plain * 1e3:.1f} | {total / plain / 1e9:.1f} | {mkl * 1e3:.1f} | {onednn * 1e3:.1f} "
              f"| {onednn_packed * 1e3:.1f} | {total / onednn_packed / 1e9:.1f} | {d_mkl:.1e} | {d_dnn:.1e} |")


if __name__ == "__main__":
    main()
