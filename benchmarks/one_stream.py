"""Decode at batch 1 and 32 per served precision: ms per step, where a batch-1 token's time goes
(GEMM / attention / the rest), and how far it sits from the bandwidth floor of the bytes it reads.

Steps are timed on the scheduler (`Scheduler.step`: model, sampling, bookkeeping), the median
of many, with 128-token prompts on the embedded SmolLM2 GGUF. "batch 1 ms" is the step as
served (on the native kernels: the whole decoder in one call, runtime/worker/native_decoder.py);
"op by op" the same step with the decoder off, each op called from Python, which is where the
split is measured (the one call has no Python in it to time). The split times every matmul
call (`layers.linear`: casts, the kernel, the LM head included) and every attention call
(KV store included, and rotary where the backend fuses it) with wall clocks; "rest" is the step minus both (norms, rotary, residuals,
embedding, sampling, the scheduler). The bytes a batch-1 token reads are the weights its
kernels read (the codes) plus its KV.

    python benchmarks/one_stream.py            # about a minute
    python benchmarks/one_stream.py --quick    # fewer steps, batch 8 for 32 (CI: the script works)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after site-packages: kernels/ must not shadow the installed `kernels`
from benchmarks.machine import measure  # noqa: E402
from benchmarks.step_cost import CONTEXT, Bench  # noqa: E402
from radixlm.runtime.cache.kv_pool import KVPool  # noqa: E402
from radixlm.runtime.local_engine import LocalEngine  # noqa: E402
from radixlm.runtime.worker import layers, quant  # noqa: E402

PRECISIONS = ("none", "auto")


class Clock:
    """Wall time spent inside wrapped callables, by name."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    def wrap(self, name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - start
        return timed


def median_step(b: Bench, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        b.sched.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def batch1_bytes(engine: LocalEngine) -> int:
    """What one batch-1 decode token reads: the weights on its kernels and its KV."""
    model, cfg = engine.worker.model, engine.worker.config
    dense = sum(p.numel() * p.element_size() for p in model.parameters()
                if p is not getattr(model.embed_tokens, "weight", None))  # the table: one row looked up
    table = model.lm_head.weight
    if not isinstance(table, quant.QuantizedMatrix):
        dense += table.numel() * table.element_size()  # the LM head reads all of it
    codes = sum(q.nbytes for q in quant.served_matrices(model))  # a tied table: its LM head reads it whole
    kv = KVPool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, engine.worker.kv_dtype) * (CONTEXT + 8)
    return dense + codes + kv


def served_pass(b: Bench, worker: Any, steps: int) -> float:
    """A served batch-1 step's weight pass: the decoder's one call (every layer's matmuls, with
    its norms and attention) and the LM head, from wall clocks around both; the median step."""
    clock = Clock()
    decoder, real_linear = worker.native_decoder, layers.linear
    real_run = decoder.run
    decoder.run, layers.linear = clock.wrap("pass", real_run), clock.wrap("pass", real_linear)  # the LM head: the step's one linear
    times = []
    try:
        for _ in range(steps):
            clock.spent.clear()
            b.sched.step()
            times.append(clock.spent["pass"])
    finally:
        decoder.run, layers.linear = real_run, real_linear
    return statistics.median(times)


def run(precision: str, steps: int, bandwidth: float, big: int) -> dict[str, Any]:
    engine = LocalEngine(max_total_tokens=20000, skip_tokenizer_init=True, quantization=precision)
    b = Bench(engine)
    rids = b.decoding(1)
    median_step(b, 10)  # warm
    step1 = median_step(b, steps)
    worker = engine.worker
    b.drop(rids)  # a fresh request for each measurement (each decodes at most 400 tokens)
    weight_pass = None
    if worker.native_decoder is not None:
        rids = b.decoding(1)
        weight_pass = served_pass(b, worker, steps)
        b.drop(rids)
    decoder, worker.native_decoder = worker.native_decoder, None  # op by op, to time its parts
    rids = b.decoding(1)
    median_step(b, 3)
    ops1 = median_step(b, steps)
    clock = Clock()
    real_linear, real_attn, real_fused = layers.linear, worker.attn_backend.forward, worker.attn_backend.forward_qkv
    layers.linear = clock.wrap("gemm", real_linear)
    worker.attn_backend.forward = clock.wrap("attention", real_attn)
    worker.attn_backend.forward_qkv = clock.wrap("attention", real_fused)  # the native backend: rotary + store + attend
    start = time.perf_counter()
    for _ in range(steps):
        b.sched.step()
    timed = time.perf_counter() - start
    layers.linear, worker.attn_backend.forward, worker.attn_backend.forward_qkv = real_linear, real_attn, real_fused
    worker.native_decoder = decoder
    b.drop(rids)
    split = {k: v / steps for k, v in clock.spent.items()}
    split["rest"] = timed / steps - sum(split.values())
    rids = b.decoding(big)
    median_step(b, 3)
    step_big = median_step(b, max(5, steps // 5))
    b.drop(rids)
    nbytes = batch1_bytes(engine)
    out = dict(precision=precision, served=worker.quantization.method, step1=step1, ops1=ops1, step_big=step_big,
               decoder=decoder is not None, weight_pass=weight_pass,
               split=split, bytes=nbytes, floor=nbytes / bandwidth, formats=worker.quantization.formats,
               kernels=worker.quantization.kernels)
    engine.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    machine = measure(args.quick)
    print("\n".join(machine.lines()))
    steps = 20 if args.quick else 200
    big = 8 if args.quick else 32  # quick: 8 rows (32 128-token prompts take seconds to prefill in fp32)
    rows = [run(p, steps, machine.bandwidth, big) for p in PRECISIONS]
    print(f"\nDecode on SmolLM2-135M ({CONTEXT}-token prompts), median step:\n")
    print("| --quantization | served | batch 1 ms | tok/s | op by op ms | its GEMM ms | its attention ms | its rest ms "
          f"| MB read per token | floor ms | vs floor | batch {big} ms | tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["split"]
        ops = f"{r['ops1'] * 1e3:.2f}" if r["decoder"] else "(the same)"
        print(f"| {r['precision']} | {r['served']} | {r['step1'] * 1e3:.2f} | {1 / r['step1']:.0f} | {ops} | "
              f"{s.get('gemm', 0) * 1e3:.2f} | {s.get('attention', 0) * 1e3:.2f} | {s['rest'] * 1e3:.2f} | "
              f"{r['bytes'] / 1e6:.1f} | {r['floor'] * 1e3:.2f} | {r['step1'] / r['floor']:.1f}x | "
              f"{r['step_big'] * 1e3:.1f} | {big / r['step_big']:.0f} |")
    for r in rows:
        if r["weight_pass"] is not None:
            rate = r["bytes"] / r["weight_pass"]
            print(f"\n{r['precision']}: the batch-1 weight pass as served (the decoder's call and the LM head) "
                  f"{r['weight_pass'] * 1e3:.2f} ms for {r['bytes'] / 1e6:.1f} MB: {rate / 1e9:.1f} GB/s, "
                  f"{rate / machine.bandwidth:.0%} of the copy bandwidth measured above")
    base = rows[0]
    for r in rows[1:]:
        print(f"\n{r['precision']} against none: batch 1 {base['step1'] / r['step1']:.2f}x, "
              f"batch {big} {base['step_big'] / r['step_big']:.2f}x faster; native kernels: {r['kernels']}; weights: "
              + "; ".join(f"{k}: {v}" for k, v in r["formats"].items()))


if __name__ == "__main__":
    main()
