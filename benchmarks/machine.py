"""This machine, as every benchmark prints it beside its numbers: the CPU, its vector features,
and its measured copy bandwidth and fp32 matmul rate (the roofline a step is held to)."""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import torch

from radixlm.runtime.worker import gemm

FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


@dataclass
class Machine:
    cpu: str
    features: list[str]
    cores: int
    threads: int
    bandwidth: float  # bytes/s, a large copy (read + write)
    matmul: float  # fp32 FLOP/s, a square matmul, the faster of this torch's kernels

    def lines(self) -> list[str]:
        return [f"CPU: {self.cpu}, {self.cores} cores, torch threads {self.threads}, "
                f"features: {' '.join(self.features) or 'none of ' + ' '.join(FEATURES)}",
                f"measured: copy bandwidth {self.bandwidth / 1e9:.1f} GB/s, fp32 matmul {self.matmul / 1e9:.0f} GFLOP/s "
                "(the faster of F.linear and oneDNN, 2048 x 2048 x 2048)"]


def cpu_info() -> tuple[str, list[str]]:
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model, [f for f in FEATURES if f in flags]


def kernel_bench_args(*extra: tuple[str, dict]) -> argparse.Namespace:
    """The kernel tables' command line (--quick, --threads, and `extra` (flag, add_argument's
    options) pairs): torch's threads set, the seed fixed, and the CPU line every table stands
    beside printed."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    for flag, options in extra:
        ap.add_argument(flag, **options)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, features = cpu_info()
    print(f"CPU: {model}, {os.cpu_count()} cores, {args.threads} threads, features: {' '.join(features) or '-'}")
    return args


# SmolLM2-135M's matrix shapes: (out, in) of qkv, o, gate_up, down per layer; the LM head apart
HIDDEN, INTER, QKV, VOCAB = 576, 1536, 960, 49152
# (hidden, intermediate, qkv rows, vocabulary, layers) of the shapes people run, SmolLM2's vocabulary
# (benchmarks/make_models.py's files)
SHAPES = {"smollm2": (HIDDEN, INTER, QKV, VOCAB, 30), "llama-1b": (2048, 8192, 3072, VOCAB, 16),
          "llama-8b": (4096, 14336, 6144, VOCAB, 32)}


def smollm2_shapes(layers: int = 30) -> list[tuple[int, int]]:
    """The weight matrices a SmolLM2 step multiplies by, `layers` decoder layers and the LM head."""
    return model_shapes("smollm2", layers)


def model_shapes(name: str, layers: int | None = None) -> list[tuple[int, int]]:
    """The weight matrices a step of model `name` (SHAPES) multiplies by: `layers` decoder layers
    (default: all of them) and the LM head."""
    hidden, inter, qkv, vocab, depth = SHAPES[name]
    return [(qkv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)] * (layers or depth) + [(vocab, hidden)]


def best_of(tries: int, fn, *args) -> float:
    """The fastest of `tries` timed calls of fn(*args), in seconds."""
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - start)
    return best


def copy_bandwidth(quick: bool = False) -> float:
    """Bytes a second torch's copy reads and writes, best of 5 (1 GB: past any last-level cache)."""
    n = 1 << (24 if quick else 30)
    src = torch.ones(n, dtype=torch.uint8)  # written: untouched pages all read the one zero page, from cache
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * n / best_of(5, dst.copy_, src)


def measure(quick: bool = False) -> Machine:
    bandwidth = copy_bandwidth(quick)
    size = 512 if quick else 2048
    a, b = torch.randn(size, size), torch.randn(size, size)
    flops = 0.0
    for kernel in gemm.available(torch.device("cpu")):
        with gemm.linear_mode(gemm.LinearMode(kernel)):
            gemm.linear(a, b)
            flops = max(flops, 2 * size ** 3 / best_of(3, gemm.linear, a, b))
    model, features = cpu_info()
    return Machine(model, features, os.cpu_count() or 1, torch.get_num_threads(), bandwidth, flops)
